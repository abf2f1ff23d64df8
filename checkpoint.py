"""Checkpoints: what they hold, written atomically, read as plain data, never by running pickled code.

A run hands its Checkpointer, once, its stateful parts (training_parts): the model, the optimizer,
the loss scaler, the train loader's position and every rank's random state. Each part saves and
restores itself (state_dict, load_state_dict); a checkpoint holds each under its name, beside its
record: the step, the config (GPTConfig as a dict) and the run's flags (TrainConfig.flags()). It
comes in two formats, which differ only in the writer (save_one_file, save_sharded) and the reader
(saved_states):
- ckpt_{step:06d}.pt, one file that torch.save writes (rank 0 alone, under DDP or one process);
- ckpt_{step:06d}/, a torch.distributed.checkpoint (DCP) directory into whose storage files
  every rank writes its own slices of the parts that hold tensors there, the model and the
  optimizer (under FSDP), beside train_state.pt with the rest; the storage files are read as
  plain data by dcp_reader.py.
Every reader goes through load_checkpoint; a run resumes through restore_parts, from either
format, sharded or not, on any number of ranks. This file reads in that order: the Checkpointer
that decides when a run saves, saves and restores; the parts and how a checkpoint restores
them; where checkpoints are in a log_dir; then each format.

    python checkpoint.py log/ckpt_019073 log/ckpt_019073.pt   # a sharded checkpoint as one file
"""
import concurrent.futures
import glob
import math
import os
import pickle
import re
import shutil
import stat
import sys
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from atomic import atomic_open
from cli import Parser
from dcp_reader import CheckpointError, UnreadableStorage, check_storage_files, dcp_load, read_metadata, refuse_link
from distributed import RunError, agree, every_rank, host_group
from inputs import PLAIN_TYPES, brief, first_line, structure_problem
from model import GPT, GPTConfig
from optimizers import OPTIMIZERS, OptimizerConfig, build_optimizer, optimizer_name, saved_parts, torch_optimizers

CHECKPOINT_RE = re.compile(r"ckpt_(\d+)(\.pt)?$")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP
TRAIN_STATE = "train_state.pt"  # in a sharded checkpoint: all but the model's and the optimizer's tensors


# ----------------------------------------------------------------------------- a run's checkpoints

class Saving(NamedTuple):
    """A checkpoint being written: in place once future is done (None: in place already)."""
    path: str
    future: concurrent.futures.Future | None


class Checkpointer:
    """When and how a run saves and resumes its parts (training_parts), as torchtitan's
    CheckpointManager: every interval steps and at the end, only finite weights, only where every
    rank's disk has room, one file from rank 0 or (sharded) storage files from every rank, in the
    background with async_save, the oldest pruned to keep_last. A save that fails (a full disk) is
    a warning: training goes on."""

    def __init__(self, log_dir, parts, interval, keep_last, sharded=False, async_save=False, log=print):
        self.log_dir, self.parts, self.interval, self.keep_last = log_dir, parts, interval, keep_last
        self.sharded, self.log = sharded, log
        self.write = partial(save_sharded, async_save=async_save) if sharded else save_one_file  # the one difference
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # the Saving of a checkpoint still being written

    def due(self, step, start_step, last_step):
        """Whether to save at step: every interval steps and at the end, but not the step resumed from."""
        return step > start_step and (last_step or bool(self.interval and step % self.interval == 0))

    def save(self, step, flags):
        """Saves every part at step, with flags (TrainConfig.flags()) as the run's record, on every
        rank at once: a refusal (weights that are not finite) then stops every rank, none left
        waiting at the next collective. An interval of -1 saves nothing."""
        if self.interval < 0:
            return
        finite = self.parts["model"].finite()
        agree(None if finite else f"the weights at step {step} are not finite: not checkpointing them")
        self.wait()  # one checkpoint at a time
        record = checkpoint_record(self.parts, step, flags)
        self.pending = self.write(checkpoint_path(self.log_dir, step, self.sharded), self.parts, record)
        if self.pending is not None and self.pending.future is None:
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
            warn_unwritten(path, save_error(e))
            return
        if self.rank == 0:
            prune_checkpoints(self.log_dir, self.keep_last)
        self.log(f"saved {path}")

    def restore(self, resume, max_steps, flags):
        """Restores every part from the checkpoint resume names ("auto", "none" or a path), under
        this run's hyperparameters; given the run's flags (TrainConfig.flags()), logs those that
        differ from the checkpoint's record in one line. Returns the step to start from. Every rank
        reads the checkpoint itself, so all must find the same one: on several nodes, log_dir must
        be shared storage. Under "auto", a sharded checkpoint whose storage files cannot be read
        (damage shows only then) is passed over for the next older one, which overwrites whatever
        the failed restore had loaded."""
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
                step = restore_parts(path, state, self.parts, self.log)
                break
            except UnreadableStorage as e:
                if resume != "auto":
                    raise
                self.log(f"warning: skipping {e}")
                found = latest_checkpoint(self.log_dir, before=checkpoint_step(path))
        self.log(f"resuming from {path} at step {step}")
        changed = changed_hyperparameters(recorded_flags(state), flags)
        if changed:
            self.log(f"this run's flags win over the checkpoint's: {', '.join(changed)}")
        if resume != "auto" and step < max_steps:
            check_no_later_checkpoints(self.log_dir, step)
        return step


