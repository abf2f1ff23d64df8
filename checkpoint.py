"""Checkpoints: what they hold, written atomically, read as plain data, never by running pickled code.

A checkpoint holds the model (plain GPT keys), the optimizer's state, the loss scaler, the step, the
data loader's position, every rank's RNG state, the config (GPTConfig as a dict) and the run's flags
(checkpoint_contents). It comes in two kinds:
- ckpt_{step:06d}.pt, one file that torch.save writes (rank 0 alone, under DDP or one process);
- ckpt_{step:06d}/, a torch.distributed.checkpoint (DCP) directory into whose storage files
  every rank writes its own slices of the model and the optimizer (under FSDP), beside
  train_state.pt with the rest; the storage files are read as plain data by dcp_reader.py.
Every reader goes through load_checkpoint; a run resumes through restore_training, from
either kind, sharded or not, on any number of ranks. This file reads in that order: the
Checkpointer that decides when a run saves, saves and restores; what a checkpoint holds and how
it is restored; where checkpoints are in a log_dir; then each format.

    python checkpoint.py log/ckpt_019073 log/ckpt_019073.pt   # a sharded checkpoint as one file
"""
import concurrent.futures
import glob
import math
import os
import pickle
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from atomic import atomic_open
from cli import Parser, first_line
from dcp_reader import CheckpointError, UnreadableStorage, check_storage_files, dcp_load, read_metadata, refuse_link
from distributed import RunError, agree, every_rank, host_group
from inputs import PLAIN_TYPES, brief, structure_problem
from model import GPT, GPTConfig
from optimizers import OPTIMIZERS, OptimizerConfig, build_optimizer, optimizer_name, saved_parts, torch_optimizers

CHECKPOINT_RE = re.compile(r"ckpt_(\d+)(\.pt)?$")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP
TRAIN_STATE = "train_state.pt"  # in a sharded checkpoint: all but the model's and the optimizer's tensors


# ----------------------------------------------------------------------------- a run's checkpoints

