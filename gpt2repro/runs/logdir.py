"""The run's directory (--log_dir): made, claimed against a second run, tidied of what killed
saves left, an earlier run moved aside on starting over, checked for links the run would write
through and checkpoints --resume auto would pass over; and log.jsonl, one record per event, with
its mirrors (wandb, TensorBoard)."""
import json
import os
import re
import shutil
import stat
import sys
import time

from gpt2repro.common.atomic import (LOCK_NAME, CannotClaim, DirectoryInUse, UnusableLock, atomic_open, claim_directory,
                                     file_kind, holds_lock)
from gpt2repro.common.distributed import RunError
from gpt2repro.common.inputs import first_line, parse_json
from gpt2repro.runs import checkpoint_files

# Besides the checkpoints, what a run writes in log_dir: each, where it exists, must be what it is
# named for, and never a link, which the run would write through.
RUN_FILES = {"log.jsonl": ("the run's log", stat.S_ISREG), "tensorboard": ("the run's TensorBoard folder", stat.S_ISDIR),
             "wandb": ("the run's wandb folder", stat.S_ISDIR)}
PREVIOUS_RE = re.compile(r"previous_\d{8}-\d{6}(-\d+)?")  # an earlier run, moved aside by start_over
MOVING = "previous.partial"  # where start_over gathers the earlier run, renamed to previous_<time> once whole


def make_log_dir(log_dir):
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"--log_dir {log_dir}: cannot make it ({e.strerror})") from None


def claim_log_dir(log_dir, enabled):
    """On rank 0 (enabled), the LogDirClaim that refuses a second run in log_dir: two would
    interleave their checkpoints and logs. The kernel releases its lock when the process ends,
    however it ends. A log_dir where the lock cannot be written (read-only, or its .lock not a
    regular file) is refused too."""
    if not enabled:
        return None
    try:
        return LogDirClaim(log_dir, claim_directory(log_dir, "train_gpt2.py run"))
    except CannotClaim as e:
        raise RunError(f"--log_dir {e}") from None


class LogDirLost(Exception):
    """log_dir is no longer the directory the run claimed: found by rank 0 alone, before a write."""


class LogDirClaim:
    """Rank 0's claim on log_dir: the open file that holds its lock, and the check, before the run
    writes or prunes anything there, that log_dir is still the directory it claimed."""

    def __init__(self, log_dir, lock):
        self.log_dir, self.lock = log_dir, lock

    def check(self):
        """LogDirLost where log_dir was removed, or replaced by a directory made anew under its name
        (rm -rf, then another run): the run would write into a directory that is not its own, beside
        a run that holds it, or make one, with no lock. It stops instead, having written nothing there."""
        if not holds_lock(self.log_dir, self.lock):
            raise LogDirLost(f"--log_dir {self.log_dir} was removed or replaced while the run was writing there (its "
                             f"{LOCK_NAME} is not this run's): stopped, writing nothing into what is there now")

    def close(self):
        self.lock.close()


def tidy_log_dir(log_dir, resume, log, enabled):
    """On rank 0 (enabled): removes what killed saves left, puts back whole the run that a killed
    start-over was moving aside (undo_killed_move), and, starting over (--resume none) where a run
    already is, moves that run aside (start_over)."""
    if not enabled:
        return
    try:
        checkpoint_files.remove_unfinished(log_dir)
        undo_killed_move(log_dir, log)
        if resume == "none":
            start_over(log_dir, log)
    except OSError as e:
        raise RunError(f"--log_dir {log_dir}: {first_line(e)}") from None


def undo_killed_move(log_dir, log):
    """Moves back into log_dir what a start-over killed mid-move left in MOVING: the run it was
    moving aside is then whole in log_dir again, for this start's --resume to decide on."""
    moving = os.path.join(log_dir, MOVING)
    if not os.path.lexists(moving):
        return
    mode = os.lstat(moving).st_mode
    if not stat.S_ISDIR(mode):
        raise RunError(f"{moving} is {file_kind(mode)}, not an earlier run being moved aside: move it out of --log_dir")
    names = sorted(os.listdir(moving))
    both = [name for name in names if os.path.lexists(os.path.join(log_dir, name))]
    if both:
        raise RunError(f"{os.path.join(log_dir, both[0])} is also in {moving}, which a start-over killed while moving "
                       f"the earlier run aside left: keep one of the two, and remove the other")
    for name in names:
        os.rename(os.path.join(moving, name), os.path.join(log_dir, name))
    os.rmdir(moving)
    if names:
        log(f"put back into {log_dir} the earlier run that a killed start-over was moving aside: {', '.join(names)}")