def warn_unwritten(path, why):
    print(f"warning: could not write checkpoint {path}: {why}; older checkpoints are kept", file=sys.stderr)


# ----------------------------------------------------------------------------- the parts of a run

def training_parts(trainable, train_loader):
    """The stateful parts of a run (trainable: train_gpt2.Trainable), by the name each has in a
    checkpoint. Each has state_dict() and load_state_dict(saved), which returns None or a note on
    the checkpoint to log after its path; those whose tensors a sharded checkpoint holds in DCP's
    storage files (in_storage) also have dcp_state_dict() and load_dcp_state_dict(loaded), in
    DCP's form: keyed by the parameters' names, each rank's slices under FSDP."""
    model = trainable.raw_model
    return {"model": ModelPart(model), "optimizer": OptimizerPart(model, trainable.optimizer),
            "scaler": ScalerPart(trainable.scaler), "train_loader": LoaderPart(train_loader),
            "rng": RandomStates(model.config.dropout)}


def checkpoint_record(parts, step, flags):
    """What a checkpoint records of its run beside the parts' states: the step, the model's config
    (GPTConfig as a dict) and the run's flags (TrainConfig.flags())."""
    return {"step": step, "config": asdict(parts["model"].raw_model.config), "flags": flags}


def checkpoint_contents(parts, record):
    """Everything an exact resume needs, as tensors and plain Python values, as one file holds it:
    every part's state_dict() (the rng part's gathers every rank's) and the record."""
    return {**{name: part.state_dict() for name, part in parts.items()}, **record}


def in_storage(parts):
    """The names of the parts whose tensors a sharded checkpoint holds in DCP's storage files."""
    return [name for name, part in parts.items() if hasattr(part, "dcp_state_dict")]