class Checkpointer:
    """When and how a run saves and resumes (as torchtitan's CheckpointManager): every interval
    steps and at the end, only finite weights, only where every rank's disk has room, one file
    from rank 0 or (sharded) storage files from every rank, in the background with async_save,
    the oldest pruned to keep_last. A save that fails (a full disk) is a warning: training goes on."""

    def __init__(self, log_dir, interval, keep_last, sharded=False, async_save=False, log=print):
        self.log_dir, self.interval, self.keep_last = log_dir, interval, keep_last
        self.sharded, self.async_save, self.log = sharded, async_save, log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # (path, future) of a sharded checkpoint still being written

    def due(self, step, start_step, last_step):
        """Whether to save at step: every interval steps and at the end, but not the step resumed from."""
        return step > start_step and (last_step or bool(self.interval and step % self.interval == 0))

    def save(self, step, trainable, train_loader, flags):
        """Saves trainable and the loader at step, on every rank at once: a refusal (weights
        that are not finite) then stops every rank, none left waiting at the next collective.
        An interval of -1 saves nothing."""
        if self.interval < 0:
            return
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trainable.raw_model.parameters()]
        finite = bool(torch.stack([p.isfinite().all() for p in local]).all())
        agree(None if finite else f"the weights at step {step} are not finite: not checkpointing them")
        rng = every_rank(random_state())  # each rank's dropout masks resume as its own
        if self.sharded:
            self._save_dcp(step, trainable, train_loader, flags, rng)
        elif self.rank == 0:
            path = checkpoint_path(self.log_dir, step)
            state = checkpoint_contents(trainable.raw_model, trainable.optimizer, trainable.scaler, step, train_loader,
                                        flags, rng)
            if save_checkpoint(path, state):
                prune_checkpoints(self.log_dir, self.keep_last)
                self.log(f"saved {path}")

    def _save_dcp(self, step, trainable, train_loader, flags, rng):
        self.wait()  # one checkpoint at a time
        path = checkpoint_path(self.log_dir, step, sharded=True)
        state_dicts = [trainable.raw_model.state_dict(), trainable.optimizer.state_dict()]
        short = [why for why in every_rank(room_problem(self.log_dir, state_dicts)) if why]
        if short:
            print(f"warning: skipping checkpoint {path}: {short[0]}", file=sys.stderr)
            return
        state = train_state(trainable.raw_model, trainable.scaler, step, train_loader, flags, rng)
        try:
            future = save_dcp(path, trainable.raw_model, trainable.optimizer, state, async_save=self.async_save)
        except (OSError, CheckpointException) as e:  # a full disk on some rank: every rank hears of it
            print(f"warning: could not write checkpoint {path}: {save_error(e)}", file=sys.stderr)
            return
        self.pending = (path, future)
        if future is None:
            self.wait()

    def wait(self):
        """Returns once the checkpoint being written, if any, is complete and in place."""
        if self.pending is None:
            return
        (path, future), self.pending = self.pending, None
        try:
            if future is not None:
                future.result()
                if dist.is_initialized():
                    dist.barrier()  # rank 0 has renamed it into place
        except (OSError, CheckpointException) as e:
            print(f"warning: could not write checkpoint {path}: {save_error(e)}", file=sys.stderr)
            return
        if self.rank == 0:
            prune_checkpoints(self.log_dir, self.keep_last)
        self.log(f"saved {path}")

    def restore(self, resume, trainable, train_loader, max_steps, flags=None):
        """Restores the checkpoint resume names ("auto", "none" or a path) into trainable and the
        loader, under this run's hyperparameters; given the run's flags (TrainConfig.flags()), logs
        those that differ from the checkpoint's record in one line. Returns the step to start from.
        Every rank reads the checkpoint itself, so all must find the same one: on several nodes,
        log_dir must be shared storage. Under "auto", a sharded checkpoint whose storage files
        cannot be read (damage shows only then) is passed over for the next older one, which
        overwrites whatever the failed restore had loaded."""
        found = find_resume(resume, self.log_dir)
        while True:
            steps = every_rank(found[1].get("step") if found else None)  # a model-only one has none: restore says so
            if len(set(steps)) > 1:
                raise RunError(f"the ranks found different checkpoints to resume from (step per rank: {steps}): "
                               f"on several nodes, --log_dir must be a directory they all share")
            if found is None:
                return 0
            path, state = found
            try:
                step = restore_training(state, path, trainable.raw_model, trainable.optimizer, trainable.scaler,
                                        train_loader, self.log)
                break
            except UnreadableStorage as e:
                if resume != "auto":
                    raise
                self.log(f"warning: skipping {e}")
                found = latest_checkpoint(self.log_dir, before=checkpoint_step(path))
        self.log(f"resuming from {path} at step {step}")
        saved_batch = recorded_flags(state).get("micro_batch_size")
        if isinstance(saved_batch, int) and saved_batch != train_loader.B:  # -B auto on another GPU, or another -B
            self.log(f"note: micro-batch {train_loader.B}, where the checkpoint's run took {saved_batch}: "
                     f"the same tokens per optimizer step, in other micro-steps")
        changed = changed_hyperparameters(recorded_flags(state), flags or {})
        if changed:
            self.log(f"this run's flags win over the checkpoint's: {', '.join(changed)}")
        if resume != "auto" and step < max_steps:
            check_no_later_checkpoints(self.log_dir, step)
        return step


# ----------------------------------------------------------------------------- what a checkpoint holds

def checkpoint_contents(raw_model, optimizer, scaler, step, train_loader, flags, rng=None):
    """Everything an exact resume needs, as tensors and plain Python values; flags: the run's
    flags by name (TrainConfig.flags()), kept as its record; rng: every rank's random_state(),
    rank 0's first (None: this process's alone)."""
    return {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            **train_state(raw_model, scaler, step, train_loader, flags, rng)}


def train_state(raw_model, scaler, step, train_loader, flags, rng=None):
    """All of checkpoint_contents but the model's and the optimizer's tensors: what train_state.pt holds."""
    return {
        "scaler": scaler.state_dict(),
        "step": step,
        "train_loader": train_loader.state_dict(),
        "rng": rng or [random_state()],
        "config": asdict(raw_model.config),
        "flags": flags,
    }


