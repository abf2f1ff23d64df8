"""Checkpoints as files: where they are in a log_dir, and the two formats they come in, written
atomically, read as plain data, never by running pickled code. The formats differ only in the
writer (save_one_file, save_sharded) and the reader (OneFileCheckpoint, ShardedCheckpoint), and
which one a path holds is asked in one place (checkpoint_format):
- ckpt_{step:06d}.pt, one file that torch.save writes (rank 0 alone, under DDP or one process);
- ckpt_{step:06d}/, a torch.distributed.checkpoint (DCP) directory into whose storage files
  every rank writes its own slices of the parts that hold tensors there, the model and the
  optimizer (under FSDP), beside train_state.pt with the rest; the storage files are read as
  plain data by dcp_reader.py.
Every reader goes through load_checkpoint. This file reads in the order of a resume: where
checkpoints are in a log_dir, how they are read into a run's parts, then how they are written.
"""
import concurrent.futures
import glob
import os
import pickle
import re
import secrets
import shutil
import stat
import sys
import warnings
import zipfile
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from gpt2repro.common.atomic import atomic_open
from gpt2repro.common.distributed import every_rank, host_group
from gpt2repro.common.inputs import PLAIN_TYPES, brief, first_line, structure_problem
from gpt2repro.runs.dcp_reader import CheckpointError, check_storage_files, dcp_load, read_metadata, refuse_link

CHECKPOINT_RE = re.compile(r"ckpt_(\d+)(\.pt)?$")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP
TRAIN_STATE = "train_state.pt"  # in a sharded checkpoint: all but the model's and the optimizer's tensors


# ----------------------------------------------------------------------------- where they are: log_dir

def checkpoint_path(log_dir, step, sharded=False):
    return os.path.join(log_dir, f"ckpt_{step:06d}" + ("" if sharded else ".pt"))


def checkpoint_step(path):
    return int(CHECKPOINT_RE.search(path).group(1))


def named_checkpoints(log_dir):
    """What log_dir holds under the names the trainer gives its checkpoints (ckpt_XXXXXX.pt, a
    folder ckpt_XXXXXX/), oldest step first, whatever it is: a damaged one, an empty file, a link."""
    paths = [p for p in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*"))
             if CHECKPOINT_RE.search(p) and os.path.isdir(p) != p.endswith(".pt")]
    return sorted(paths, key=checkpoint_step)


def list_checkpoints(log_dir):
    """The checkpoints in log_dir of either kind (is_checkpoint), under the trainer's names, oldest
    step first. A sharded one is complete only under its final name: it is written under another
    and renamed."""
    return [saved.path for saved in saved_checkpoints(log_dir)]


def saved_checkpoints(log_dir):
    """list_checkpoints(log_dir), each as a Saved: where it stands among others."""
    return [saved for saved in map(read_saved, named_checkpoints(log_dir)) if saved]


def unnamed_checkpoints(log_dir):
    """The checkpoints in log_dir (is_checkpoint) under names the trainer does not give them, which
    --resume auto does not take: a copy named ckpt.pt, say."""
    named = set(named_checkpoints(log_dir))
    paths = (os.path.join(log_dir, name) for name in sorted(os.listdir(log_dir)))
    return [path for path in paths if path not in named and is_checkpoint(path)]


def is_checkpoint(path):
    """Whether path is a run's checkpoint by what it is, whatever its name: one its reader accepts
    (read_saved)."""
    return read_saved(path) is not None


class Saved(NamedTuple):
    """A checkpoint as it stands among others, by its record: its path, the identity of its run
    (None in one written before runs had one), its step, and when it was saved (its modification
    time in ns; a sharded one's .metadata's, which a rename never changes), which orders only
    checkpoints without an identity."""
    path: str
    run: str | None
    step: int
    saved_ns: int

    def later_than(self, other):
        """Whether this holds a later state of other's run than other: a later step of the same
        run. Checkpoints without an identity count as one run, ordered by when they were saved, as
        before runs had one; against one with an identity, as another run."""
        if self.run != other.run:
            return False
        return self.saved_ns > other.saved_ns if self.run is None else self.step > other.step