class ModelPart:
    """The weights of raw_model, the plain GPT (FSDP-sharded or not): state_dict() with plain GPT
    keys, whole, as one file holds them; either form loads into a model sharded or not, and is
    then checked on every rank, as the scripts check a model they load (non_finite_weights)."""

    def __init__(self, raw_model):
        self.raw_model = raw_model

    def finite(self):
        """Whether every weight is finite (of a sharded one, this rank's slices)."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.raw_model.parameters()]
        return bool(torch.stack([p.isfinite().all() for p in local]).all())

    def state_dict(self):
        return self.raw_model.state_dict()

    def load_state_dict(self, saved):
        if isinstance(self.raw_model, FSDPModule):  # every rank has read all of it, and keeps its own slices
            set_model_state_dict(self.raw_model, saved, options=StateDictOptions(full_state_dict=True))
        else:
            self.raw_model.load_state_dict(saved)
        self.check()

    def dcp_state_dict(self):
        return get_model_state_dict(self.raw_model)

    def load_dcp_state_dict(self, loaded):
        set_model_state_dict(self.raw_model, loaded)
        self.check()

    def check(self):
        """Every rank stops alike, naming the weight: a run resumed from NaN would fail steps
        later, at a save or an evaluation, blaming neither the checkpoint nor the weight."""
        if not all(every_rank(self.finite())):
            raise Unrestorable(non_finite_weights(self.raw_model))


def non_finite_weights(model):
    """"NAME holds NaN or infinite values" for the first weight of model (a GPT) that does, with
    the rows where they lie if only rows that pad the vocabulary hold them, or None. Of a sharded
    model, on every rank at once: each weight is gathered whole."""
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not whole.isfinite().all():
            return f"{name} holds NaN or infinite values{padding_only(model, name, whole)}"
    return None


def padding_only(model, name, tensor):
    """", only in rows 50257-50303, ..." where the non-finite values of model's weight name (tensor)
    lie only in the rows that pad its vocabulary (the token embedding's, which the head shares), else ""."""
    rows, vocab = model.config.vocab_size, model.n_tokens
    if name not in ("transformer.wte.weight", "lm_head.weight") or rows == vocab or not tensor[:vocab].isfinite().all():
        return ""
    return f", only in rows {vocab}-{rows - 1}, which pad the vocabulary and which no token id reaches"


class OptimizerPart:
    """What the optimizer learned (AdamW's moments, Muon's momentum buffers, the step counts),
    restored under this run's settings (load_optimizer_state), then checked on every rank before
    any steps (optimizer_state_problem). state_dict() is keyed by each parameter's place in its
    optimizer, a MuonAdamW's as {"adamw": ..., "muon": ...}, as one file holds it."""

    def __init__(self, raw_model, optimizer):
        self.raw_model, self.optimizer = raw_model, optimizer

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, saved):
        problem = saved_optimizer_problem(self.raw_model, self.optimizer, saved)
        if problem:
            raise Unrestorable(problem)
        if isinstance(self.raw_model, FSDPModule):
            set_optimizer_state_dict(self.raw_model, torch_optimizers(self.optimizer),
                                     keyed_by_name(self.raw_model, self.optimizer, saved),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            load_optimizer_state(self.optimizer, saved)
        self.check()

    def dcp_state_dict(self):
        return get_optimizer_state_dict(self.raw_model, torch_optimizers(self.optimizer))

    def load_dcp_state_dict(self, loaded):
        loaded["param_groups"] = with_run_settings(loaded["param_groups"], self.optimizer)
        set_optimizer_state_dict(self.raw_model, torch_optimizers(self.optimizer), loaded)
        self.check()

    def check(self):
        """Every rank stops alike: a rank that trained on would wait for the others forever."""
        problems = [p for p in every_rank(optimizer_state_problem(self.raw_model, self.optimizer)) if p]
        if problems:
            raise Unrestorable(problems[0])


def keyed_by_name(raw_model, optimizer, saved):
    """saved, optimizer.state_dict()'s form, keyed by the parameters' order in each optimizer, as
    DCP's loader takes it: by their names, several optimizers' state as one, under this run's
    settings."""
    names = parameter_names(raw_model)
    by_name = {"state": {}, "param_groups": []}
    for part, saved_part in saved_parts(optimizer, saved):
        order = [names[id(p)] for group in part.param_groups for p in group["params"]]
        by_name["state"].update({order[i]: s for i, s in saved_part["state"].items()})
        by_name["param_groups"] += [{**g, "params": [order[i] for i in g["params"]]}
                                    for g in with_run_settings(saved_part["param_groups"], part)]
    return by_name


class ScalerPart:
    """The fp16 loss scale (torch.amp.GradScaler): empty where saved without fp16 loss scaling, and
    then a switch to fp16 starts a fresh scale."""

    def __init__(self, scaler):
        self.scaler = scaler

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, saved):
        if saved:
            self.scaler.load_state_dict(saved)