def random_state():
    """This process's random state, which draws its dropout masks: the CPU's and each GPU's it sees."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_random_state(path, saved, dropout, log):
    """Restores this rank's random state from saved, a checkpoint's "rng": one random_state() per
    rank (an older checkpoint's is one dict, of one rank). Every rank checks every rank's state and
    restores its own, then all agree, as on the optimizer's state: a state that cannot be restored
    is one CheckpointError naming the rank, on every rank, none left waiting at a collective. Saved
    on another number of ranks it restores none, and under dropout logs that the masks are drawn
    afresh: each rank keeps the seed the run gave it."""
    states = [saved] if isinstance(saved, dict) else saved
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = random_states_problem(states)
    if problem is None and len(states) == ranks:
        try:
            torch.set_rng_state(states[rank]["cpu"])
            if states[rank]["cuda"] and torch.cuda.is_available():
                # One state per GPU the saving process saw: a run resumed on fewer GPUs takes as many.
                torch.cuda.set_rng_state_all(states[rank]["cuda"][: torch.cuda.device_count()])
        except (TypeError, ValueError, RuntimeError) as e:
            problem = f"rank {rank}'s state: {first_line(e)}"
    problems = [p for p in every_rank(problem) if p]
    if problems:
        raise CheckpointError(f"{path}: its rng cannot be restored ({problems[0]})")
    if len(states) != ranks and dropout:
        log(f"note: {path} holds the random state of {len(states)} rank(s), this run has {ranks}: the weights, "
            f"optimizer and data resume as saved, but dropout's masks are drawn afresh, so the losses from here "
            f"are not those of the run uninterrupted")


# The bytes of a CUDA generator's state: its seed and its offset, 8 each.
CUDA_STATE_BYTES = 16


def random_states_problem(states):
    """Why states, every rank's random_state() as a checkpoint holds them, cannot be restored, or
    None; every rank's is checked, whichever restores it."""
    if not isinstance(states, (list, tuple)) or not states:
        return f"it is {brief(states)}, not a list of one random state per rank"
    for rank, state in enumerate(states):
        if not isinstance(state, dict) or not isinstance(state.get("cuda"), (list, tuple)):
            return f"rank {rank}'s state is {brief(state)}, not a dict of the CPU's state and a list of the GPUs'"
        try:
            torch.Generator().set_state(state.get("cpu"))  # a scratch generator: this one's stays as it is
        except (TypeError, RuntimeError) as e:
            return f"rank {rank}'s CPU state: {first_line(e)}"
        if not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.numel() == CUDA_STATE_BYTES
                   for s in state["cuda"]):
            return f"rank {rank}'s CUDA states are not {CUDA_STATE_BYTES} bytes each"
    return None