def read_saved(path):
    """The checkpoint at path as a Saved, once its reader accepts it (load_checkpoint's, its tensors
    memory-mapped, not read): else None. A link, an empty file or folder, a copy cut short, a zip
    that holds torch.save's names but not its data, a pickle that would construct anything, a
    record of no step (a model's, not a run's) never is a checkpoint, whatever its name."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return None
        kind = checkpoint_format(path)
        if kind is None or (kind is OneFileCheckpoint and not is_torch_file(path)):
            return None
        state = kind.load(path, mmap=True).state
        saved_ns = os.lstat(os.path.join(path, ".metadata") if kind is ShardedCheckpoint else path).st_mtime_ns
    except (CheckpointError, OSError):
        return None
    step = state.get("step")
    return Saved(path, state.get("run"), step, saved_ns) if is_step(step) else None


def is_step(value):
    """Whether value can be a checkpoint's step: an int (not a bool) of 0 or more."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def newest_of_each_run(saved):
    """{run: its newest checkpoint} of saved, Saved checkpoints."""
    newest = {}
    for checkpoint in saved:
        if checkpoint.run not in newest or checkpoint.later_than(newest[checkpoint.run]):
            newest[checkpoint.run] = checkpoint
    return newest


def is_torch_file(path):
    """Whether path is a regular file (not a link) in torch.save's format: a zip whose entries
    lie in one folder that holds data.pkl and version. Only the zip's directory, at its end, is
    read: a cheap first look, before its reader's."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    folders = {name.split("/", 1)[0] for name in names}
    if len(folders) != 1:
        return False
    folder = folders.pop()
    return f"{folder}/data.pkl" in names and f"{folder}/version" in names


def find_resume(resume, log_dir):
    """The Checkpoint to resume from, or None to start fresh: resume is "none", "auto" (the newest
    checkpoint in log_dir that loads) or a checkpoint's path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(log_dir)
    return load_checkpoint(resume)


def latest_checkpoint(log_dir, map_location="cpu", before=None):
    """The newest checkpoint in log_dir (of a step before `before`, if given) that loads, as a
    Checkpoint, or None if nothing there is named as one. A damaged newer one (a bad disk, a
    hand edit, a copy cut short) is skipped with a warning; if every one is damaged,
    CheckpointError: starting again from step 0 would overwrite the run they hold."""
    every = named_checkpoints(log_dir)
    paths = [p for p in every if before is None or checkpoint_step(p) < before]
    problems = []
    for path in reversed(paths):
        try:
            checkpoint = load_checkpoint(path, map_location)
        except CheckpointError as e:
            problems.append(e)
            continue
        for problem in problems:
            print(f"warning: skipping {problem}", file=sys.stderr)
        return checkpoint
    if every:
        names = ", ".join(os.path.basename(p) for p in every)
        raise CheckpointError(f"no checkpoint in {log_dir} can be read ({names}): repair them, or start over with "
                              f"--resume none, which moves them aside")
    return None


def check_no_later_checkpoints(log_dir, step):
    """Training on from an older checkpoint into a log_dir that holds checkpoints of later steps
    would interleave two runs there, and --resume auto or --keep_last would later take the wrong files."""
    later = [p for p in list_checkpoints(log_dir) if checkpoint_step(p) > step]
    if later:
        raise CheckpointError(f"{log_dir} holds checkpoints past step {step} ({os.path.basename(later[-1])}, ...): "
                              f"training from step {step} there would mix two runs; choose another --log_dir, "
                              f"or delete them to branch off")


def prune_checkpoints(log_dir, keep_last):
    """Keeps the newest keep_last checkpoints (keep_last <= 0 keeps all) and deletes whatever is
    named as one of an older step, and what saves that were killed left behind. Only checkpoints
    count (is_checkpoint): a newer empty file never costs a real one."""
    remove_unfinished(log_dir)
    kept = list_checkpoints(log_dir)[-keep_last:] if keep_last > 0 else []
    for path in named_checkpoints(log_dir) if kept else []:
        if checkpoint_step(path) < checkpoint_step(kept[0]):
            remove_entry(path)


def remove_unfinished(log_dir):
    """Removes the temporary files and .partial directories of saves that a SIGKILL or a power cut
    ended (each as large as a checkpoint). Only one run writes into a log_dir at a time."""
    for path in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*")):
        if re.search(r"ckpt_\d+(\.pt\.tmp[0-9a-f]+|\.partial)$", path):
            remove_entry(path)