class LoaderPart:
    """The train loader's position (data.ShardLoader), carried over by tokens read where the saved
    run read other micro-batches (another -B, -B auto on another GPU, another number of ranks)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, saved):
        problem = self.loader.position_problem(saved)
        if problem:
            raise Unrestorable(problem)
        self.loader.load_state_dict(saved)
        if saved["tokens_per_index"] != self.loader.tokens_per_index:
            return (f"was saved by a run of micro-batches of {saved['tokens_per_index']:,} tokens over all "
                    f"ranks, this run's are {self.loader.tokens_per_index:,}: the same tokens per optimizer step, "
                    f"in other micro-steps")
        return None


class RandomStates:
    """Every rank's random state, which draws its dropout masks (dropout: this run's): state_dict()
    gathers them from every rank, rank 0's first; load_state_dict restores each rank's own
    (restore_random_state)."""

    def __init__(self, dropout):
        self.dropout = dropout

    def state_dict(self):
        return every_rank(random_state())

    def load_state_dict(self, saved):
        return restore_random_state(saved, self.dropout)


def random_state():
    """This process's random state, which draws its dropout masks: the CPU's and each GPU's it sees."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_random_state(saved, dropout):
    """Restores this rank's random state from saved, a checkpoint's "rng": one random_state() per
    rank (an older checkpoint's is one dict, of one rank). Every rank checks every rank's state and
    restores its own, then all agree, as on the optimizer's state: a state that cannot be restored
    is Unrestorable, naming the rank, on every rank, none left waiting at a collective. Saved on
    another number of ranks it restores none, and under dropout returns a note that the masks are
    drawn afresh: each rank keeps the seed the run gave it."""
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
        raise Unrestorable(problems[0])
    if len(states) != ranks and dropout:
        return (f"holds the random state of {len(states)} rank(s), this run has {ranks}: the weights, optimizer "
                f"and data resume as saved, but dropout's masks are drawn afresh, so the losses from here are not "
                f"those of the run uninterrupted")
    return None


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


# ----------------------------------------------------------------------------- restoring them

class Unrestorable(Exception):
    """Why a part cannot restore the state it was given: restoring names the checkpoint and the part."""


def restore_parts(path, state, parts, log=print):
    """Puts every part back as the checkpoint at path saved it (state: what load_checkpoint read of
    it), from either format into a model sharded or not, once its record is found to fit this run
    (check_resumable); logs each part's note on it, and returns its step."""
    step = check_resumable(path, state, parts, log)
    for note in load_parts(path, state, parts):
        log(f"note: {path} {note}")
    return step


def load_parts(path, state, parts):
    """Loads each of parts from the checkpoint at path (state: what load_checkpoint read of it), each
    failure one CheckpointError naming the file and the part; returns the parts' notes on it."""
    notes = []
    for name, load, saved in saved_states(path, state, parts):
        with restoring(path, name):
            notes.append(load(saved))
    return [note for note in notes if note]


def check_resumable(path, state, parts, log):
    """The step of the checkpoint at path, once its record is found to fit this run's parts before
    any is read: a state for each part (a sharded one's tensors are in its storage files), a step,
    the model's architecture and the optimizer's kind. The model's dropout is this run's: a
    checkpoint trained at another is resumed at this one, with a note to log."""
    sharded = is_sharded_checkpoint(path)
    missing = [key for key in (*parts, "step") if key not in state and not (sharded and key in in_storage(parts))]
    if missing:
        raise CheckpointError(f"{path} holds no {missing[0]}: a model to score or sample, not a run to resume")
    config = asdict(parts["model"].raw_model.config)
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
    saved_optimizer, this_optimizer = saved_optimizer_name(path, state), optimizer_name(parts["optimizer"].optimizer)
    if saved_optimizer != this_optimizer:
        raise CheckpointError(f"{path} is a run of --optimizer {saved_optimizer}, this one is of --optimizer "
                              f"{this_optimizer}: resume it with --optimizer {saved_optimizer}, or start over "
                              f"in another --log_dir")
    return step


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


def saved_optimizer_problem(raw_model, optimizer, saved):
    """Why saved (optimizer.state_dict()'s form, as one file holds it) holds a state that torch's
    load would cast into shape rather than refuse, or None: each tensor of a parameter's state
    (AdamW's moments, Muon's momentum) must be of the parameter's dtype, as the optimizer keeps
    it (a bool one would be loaded as moments of 0 and 1), and its step count a real number, not
    a bool. A sharded checkpoint's are read as the dtype the optimizer holds, or refused
    (dcp_reader). What load leaves is checked after it (optimizer_state_problem)."""
    names = parameter_names(raw_model)
    for part, saved_part in saved_parts(optimizer, saved):
        # Matched as torch's load matches them: the saved ids, in group order, to this run's parameters.
        saved_ids = [i for group in saved_part["param_groups"] for i in group["params"]]
        params = [p for group in part.param_groups for p in group["params"]]
        for i, param in zip(saved_ids, params):
            for key, value in saved_part["state"].get(i, {}).items():
                problem = saved_value_problem(key, value, param)
                if problem:
                    return f"the state of {names[id(param)]}: {key} {problem}"
    return None