def start_over(log_dir, log):
    """Moves the run in log_dir (its RUN_FILES, and whatever is named as a checkpoint) into
    log_dir/previous_<UTC time>/, so that no directory ever holds two runs' checkpoints: gathered
    in MOVING and renamed whole, so that a kill at any point leaves the run whole in one place.
    Then removes the previous_* folders earlier start-overs made, but for those it does not
    replace (why_kept) and those a run trains in (remove_unless_in_use). A log_dir so keeps the
    newest earlier run with a checkpoint, and at most one without, however often a run starts
    over there."""
    names = [name for name in os.listdir(log_dir) if name in RUN_FILES or checkpoint_files.CHECKPOINT_RE.fullmatch(name)]
    if not names:
        return
    moving = os.path.join(log_dir, MOVING)
    os.mkdir(moving)
    for name in names:
        os.rename(os.path.join(log_dir, name), os.path.join(moving, name))
    aside = free_previous_name(log_dir)
    os.rename(moving, aside)
    moved = checkpoint_files.saved_checkpoints(aside)
    removed, kept = [], []
    for path in earlier_runs(log_dir):
        if path == aside:
            continue
        size = megabytes(path)
        why = why_kept(checkpoint_files.saved_checkpoints(path), moved) or remove_unless_in_use(path)
        if why:
            kept.append(f"; kept {path} ({size}): {why}")
        else:
            removed.append(f"{path} ({size})")
    said = f"moved the earlier run ({megabytes(aside)}{'' if moved else ', no checkpoint'}) to {aside}"
    said += f", and removed the one before it, {', '.join(removed)}" if removed else ""
    log(f"--resume none: {said}{''.join(kept)}")


def earlier_runs(log_dir):
    """The previous_<time> folders in log_dir (not links), oldest first."""
    paths = (os.path.join(log_dir, name) for name in sorted(os.listdir(log_dir)) if PREVIOUS_RE.fullmatch(name))
    return [path for path in paths if os.path.isdir(path) and not os.path.islink(path)]


def why_kept(earlier, moved):
    """Why an earlier run stays beside the run a start-over moved aside (earlier, moved: the
    checkpoints of each, as Saved), or None: a run without a checkpoint never replaces one with,
    and no run replaces a later checkpoint of its own (a copy of an older one put back in log_dir,
    a resume of one), whatever the files' times. A checkpoint of another run is older: its run was
    moved aside before the moved one began."""
    if earlier and not moved:
        return "a run without a checkpoint never replaces one with"
    newest = checkpoint_files.newest_of_each_run(moved)
    later = [saved for saved in earlier if saved.run in newest and saved.later_than(newest[saved.run])]
    if later:
        return (f"it holds {os.path.basename(later[-1].path)}, a later checkpoint of the moved run than its "
                f"newest, {os.path.basename(newest[later[-1].run].path)}")
    return None


def remove_unless_in_use(path):
    """Removes the earlier run at path, unless a run holds its lock (one resumed or started in
    that folder), which would die at its next save: then returns why it stays."""
    try:
        lock = claim_directory(path, "train_gpt2.py run")
    except DirectoryInUse as e:
        return f"a run is training in it (pid {e.holder})"
    except UnusableLock:  # a .lock that no run can hold (a link, a directory): no run is in it
        lock = None
    try:
        shutil.rmtree(path)
    finally:
        if lock:
            lock.close()
    return None


def check_log_dir(log_dir, resume, init_from, log, enabled):
    """On rank 0 (enabled), once tidied: refuses, in one line, a log_dir where the run would write
    through a link (check_run_files) or, under --resume auto, pass over a checkpoint in silence
    (check_nothing_passed_over). init_from: the run's --init_from, which may lie in log_dir."""
    if not enabled:
        return
    try:
        check_run_files(log_dir)
        if resume == "auto":
            check_nothing_passed_over(log_dir, init_from, log)
    except OSError as e:
        raise RunError(f"--log_dir {log_dir}: {first_line(e)}") from None


def check_run_files(log_dir):
    """RunError where something the run writes in log_dir (one of RUN_FILES, a checkpoint) is a
    symbolic link, which the run would write through, or not what it is named for."""
    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        mode = os.lstat(path).st_mode
        if name in RUN_FILES and not RUN_FILES[name][1](mode):
            raise RunError(f"{path} is {file_kind(mode)}, not {RUN_FILES[name][0]}: move it out of --log_dir")
        if checkpoint_files.CHECKPOINT_RE.fullmatch(name) and stat.S_ISLNK(mode):
            raise RunError(f"{path} is a symbolic link, not a checkpoint the run may write over: move it out of "
                           f"--log_dir")