def remove_entry(path):
    """Removes path: a directory with all it holds, or a file or a link (never what a link leads to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# ----------------------------------------------------------------------------- reading them

def load_checkpoint(path, map_location="cpu"):
    """The checkpoint at path, in its format (checkpoint_format), loaded with weights_only=True:
    tensors and plain data only. A pickle that would construct anything else, code included, is
    refused before any of it runs. Of a sharded checkpoint, only train_state.pt: its tensors are
    read into the parts that hold them (saved_states). What is neither format is read as one
    file, whose reader says what it is not."""
    return (checkpoint_format(path) or OneFileCheckpoint).load(path, map_location)


def checkpoint_format(path):
    """The format of the checkpoint at path by its layout, nothing read: ShardedCheckpoint for a
    directory that holds train_state.pt (a link there is one, to be refused), OneFileCheckpoint
    for a file, None for anything else. The one place that asks which."""
    if os.path.isdir(path) and os.path.lexists(os.path.join(path, TRAIN_STATE)):
        return ShardedCheckpoint
    return OneFileCheckpoint if os.path.isfile(path) else None


class Checkpoint(NamedTuple):
    """A checkpoint as load_checkpoint read it: its path, and its state, the record and the parts'
    states that it holds as plain data. Its format's class reads a run's parts from it."""
    path: str
    state: dict


class OneFileCheckpoint(Checkpoint):
    """ckpt_{step:06d}.pt: every part's state and the record in one file that torch.save writes."""
    __slots__ = ()

    @classmethod
    def load(cls, path, map_location="cpu", mmap=False):
        """mmap: its tensors memory-mapped, read only once used."""
        return cls(path, _load_plain(path, map_location, mmap=mmap))

    def holds(self, key, parts):
        """Whether it holds key: a field of the record, or the state of one of parts."""
        return key in self.state

    def saved_states(self, parts):
        """(name, load, saved) for each of parts: the part's load and what the checkpoint holds of it."""
        return [(name, part.load_state_dict, self.state[name]) for name, part in parts.items()]


class ShardedCheckpoint(Checkpoint):
    """ckpt_{step:06d}/: the tensors of the parts in_storage in DCP's storage files, each rank's
    slices apart; the other parts' states and the record in train_state.pt, its state."""
    __slots__ = ()

    @classmethod
    def load(cls, path, map_location="cpu", mmap=False):
        """mmap: the tensors of train_state.pt memory-mapped, read only once used."""
        check_storage_files(path, read_metadata(path).storage_data)  # what can be checked before reading them
        refuse_link(os.path.join(path, TRAIN_STATE))
        return cls(path, _load_plain(os.path.join(path, TRAIN_STATE), map_location, require=("config",), mmap=mmap))

    def holds(self, key, parts):
        """Whether it holds key: a field of the record, or the state of one of parts."""
        return key in self.state or key in in_storage(parts)

    def saved_states(self, parts):
        """(name, load, saved) for each of parts: the part's load and what the checkpoint holds of
        it. The tensors of the parts in_storage are read first, in DCP's form, from its storage
        files: each rank reads only the pieces of its slices, on any number of ranks or in one
        process."""
        tensors = {name: apart(parts[name].dcp_state_dict()) for name in in_storage(parts)}
        with restoring(self.path, " and ".join(tensors)):
            dcp_load(tensors, self.path)
        return [(name, part.load_dcp_state_dict, tensors[name]) if name in tensors else
                (name, part.load_state_dict, self.state[name]) for name, part in parts.items()]


def apart(state_dict):
    """state_dict (DCP's form) with each tensor that shares its memory with an earlier one (the
    head, tied to the token embedding) replaced by an empty one like it: read into shared memory,
    one entry would overwrite another unseen, where read apart the part can compare them."""
    seen, parted = set(), {}
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            memory = (value.to_local() if isinstance(value, DTensor) else value).untyped_storage().data_ptr()
            value = torch.empty_like(value) if memory in seen else value
            seen.add(memory)
        parted[key] = value
    return parted


def _load_plain(path, map_location, require=("model", "config"), mmap=False):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        unsafe = re.search(r"GLOBAL (\S+)", str(e))  # a pickle that would build an object: code can hide there
        if unsafe:
            raise CheckpointError(f"{path}: refused: not a plain-data checkpoint (it would construct "
                                  f"{unsafe.group(1)}); nothing in it was run") from None
        raise CheckpointError(f"{path}: not a checkpoint (no file that torch.save writes); nothing in it was run") from None
    except Exception as e:  # truncated, overwritten, not a torch file at all
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint ({type(e).__name__}: {detail})") from None
    if not isinstance(state, dict) or any(key not in state for key in require):
        raise CheckpointError(f"{path}: not a checkpoint of this project (no {' or '.join(require)})")
    problem = contents_problem(state)
    if problem:
        raise CheckpointError(f"{path}: not a checkpoint of this project ({problem})")
    if "model" in state:
        state["model"] = plain_state_dict(state["model"])
    return state


# How deep a checkpoint's plain data nests: optimizer, a MuonAdamW's part, param_groups, a group, its betas.
CHECKPOINT_DEPTH = 6