def saved_value_problem(key, value, param):
    """Why value, saved under key of param's optimizer state, is not of the kind that state holds, or None."""
    tensor = isinstance(value, torch.Tensor)
    if key == "step":
        real = tensor and value.dtype != torch.bool and not value.dtype.is_complex or type(value) in (int, float)
        return None if real else f"is {value.dtype if tensor else brief(value)}, not a count"
    if tensor and value.dtype != param.dtype:
        return f"is {value.dtype}, not its parameter's {param.dtype}"
    return None  # not a tensor: loaded as it is, and refused then


def optimizer_state_problem(raw_model, optimizer):
    """Why the state that optimizer has loaded cannot step raw_model's parameters, or None: each
    tensor of a parameter's state (AdamW's moments, Muon's momentum) finite and of the parameter's
    shape, AdamW's exp_avg_sq (a mean of squares) 0 or more, and its step count one finite number,
    0 or more. torch loads a tampered one as it is (casting its tensors to the parameter's dtype
    and device), to fail at the first step or train on from NaN. The param groups' settings are
    this run's own (with_run_settings), checked as its flags are."""
    names = parameter_names(raw_model)
    for part in torch_optimizers(optimizer):
        for param in (p for group in part.param_groups for p in group["params"]):
            for key, value in part.state.get(param, {}).items():
                problem = state_value_problem(key, value, param)
                if problem:
                    return f"the state of {names.get(id(param), 'a parameter')}: {key} {problem}"
    return None


