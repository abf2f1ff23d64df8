"""The run's directory (--log_dir): made, claimed against a second run, tidied of what killed
saves left; and log.jsonl, one record per event, with its mirrors (wandb, TensorBoard)."""
import json
import os
import re
import shutil
import sys
import time

import checkpoint
from atomic import CannotClaim, atomic_open, claim_directory
from cli import first_line
from distributed import RunError
from inputs import parse_json

RUN_FILES = ("log.jsonl", "tensorboard", "wandb")  # besides the checkpoints, what a run writes in log_dir
PREVIOUS_RE = re.compile(r"previous_\d{8}-\d{6}(-\d+)?")  # an earlier run, moved aside by tidy_log_dir


def make_log_dir(log_dir):
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"--log_dir {log_dir}: cannot make it ({e.strerror})") from None


def claim_log_dir(log_dir, enabled):
    """On rank 0 (enabled), the lock that refuses a second run in log_dir: two would interleave
    their checkpoints and logs. The kernel releases it when the process ends, however it ends. A
    log_dir where the lock cannot be written (read-only, or its .lock not a regular file) is refused too."""
    if not enabled:
        return None
    try:
        return claim_directory(log_dir, "train_gpt2.py run")
    except CannotClaim as e:
        raise RunError(f"--log_dir {e}") from None


def tidy_log_dir(log_dir, resume, log, enabled):
    """On rank 0 (enabled): removes what killed saves left; starting over (--resume none) where a
    run already is, moves that run's files into log_dir/previous_<time>/, so that no directory
    ever holds two runs' checkpoints. The previous_<time>/ folders earlier start-overs made are
    removed, but a run without a checkpoint (a start killed or failed before its first) never
    replaces one with: log_dir keeps the newest earlier run with a checkpoint, and at most one
    without, however often a run starts over there."""
    if not enabled:
        return
    try:
        checkpoint.remove_unfinished(log_dir)
        names = [name for name in os.listdir(log_dir) if name in RUN_FILES or checkpoint.CHECKPOINT_RE.fullmatch(name)]
        if resume != "none" or not names:
            return
        with_checkpoint = any(checkpoint.CHECKPOINT_RE.fullmatch(name) for name in names)
        older = [path for path in (os.path.join(log_dir, name) for name in sorted(os.listdir(log_dir))
                                   if PREVIOUS_RE.fullmatch(name)) if os.path.isdir(path) and not os.path.islink(path)]
        kept = [path for path in older if not with_checkpoint and checkpoint.list_checkpoints(path)]
        removed = [path for path in older if path not in kept]
        removed_sizes = sized(removed)
        for path in removed:
            shutil.rmtree(path)
        aside = free_previous_name(log_dir)
        os.makedirs(aside)
        for name in names:
            os.rename(os.path.join(log_dir, name), os.path.join(aside, name))
    except OSError as e:
        raise RunError(f"--log_dir {log_dir}: {first_line(e)}") from None
    said = f"moved the earlier run ({megabytes(aside)}{'' if with_checkpoint else ', no checkpoint'}) to {aside}"
    said += f", and removed the one before it, {removed_sizes}" if removed else ""
    said += f"; kept {sized(kept)}: a run without a checkpoint never replaces one with" if kept else ""
    log(f"--resume none: {said}")


def free_previous_name(log_dir):
    """log_dir/previous_<UTC time>, with -1, -2, ... after it where a kept earlier run, moved
    aside within the same second, has the name."""
    base = os.path.join(log_dir, time.strftime("previous_%Y%m%d-%H%M%S", time.gmtime()))
    path, n = base, 0
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def sized(paths):
    """Each of paths with its size, as "log/previous_20261127-101010 (84.2 MB)"."""
    return ", ".join(f"{path} ({megabytes(path)})" for path in paths)


def megabytes(directory):
    """The size of the files under directory, as "84.2 MB"."""
    size = sum(os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(directory) for name in files)
    return f"{size / 1e6:,.1f} MB"


class MetricsLog:
    """log.jsonl: one JSON object per event, all with `step` and `tokens`. A run that trains from
    step s keeps the records of steps before s: those of later steps, written after that
    checkpoint by a run that then died, are dropped, so no step is counted twice (keep_before=s;
    None keeps every record). Each record also goes to the mirrors (wandb, TensorBoard)."""

    def __init__(self, log_dir, keep_before, enabled, mirrors=()):
        self.path = os.path.join(log_dir, "log.jsonl")
        self.enabled = enabled
        self.mirrors = mirrors
        if enabled:  # rewritten even when every record is kept: a half-written last line goes
            kept = self._records_before(keep_before)
            try:
                with atomic_open(self.path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
            except OSError as e:  # a full disk: the file stays as it was, and training goes on
                print(f"warning: could not rewrite {self.path}: {e}", file=sys.stderr)

    def _records_before(self, step):
        if os.path.isdir(self.path):
            raise RunError(f"{self.path} is a directory, not the run's log: move it out of --log_dir")
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
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # a full disk: a record lost costs less than the run
                print(f"warning: could not append to {self.path}: {e}", file=sys.stderr)
            for mirror in self.mirrors:
                mirror(record)


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