def restore_training(state, path, raw_model, optimizer, scaler, train_loader, log=print):
    """Puts a run back where checkpoint_contents found it, from either kind of checkpoint into a model
    sharded or not; returns its step. The model's dropout is this run's: a checkpoint trained at
    another is resumed at this one, with a note to log."""
    sharded = is_sharded_checkpoint(path)  # its tensors are read from the directory, not from state
    missing = [key for key in ("optimizer", "scaler", "train_loader", "rng", "step")
               if key not in state and not (sharded and key == "optimizer")]
    if missing:
        raise CheckpointError(f"{path} holds no {missing[0]}: a model to score or sample, not a run to resume")
    config = asdict(raw_model.config)
    saved = dict(model_fields(path, state["config"]))
    saved_dropout, dropout = saved.pop("dropout", GPTConfig.dropout), config.pop("dropout")
    if saved != config:
        diff = ", ".join(f"{k} {brief(v)} (this run: {config[k]})" for k, v in saved.items() if config[k] != v)
        raise CheckpointError(f"{path} holds a model of another architecture: {diff}; resume it with its model "
                              f"flags, or start over: --resume none (which moves the earlier run's files aside), "
                              f"or another --log_dir")
    if saved_dropout != dropout:
        log(f"note: {path} was trained at --dropout {brief(saved_dropout)}: resuming at this run's --dropout {dropout}")
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: its step is {brief(step)}, not a step number")
    saved_optimizer, this_optimizer = saved_optimizer_name(path, state), optimizer_name(optimizer)
    if saved_optimizer != this_optimizer:
        raise CheckpointError(f"{path} is a run of --optimizer {saved_optimizer}, this one is of --optimizer "
                              f"{this_optimizer}: resume it with --optimizer {saved_optimizer}, or start over "
                              f"in another --log_dir")
    with restoring(path, "model and optimizer"):
        if sharded:
            load_sharded(path, raw_model, optimizer)
        elif isinstance(raw_model, FSDPModule):
            load_whole_into_sharded(state, raw_model, optimizer)
        else:
            raw_model.load_state_dict(state["model"])
            load_optimizer_state(optimizer, state["optimizer"])
    problems = [p for p in every_rank(optimizer_state_problem(raw_model, optimizer)) if p]
    if problems:  # every rank stops alike: a rank that trained on would wait for the others forever
        raise CheckpointError(f"{path}: {problems[0]}")
    with restoring(path, "scaler"):
        if state["scaler"]:  # empty when saved without fp16 loss scaling: a switch to fp16 starts a fresh scale
            scaler.load_state_dict(state["scaler"])
    with restoring(path, "train_loader"):
        train_loader.load_state_dict(state["train_loader"])
    restore_random_state(path, state["rng"], dropout, log)
    return step