def parameter_names(raw_model):
    """{id(parameter): its plain GPT name} of raw_model's parameters."""
    return {id(p): name for name, p in plain_state_dict(dict(raw_model.named_parameters())).items()}


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
    if key == "exp_avg_sq" and (local < 0).any():
        return "holds negative values: a mean of squares is 0 or more"
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
    """A checkpoint's config (a dict of plain values: contents_problem), checked to hold GPTConfig's
    fields and only those (dropout may be missing: GPTConfig once had none): a field of another,
    or one missing, is a CheckpointError, named within bounds."""
    unknown = next((k for k in config if k not in GPTConfig.__dataclass_fields__), None)
    if unknown is not None:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT (its config has a field {brief(unknown)}, "
                              f"which GPTConfig lacks)")
    missing = next((k for k in GPTConfig.__dataclass_fields__ if k not in config and k != "dropout"), None)
    if missing is not None:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT (its config lacks GPTConfig's field {missing})")
    return config


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
    return [path for path in named_checkpoints(log_dir) if is_checkpoint(path)]


def unnamed_checkpoints(log_dir):
    """The checkpoints in log_dir (is_checkpoint) under names the trainer does not give them, which
    --resume auto does not take: a copy named ckpt.pt, say."""
    named = set(named_checkpoints(log_dir))
    paths = (os.path.join(log_dir, name) for name in sorted(os.listdir(log_dir)))
    return [path for path in paths if path not in named and is_checkpoint(path)]


def is_checkpoint(path):
    """Whether path is a checkpoint by what it is, whatever its name, decided without unpickling
    or reading a tensor: a regular file that is torch.save's zip (is_torch_file), or a directory
    whose .metadata is a regular file that starts as a pickle does and whose train_state.pt is
    torch.save's zip. A link, an empty file or folder, a copy cut short never is; a checkpoint
    damaged inside can be, and its reader says so."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return is_torch_file(path)
        metadata = os.path.join(path, ".metadata")
        if not stat.S_ISREG(os.lstat(metadata).st_mode):
            return False
        with open(metadata, "rb") as f:
            start = f.read(2)
        return len(start) == 2 and start[0] == pickle.PROTO[0] and 2 <= start[1] <= pickle.HIGHEST_PROTOCOL \
            and is_torch_file(os.path.join(path, TRAIN_STATE))
    except OSError:
        return False


def is_torch_file(path):
    """Whether path is a regular file (not a link) in torch.save's format: a zip whose entries
    lie in one folder that holds data.pkl and version. Only the zip's directory, at its end, is read."""
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
    """(path, state) to resume from, or None to start fresh: resume is "none", "auto" (the newest
    checkpoint in log_dir that loads) or a checkpoint's path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(log_dir)
    return resume, load_checkpoint(resume)


def latest_checkpoint(log_dir, map_location="cpu", before=None):
    """(path, state) of the newest checkpoint in log_dir (of a step before `before`, if given) that
    loads, or None if nothing there is named as one. A damaged newer one (a bad disk, a hand edit,
    a copy cut short) is skipped with a warning; if every one is damaged, CheckpointError: starting
    again from step 0 would overwrite the run they hold."""
    every = named_checkpoints(log_dir)
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


# ----------------------------------------------------------------------------- the formats: writers and readers

def save_one_file(path, parts, record):
    """The one-file writer: every part's state_dict() and the record in one file (save_checkpoint),
    which rank 0 writes: under DDP every rank's model and optimizer are the same. Its Saving once
    in place, else None."""
    state = checkpoint_contents(parts, record)  # on every rank: the rng part gathers
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Saving(path, None) if rank == 0 and save_checkpoint(path, state) else None


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


def saved_states(path, state, parts):
    """(name, load, saved) for each of parts: the part's load and what the checkpoint at path holds
    of it (state: what load_checkpoint read of it). Of a sharded checkpoint, the tensors of the
    parts in_storage are read first, in DCP's form, from its storage files: each rank reads only
    the pieces of its slices, on any number of ranks or in one process."""
    if not is_sharded_checkpoint(path):
        return [(name, part.load_state_dict, state[name]) for name, part in parts.items()]
    tensors = {name: parts[name].dcp_state_dict() for name in in_storage(parts)}
    with restoring(path, " and ".join(tensors)):
        dcp_load(tensors, path)
    return [(name, part.load_dcp_state_dict, tensors[name]) if name in tensors else
            (name, part.load_state_dict, state[name]) for name, part in parts.items()]


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
        warn_unwritten(path, error)
        return False
    return True


def load_checkpoint(path, map_location="cpu"):
    """Loads a checkpoint with weights_only=True: tensors and plain data only. A pickle that
    would construct anything else, code included, is refused before any of it runs. Of a
    sharded checkpoint, only train_state.pt: its tensors are read into the parts that hold them
    by load_parts."""
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


def main(argv=None):
    """python checkpoint.py SHARDED_DIR OUT.pt: a sharded checkpoint as the one-file kind, in one
    process: hellaswag.py, sample.py, export_hf.py read either, and a run resumes from either."""
    parser = Parser(prog="checkpoint.py", description=main.__doc__)
    parser.add_argument("sharded", help="a ckpt_XXXXXX/ directory that train_gpt2.py --fsdp 1 wrote")
    parser.add_argument("out", help="the .pt file to write")
    parser.add_argument("--force", action="store_true", help="replace out if it exists")
    args = parser.parse_args(argv)
    if not is_sharded_checkpoint(args.sharded):
        parser.fail(f"{args.sharded}: not a sharded checkpoint (no {TRAIN_STATE})")
    parser.check_output("out", args.out)
    if os.path.lexists(args.out) and not args.force:
        parser.refuse_to_replace(args.out, "exists")
    try:
        state = load_checkpoint(args.sharded)
        model = model_of(args.sharded, state["config"])
        # The groups' values come from the checkpoint, but for Muon's lr_scale: the run's own.
        lr, muon_lr = (recorded_flag(args.sharded, state, name, 1.0, is_rate) for name in ("max_lr", "muon_lr"))
        optimizer = build_optimizer(model, OptimizerConfig(saved_optimizer_name(args.sharded, state), lr, 0.0,
                                                           fused_adamw=False, muon_lr=muon_lr), "cpu")
        parts = {"model": ModelPart(model), "optimizer": OptimizerPart(model, optimizer)}
        load_parts(args.sharded, state, parts)
    except CheckpointError as e:
        parser.fail(str(e))
    state.update({name: part.state_dict() for name, part in parts.items()})
    if "args" in state:  # a record from before it was named "flags", or an older one beside them
        state["flags"] = recorded_flags(state)
        del state["args"]
    if not save_checkpoint(args.out, state):
        sys.exit(1)
    print(f"wrote {args.out}: step {state['step']}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