# The fields that are records, dicts of plain values, and how deep: GPTConfig's fields; the run's
# flags ("args" in checkpoints written before that name), whose --fault is a list of dicts.
RECORD_DEPTHS = {"config": 1, "flags": 3, "args": 3}
# A run's identity, recorded in each of its checkpoints (absent from those written before): made
# at its start, kept by every resume of it.
RUN_IDENTITY = re.compile(r"[0-9a-f]{32}")


def new_run_identity():
    return secrets.token_hex(16)


def contents_problem(state):
    """Why a loaded checkpoint cannot be used or printed at a bounded cost, or None: it must be
    tensors and plain data CHECKPOINT_DEPTH deep at most, its model a dict, its records dicts of
    plain values, its run (if recorded) a run's identity."""
    if not isinstance(state.get("model", {}), dict):
        return f"its model is {brief(state['model'])}, not a state dict"
    run = state.get("run")
    if run is not None and not (isinstance(run, str) and RUN_IDENTITY.fullmatch(run)):
        return f"its run is {brief(run)}, not a run's identity"
    for field, depth in RECORD_DEPTHS.items():
        if field in state and not isinstance(state[field], dict):
            return f"its {field} is {brief(state[field])}, not a dict of values"
        problem = structure_problem(state.get(field, {}), depth)
        if problem:
            return f"its {field} {problem}"
    problem = structure_problem(state, CHECKPOINT_DEPTH, leaves=(torch.Tensor, *PLAIN_TYPES))
    return f"it {problem}" if problem else None


def plain_state_dict(state_dict):
    """Model keys without the prefixes torch.compile and DDP add, so any script can load them."""
    def strip(key):
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key
    return {strip(k): v for k, v in state_dict.items()}


def in_storage(parts):
    """The names of the parts whose tensors a sharded checkpoint holds in DCP's storage files."""
    return [name for name, part in parts.items() if hasattr(part, "dcp_state_dict")]


class Unrestorable(Exception):
    """Why a part cannot restore the state it was given: restoring names the checkpoint and the part."""


@contextmanager
def restoring(path, field):
    """Restoring field from the checkpoint at path: a value that cannot be restored (a hand-edited
    or foreign file's) is one CheckpointError naming both, never a traceback."""
    try:
        yield
    except Unrestorable as e:
        raise CheckpointError(f"{path}: its {field} cannot be restored ({e})") from None
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{path}: its {field} cannot be restored ({type(e).__name__}: {first_line(e)})") from None


def refuse_on_every_rank(problem):
    """Unrestorable, on every rank, for the first rank's problem where any has one."""
    problems = [p for p in every_rank(problem) if p]
    if problems:
        raise Unrestorable(problems[0])


def load_parts(checkpoint, parts):
    """Loads each of parts from checkpoint (a Checkpoint), each failure one CheckpointError naming
    the file and the part; returns the parts' notes on it."""
    notes = []
    for name, load, saved in checkpoint.saved_states(parts):
        with restoring(checkpoint.path, name):
            notes.append(load(saved))
    return [note for note in notes if note]


# ----------------------------------------------------------------------------- writing them

class Saving(NamedTuple):
    """A checkpoint being written: in place once future is done (None: in place already)."""
    path: str
    future: concurrent.futures.Future | None


def save_one_file(path, parts, record):
    """The one-file writer: every part's state_dict() and the record in one file (save_checkpoint),
    which rank 0 writes: under DDP every rank's model and optimizer are the same. Its Saving once
    in place, else None."""
    state = checkpoint_contents(parts, record)  # on every rank: the rng part gathers
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Saving(path, None) if rank == 0 and save_checkpoint(path, state) else None


def checkpoint_contents(parts, record):
    """Everything an exact resume needs, as tensors and plain Python values, as one file holds it:
    every part's state_dict() (the rng part's gathers every rank's) and the record."""
    return {**{name: part.state_dict() for name, part in parts.items()}, **record}


def save_sharded(path, parts, record, async_save=False):
    """The sharded writer, on every rank: the parts in_storage in DCP's form, each rank its own
    slices, and the others' state_dict() and the record as train_state.pt (save_dcp). Its Saving,
    or None where some rank's disk lacks room or a write failed (a warning says so)."""
    names = in_storage(parts)
    short = every_rank(room_problem(os.path.dirname(path), [parts[name].state_dict() for name in names]))
    if any(short):
        print(f"warning: skipping checkpoint {path}: {next(why for why in short if why)}", file=sys.stderr)
        return None
    rest = {**{name: part.state_dict() for name, part in parts.items() if name not in names}, **record}
    tensors = {name: parts[name].dcp_state_dict() for name in names}
    try:
        return Saving(path, save_dcp(path, tensors, rest, async_save=async_save))
    except (OSError, CheckpointException) as e:  # a full disk on some rank: every rank hears of it
        warn_unwritten(path, save_error(e))
        return None