@contextmanager
def restoring(path, field):
    """Restoring field from the checkpoint at path: a value that cannot be restored (a hand-edited
    or foreign file's) is one CheckpointError naming both, never a traceback."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{path}: its {field} cannot be restored ({type(e).__name__}: {first_line(e)})") from None


def recorded_flags(state):
    """The flags a checkpoint records of its run (TrainConfig.flags()): its "flags", or the "args"
    of one written before that name; {} where it records none."""
    record = state.get("flags", state.get("args"))
    return record if isinstance(record, dict) else {}


def saved_optimizer_name(path, state):
    """The --optimizer a training checkpoint was saved under; adamw for one from before the flag."""
    return recorded_flag(path, state, "optimizer", "adamw", lambda name: name in OPTIMIZERS)


def recorded_flag(path, state, name, default, valid):
    """The value of flag name that the checkpoint at path records of its run (default where it
    records none), or a CheckpointError if valid(value) is false."""
    value = recorded_flags(state).get(name, default)
    if not valid(value):
        raise CheckpointError(f"{path}: its recorded --{name} is {brief(value)}, which that flag cannot be")
    return value


# The flags that set the optimizer's hyperparameters (the schedule's among them): on resume, this
# run's values are the ones it trains with, and changed_hyperparameters names those that changed.
HYPERPARAMETER_FLAGS = ("max_lr", "min_lr_ratio", "warmup_steps", "decay_steps", "weight_decay", "muon_lr",
                        "muon_momentum", "muon_weight_decay", "grad_clip")


def load_optimizer_state(optimizer, saved):
    """Loads saved (optimizer.state_dict()'s form) into optimizer: what the saved run learned (the
    moments, momentum buffers and step counters), under this run's settings, which its flags set:
    weight decay, betas, eps, Muon's momentum, nesterov and lr_scale (--muon_lr over --max_lr), and
    AdamW's kernel (a run saved on a CPU resumes with the fused AdamW on a GPU, and back). The
    settings go into the saved groups before loading: load_state_dict places each `step` counter
    by them (fused and capturable kernels read it as float32 on the parameter's device)."""
    for part, saved_part in saved_parts(optimizer, saved):
        part.load_state_dict({**saved_part, "param_groups": with_run_settings(saved_part["param_groups"], part)})


def with_run_settings(saved_groups, optimizer):
    """saved_groups (a state dict's param_groups) with every setting of optimizer's groups in place
    of the saved ones: only each group's "params", which say whose state is whose, stay saved."""
    if len(saved_groups) != len(optimizer.param_groups):  # zip would drop the extra ones without a word
        raise ValueError(f"{len(saved_groups)} parameter groups saved, this run's optimizer has "
                         f"{len(optimizer.param_groups)}")
    return [{**saved_group, **{k: v for k, v in group.items() if k != "params"}}
            for saved_group, group in zip(saved_groups, optimizer.param_groups)]


def changed_hyperparameters(saved_flags, flags):
    """["name old -> new"] for each of HYPERPARAMETER_FLAGS whose value in flags (this run's, as
    TrainConfig.flags() gives them) differs from saved_flags, a checkpoint's record of its run's
    (recorded_flags); nothing for a flag the record lacks, or a checkpoint with no record."""
    if not isinstance(saved_flags, dict):
        return []
    return [f"{name} {brief(saved_flags[name])} -> {flags[name]}" for name in HYPERPARAMETER_FLAGS
            if name in saved_flags and name in flags and saved_flags[name] != flags[name]]


def optimizer_state_problem(raw_model, optimizer):
    """Why the state that optimizer has loaded cannot step raw_model's parameters, or None: each
    tensor of a parameter's state (AdamW's moments, Muon's momentum) finite and of the parameter's
    shape, and its step count one finite number, 0 or more. torch loads a tampered one as it is
    (casting its tensors to the parameter's dtype), to fail at the first step or train on from NaN.
    The param groups' settings are this run's own (with_run_settings), checked as its flags are."""
    names = {id(p): name for name, p in plain_state_dict(dict(raw_model.named_parameters())).items()}
    for part in torch_optimizers(optimizer):
        for param in (p for group in part.param_groups for p in group["params"]):
            for key, value in part.state.get(param, {}).items():
                problem = state_value_problem(key, value, param)
                if problem:
                    return f"its optimizer state of {names.get(id(param), 'a parameter')}: {key} {problem}"
    return None


def state_value_problem(key, value, param):
    """Why value, of key in param's optimizer state, cannot be stepped, or None."""
    if key == "step" and type(value) in (int, float):
        return None if number_in(value, 0, math.inf) else f"is {brief(value)}, not a count of 0 or more"
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if key == "step" and value.numel() != 1:
        return f"has shape {tuple(value.shape)}, not one number"
    if key != "step" and value.shape != param.shape:
        return f"has shape {tuple(value.shape)}, not its parameter's {tuple(param.shape)}"
    local = value.to_local() if isinstance(value, DTensor) else value
    if not local.isfinite().all():
        return "holds NaN or infinite values"
    if key == "step" and local.item() < 0:
        return f"is {local.item():g}, not a count of 0 or more"
    return None


def number_in(value, low, high):
    """Whether value is an int or a float (not a bool) in [low, high)."""
    return type(value) in (int, float) and low <= value < high


def is_rate(value):
    """Whether value can be a learning rate that others are scaled by: a positive finite number."""
    return number_in(value, 0, math.inf) and value > 0


def model_of(path, config, dropout=None, **options):
    """A GPT of a checkpoint's config (GPTConfig's fields as a dict; one without dropout, older,
    has none), or a CheckpointError; dropout, if given, instead of the recorded one; options: how
    it runs, as GPT's."""
    try:
        model_config = GPTConfig(**model_fields(path, config))
        return GPT(model_config if dropout is None else replace(model_config, dropout=dropout), **options)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT ({first_line(e)})") from None


def model_fields(path, config):
    """A checkpoint's config (a dict of plain values: contents_problem), checked to hold only
    GPTConfig's fields: another is a CheckpointError, named within bounds."""
    unknown = next((k for k in config if k not in GPTConfig.__dataclass_fields__), None)
    if unknown is not None:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT (its config has a field {brief(unknown)}, "
                              f"which GPTConfig lacks)")
    return config


# ----------------------------------------------------------------------------- where they are: log_dir

def checkpoint_path(log_dir, step, sharded=False):
    return os.path.join(log_dir, f"ckpt_{step:06d}" + ("" if sharded else ".pt"))


def checkpoint_step(path):
    return int(CHECKPOINT_RE.search(path).group(1))


def list_checkpoints(log_dir):
    """The checkpoints in log_dir of either kind, oldest step first. A sharded one is complete
    only under its final name: it is written under another and renamed."""
    paths = [p for p in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*"))
             if CHECKPOINT_RE.search(p) and os.path.isdir(p) != p.endswith(".pt")]
    return sorted(paths, key=checkpoint_step)


def find_resume(resume, log_dir):
    """(path, state) to resume from, or None to start fresh: resume is "none", "auto" (the newest
    checkpoint in log_dir that loads) or a checkpoint's path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(log_dir)
    return resume, load_checkpoint(resume)


def latest_checkpoint(log_dir, map_location="cpu", before=None):
    """(path, state) of the newest checkpoint in log_dir (of a step before `before`, if given) that
    loads, or None if log_dir holds no checkpoint. A damaged newer one (a bad disk, a hand edit) is
    skipped with a warning; if every one is damaged, CheckpointError: starting again from step 0
    would overwrite the run they hold."""
    every = list_checkpoints(log_dir)
    paths = [p for p in every if before is None or checkpoint_step(p) < before]
    problems = []
    for path in reversed(paths):
        try:
            state = load_checkpoint(path, map_location)
        except CheckpointError as e:
            problems.append(e)
            continue
        for problem in problems:
            print(f"warning: skipping {problem}", file=sys.stderr)
        return path, state
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
    """Deletes all but the newest keep_last checkpoints (keep_last <= 0 keeps all), and what saves
    that were killed left behind."""
    remove_unfinished(log_dir)
    if keep_last > 0:
        for path in list_checkpoints(log_dir)[:-keep_last]:
            remove_entry(path)


def remove_unfinished(log_dir):
    """Removes the temporary files and .partial directories of saves that a SIGKILL or a power cut
    ended (each as large as a checkpoint). Only one run writes into a log_dir at a time."""
    for path in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*")):
        if re.search(r"ckpt_\d+(\.pt\.tmp\d+|\.partial)$", path):
            remove_entry(path)


def remove_entry(path):
    """Removes path: a directory with all it holds, or a file or a link (never what a link leads to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


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


# ----------------------------------------------------------------------------- one file

def save_checkpoint(path, state):
    """Writes state to path (save_plain). Returns False, keeping older files, when the disk lacks
    room or the write fails, with a warning."""
    short = room_problem(os.path.dirname(os.path.abspath(path)), state)
    if short:
        print(f"warning: skipping checkpoint {path}: {short}", file=sys.stderr)
        return False
    error = save_plain(path, state)
    if error:
        print(f"warning: could not write checkpoint {path}: {error}; older checkpoints are kept", file=sys.stderr)
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


def load_checkpoint(path, map_location="cpu"):
    """Loads a checkpoint with weights_only=True: tensors and plain data only. A pickle that
    would construct anything else, code included, is refused before any of it runs. Of a
    sharded checkpoint, only train_state.pt: its tensors are read into a model by
    restore_training or loading.load_model."""
    if is_sharded_checkpoint(path):
        check_storage_files(path, read_metadata(path).storage_data)  # what can be checked before reading them
        refuse_link(os.path.join(path, TRAIN_STATE))
        return _load_plain(os.path.join(path, TRAIN_STATE), map_location, require=("config",))
    return _load_plain(path, map_location)


def _load_plain(path, map_location, require=("model", "config")):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
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


def contents_problem(state):
    """Why a loaded checkpoint cannot be used or printed at a bounded cost, or None: it must be
    tensors and plain data CHECKPOINT_DEPTH deep at most, its model a dict, its records dicts of
    plain values."""
    if not isinstance(state.get("model", {}), dict):
        return f"its model is {brief(state['model'])}, not a state dict"
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


# ----------------------------------------------------------------------------- sharded checkpoints

def is_sharded_checkpoint(path):
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, TRAIN_STATE))  # a link is one, to be refused