def check_nothing_passed_over(log_dir, init_from, log):
    """Under --resume auto, which takes the newest checkpoint in log_dir under the trainer's names:
    RunError where one it would pass over is likelier the one meant: in an earlier run (previous_*),
    a later checkpoint of the same run (Saved.later_than) than the one it takes; where log_dir holds
    none under those names, one there under another (a copy named ckpt.pt; not init_from). A line
    names such a one beside the trainer's own, and an earlier run's newest where log_dir holds none."""
    named = checkpoint_files.saved_checkpoints(log_dir)
    earlier = [checkpoint_files.saved_checkpoints(path) for path in earlier_runs(log_dir)]
    later = [saved for checkpoints in earlier for saved in checkpoints if saved.later_than(named[-1])] if named else []
    if later:
        newer = checkpoint_files.newest_of_each_run(later)[named[-1].run]
        raise RunError(f"{newer.path} is a later checkpoint of the run of {named[-1].path}, the newest checkpoint in "
                       f"{log_dir}, which --resume auto would take (a start-over cut short, a copy put back?): name "
                       f"the one to resume with --resume PATH")
    unnamed = [path for path in checkpoint_files.unnamed_checkpoints(log_dir) if not same_file(path, init_from)]
    if unnamed and not named:
        raise RunError(f"{unnamed[0]} is a checkpoint under a name that --resume auto does not take (ckpt_XXXXXX.pt, "
                       f"ckpt_XXXXXX/), and {log_dir} holds none that it does: resume it with --resume {unnamed[0]}, "
                       f"or move it out of --log_dir to start from step 0")
    if unnamed:
        log(f"note: {unnamed[0]} is a checkpoint under a name that --resume auto does not take: "
            f"--resume {unnamed[0]} resumes it")
    with_any = [checkpoints for checkpoints in earlier if checkpoints]
    if with_any and not named:
        newest = max(with_any[-1], key=lambda saved: saved.step)
        log(f"note: no checkpoint in {log_dir} to resume; the newest of the earlier run that --resume none moved "
            f"aside is {newest.path}: --resume {newest.path} resumes it")


def same_file(path, other):
    """Whether other names an existing file or folder, the one at path."""
    return os.path.exists(other) and os.path.samefile(path, other)


def free_previous_name(log_dir):
    """log_dir/previous_<UTC time>, with -1, -2, ... after it where a kept earlier run, moved
    aside within the same second, has the name."""
    base = os.path.join(log_dir, time.strftime("previous_%Y%m%d-%H%M%S", time.gmtime()))
    path, n = base, 0
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def megabytes(directory):
    """The size of the files under directory, as "84.2 MB"."""
    size = sum(os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(directory) for name in files)
    return f"{size / 1e6:,.1f} MB"


class MetricsLog:
    """log.jsonl: one JSON object per event, all with `step` and `tokens`. A run that trains from
    step s keeps the records of steps before s: those of later steps, written after that
    checkpoint by a run that then died, are dropped, so no step is counted twice (keep_before=s;
    None keeps every record). Each record also goes to the mirrors (wandb, TensorBoard). claim:
    rank 0's LogDirClaim, checked before each write (None where unclaimed)."""

    def __init__(self, log_dir, keep_before, enabled, mirrors=(), claim=None):
        self.path = os.path.join(log_dir, "log.jsonl")
        self.enabled = enabled
        self.mirrors = mirrors
        self.claim = claim
        if enabled:  # rewritten even when every record is kept: a half-written last line goes
            self.check_claim()
            kept = self._records_before(keep_before)
            try:
                with atomic_open(self.path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
            except OSError as e:  # a full disk: the file stays as it was, and training goes on
                print(f"warning: could not rewrite {self.path}: {e}", file=sys.stderr)

    def _records_before(self, step):
        if not os.path.exists(self.path):
            return []
        kept, skipped = [], 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = parse_json(line)
                except ValueError:  # the last line of a run killed mid-write, bytes that are not UTF-8, nested too deep
                    record = None
                if not (isinstance(record, dict) and type(record.get("step")) is int):
                    skipped += 1
                elif step is None or record["step"] < step:
                    kept.append(record)
        if skipped:
            print(f"warning: {self.path}: skipped {skipped} line(s) that are not records of a step", file=sys.stderr)
        return kept

    def write(self, **record):
        if self.enabled:
            self.check_claim()
            try:
                with open(self.path, "a", opener=no_follow) as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # a full disk: a record lost costs less than the run
                print(f"warning: could not append to {self.path}: {e}", file=sys.stderr)
            for mirror in self.mirrors:
                mirror(record)

    def check_claim(self):
        if self.claim:
            self.claim.check()


def no_follow(path, flags):
    """open()'s opener that never follows a link put in the file's place (check_run_files refused one
    before the run): opening it is an OSError (ELOOP)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def log_mirrors(cfg, enabled):
    """Callables that copy each log record to wandb and/or TensorBoard, imported only when asked for
    (on every rank, so that a missing package stops them all), made only where enabled (rank 0);
    cfg: the run's TrainConfig."""
    mirrors = []
    if cfg.runtime.wandb:
        try:
            import wandb
        except ImportError:
            raise RunError("--wandb needs the wandb package: pip install wandb") from None
    if cfg.runtime.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RunError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if not enabled:
        return mirrors
    if cfg.runtime.wandb:
        wandb_run = wandb.init(project=cfg.runtime.wandb_project, name=os.path.basename(os.path.abspath(cfg.log_dir)),
                         dir=cfg.log_dir, config=cfg.flags())
        mirrors.append(lambda r: wandb_run.log({k: v for k, v in r.items() if k != "step"}, step=r["step"]))
    if cfg.runtime.tensorboard:
        writer = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))

        def to_tensorboard(record):
            for key, value in record.items():
                if key == "samples":
                    writer.add_text(key, "\n\n".join(value), record["step"])
                elif key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, record["step"])
            writer.flush()
        mirrors.append(to_tensorboard)
    return mirrors