def save_dcp(path, tensors, state, async_save=False):
    """Writes a sharded checkpoint on every rank: tensors (DCP's state dicts by name), each rank its
    own slices, in parallel, and rank 0 also state (plain data) as train_state.pt. The directory is
    written as PATH.partial and renamed to path once complete, by rank 0. async_save returns at
    once, with the tensors copied to host memory, and the writing goes on in a thread: the returned
    future is done once the checkpoint is in place; otherwise it is in place on return (None returned).
    A failed write (a full disk) on any rank is an OSError or DCP's CheckpointException on all."""
    partial = path + ".partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = save_train_state(partial, state) if rank == 0 else None
    if dist.is_initialized():  # also: the directory exists, empty of older storage files, before any rank writes
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise OSError(error)
    # DCP's writer in torch 2.9 and 2.10 calls tensor.storage(), which warns (gone in 2.11). Set for
    # good, not in a catch_warnings: async_save writes in another thread.
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)

    def finish(failed):
        if rank != 0:
            return
        if failed:  # a full disk on some rank: no half-written directory stays behind
            shutil.rmtree(partial, ignore_errors=True)
            return
        if os.path.lexists(path):  # the same step saved again (a run resumed before it)
            remove_entry(path)
        os.rename(partial, path)

    if not async_save:
        try:
            dcp.save(tensors, checkpoint_id=partial)
        except BaseException:
            finish(failed=True)
            raise
        finish(failed=False)
        return None
    written = dcp.async_save(tensors, checkpoint_id=partial, process_group=host_group("checkpoints"))
    # Done once renamed into place, not once written: DCP's future is done before its callbacks
    # run, and a prune in between would take the still-.partial directory for a killed save's.
    in_place = concurrent.futures.Future()

    def rename_when_written(future):
        error = future.exception()
        try:
            finish(failed=error is not None)
        except Exception as e:  # never left undone: the run waits on it
            error = error or e
        in_place.set_exception(error) if error else in_place.set_result(None)
    written.add_done_callback(rename_when_written)
    return in_place


def save_error(error):
    """Why a sharded save failed, in one short line: DCP's CheckpointException says it with every
    failed rank's traceback. An OSError is named first: torch's zip writer, failing on a full disk,
    says only "unexpected pos"."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (failure, _) = min(error.failures.items(), key=lambda item: (not isinstance(item[1][0], OSError), item[0]))
        return f"rank {rank}: {type(failure).__name__}: {first_line(failure)}"
    return first_line(error)


def save_train_state(partial, state):
    """Rank 0's part of a sharded checkpoint, begun afresh in partial; why it failed, or None."""
    try:
        if os.path.lexists(partial):  # left by a run killed while writing it
            remove_entry(partial)
        os.makedirs(partial)
        error = save_plain(os.path.join(partial, TRAIN_STATE), state)
    except OSError as e:
        error = first_line(e)
    if error:
        shutil.rmtree(partial, ignore_errors=True)
    return error


def save_checkpoint(path, state):
    """Writes state to path (save_plain). Returns False, keeping older files, when the disk lacks
    room or the write fails, with a warning."""
    short = room_problem(os.path.dirname(os.path.abspath(path)), state)
    if short:
        print(f"warning: skipping checkpoint {path}: {short}", file=sys.stderr)
        return False
    error = save_plain(path, state)
    if error:
        warn_unwritten(path, error)
        return False
    return True


def save_plain(path, state):
    """torch.save(state) into path through a temporary file, flushed and renamed (atomic_open), so
    a crash at any moment leaves either the complete new file or none: why it failed, or None."""
    try:
        with atomic_open(path) as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:  # a full disk despite the check, a quota, a file-size limit, a
        # vanished mount; torch's zip writer reports the OSError as "RuntimeError: ... unexpected pos"
        return first_line(e)
    return None


def warn_unwritten(path, why):
    print(f"warning: could not write checkpoint {path}: {why}; older checkpoints are kept", file=sys.stderr)


def room_problem(directory, states):
    """Why directory's disk lacks room for the tensors in states (with a margin), or None."""
    need = 1.1 * sum(x.numel() * x.element_size() for x in tensors_in(states)) + (1 << 20)
    free = shutil.disk_usage(directory).free
    return f"{free / 1e9:.2f} GB free, about {need / 1e9:.2f} GB needed" if free < need else None


def tensors_in(obj):
    """The tensors in a nest of dicts, lists and tuples; of a sharded tensor, this rank's local piece."""
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