def save_dcp(path, model, optimizer, state, async_save=False):
    """Writes a sharded checkpoint on every rank: each rank its own slices of the model and of
    the optimizer's state, in parallel, rank 0 also state (train_state's). The directory is written as
    PATH.partial and renamed to path once complete, by rank 0. async_save returns at once, with
    the tensors copied to host memory, and the writing goes on in a thread: the returned future
    is done once the checkpoint is in place; otherwise it is in place on return (None returned).
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
    model_state, optimizer_state = get_state_dict(model, torch_optimizers(optimizer))
    tensors = {"model": model_state, "optimizer": optimizer_state}
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


def load_sharded(path, model, optimizer=None):
    """Reads a sharded checkpoint's model (and the optimizer's state) into model, sharded or not, on any
    number of ranks or in one process: DCP reads each rank only the pieces of the storage files
    that its slices hold."""
    if optimizer is None:
        tensors = {"model": get_model_state_dict(model)}
        dcp_load(tensors, path)
        set_model_state_dict(model, tensors["model"])
        return
    optimizers = torch_optimizers(optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizers)
    tensors = {"model": model_state, "optimizer": optimizer_state}
    dcp_load(tensors, path)
    tensors["optimizer"]["param_groups"] = with_run_settings(tensors["optimizer"]["param_groups"], optimizer)
    set_state_dict(model, optimizers, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"])


def load_whole_into_sharded(state, model, optimizer):
    """A one-file checkpoint (every rank has read all of it) into a sharded model: each rank keeps
    its own slices. Its optimizer state is keyed by the parameters' order in each optimizer; DCP's
    loader wants their names, and takes several optimizers' state as one."""
    names = {id(p): name for name, p in plain_state_dict(dict(model.named_parameters())).items()}
    by_name = {"state": {}, "param_groups": []}
    for part, saved in saved_parts(optimizer, state["optimizer"]):
        order = [names[id(p)] for group in part.param_groups for p in group["params"]]
        by_name["state"].update({order[i]: s for i, s in saved["state"].items()})
        by_name["param_groups"] += [{**g, "params": [order[i] for i in g["params"]]}
                                    for g in with_run_settings(saved["param_groups"], part)]
    set_state_dict(model, torch_optimizers(optimizer), model_state_dict=state["model"], optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True))


def main(argv=None):
    """python checkpoint.py SHARDED_DIR OUT.pt: a sharded checkpoint as the one-file kind, in one
    process: hellaswag.py, sample.py, export_hf.py read either, and a run resumes from either."""
    parser = Parser(prog="checkpoint.py", description=main.__doc__)
    parser.add_argument("sharded", help="a ckpt_XXXXXX/ directory that train_gpt2.py --fsdp 1 wrote")
    parser.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    if not is_sharded_checkpoint(args.sharded):
        parser.fail(f"{args.sharded}: not a sharded checkpoint (no {TRAIN_STATE})")
    parser.check_output("out", args.out)
    try:
        state = load_checkpoint(args.sharded)
        model = model_of(args.sharded, state["config"])
        # The groups' values come from the checkpoint, but for Muon's lr_scale: the run's own.
        lr, muon_lr = (recorded_flag(args.sharded, state, name, 1.0, is_rate) for name in ("max_lr", "muon_lr"))
        optimizer = build_optimizer(model, OptimizerConfig(saved_optimizer_name(args.sharded, state), lr, 0.0,
                                                           fused_adamw=False, muon_lr=muon_lr), "cpu")
        with restoring(args.sharded, "model and optimizer"):
            load_sharded(args.sharded, model, optimizer)
        problem = optimizer_state_problem(model, optimizer)
        if problem:
            raise CheckpointError(f"{args.sharded}: {problem}")
    except CheckpointError as e:
        parser.fail(str(e))
    state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
    if "args" in state:  # a record from before it was named "flags"
        state["flags"] = state.pop("args")
    if not save_checkpoint(args.out, state):
        sys.exit(1)
    print(f"wrote {args.out}: step {state['step']}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
