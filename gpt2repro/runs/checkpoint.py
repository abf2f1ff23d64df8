"""A run's checkpoints: what a run saves, when, and how it resumes from them.

A run hands its Checkpointer, once, its stateful parts (training_parts): the model (its part is
model_weights.py's, which the scripts share), the optimizer (whose saved state optimizer_state.py
loads and checks), the loss scaler, the train loader's position and every rank's random state. Each
part saves and restores itself (state_dict, load_state_dict); a checkpoint holds each under its
name, beside its record: the step, the run's identity, the config (GPTConfig as a dict) and the
run's flags (TrainConfig.flags()). How a checkpoint lies in files, one file or a sharded directory,
and where in a log_dir, is checkpoint_files.py's; a run resumes through restore_parts, from either
format, on any number of ranks. This file reads in that order: the Checkpointer that decides when a
run saves, saves and restores; the parts; how a checkpoint restores them, once its record is found
to fit the run. The root's checkpoint.py converts a sharded checkpoint into one file.
"""
import math
import os
from dataclasses import asdict
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule

from gpt2repro.common.distributed import RunError, agree, every_rank
from gpt2repro.common.inputs import brief, first_line
from gpt2repro.runs.checkpoint_files import (Unrestorable, check_no_later_checkpoints, checkpoint_path, checkpoint_step,
                                             find_resume, is_step, latest_checkpoint, load_parts, new_run_identity,
                                             prune_checkpoints, refuse_on_every_rank, save_error, save_one_file,
                                             save_sharded, warn_unwritten)
from gpt2repro.runs.dcp_reader import CheckpointError, UnreadableStorage
from gpt2repro.runs.model_weights import ModelPart, model_fields
from gpt2repro.runs.optimizer_state import (keyed_by_name, load_optimizer_state, number_in, optimizer_state_problem,
                                            saved_optimizer_problem, with_run_settings, with_tensors_of_their_own)
from gpt2repro.training.optimizers import OPTIMIZERS, optimizer_name, torch_optimizers
from model import GPTConfig


# ----------------------------------------------------------------------------- a run's checkpoints

class Checkpointer:
    """When and how a run saves and resumes its parts (training_parts), as torchtitan's
    CheckpointManager: every interval steps and at the end, only finite weights, only where every
    rank's disk has room, one file from rank 0 or (sharded) storage files from every rank, in the
    background with async_save, the oldest pruned to keep_last. A save that fails (a full disk) is
    a warning: training goes on. claim: rank 0's LogDirClaim on log_dir, checked before anything
    is written or pruned there (None on the other ranks)."""

    def __init__(self, log_dir, parts, interval, keep_last, sharded=False, async_save=False, log=print, claim=None):
        self.log_dir, self.parts, self.interval, self.keep_last = log_dir, parts, interval, keep_last
        self.sharded, self.log, self.claim = sharded, log, claim
        self.write = partial(save_sharded, async_save=async_save) if sharded else save_one_file  # the one difference
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # the Saving of a checkpoint still being written
        self.run = None  # the run's identity, recorded in each checkpoint: restore settles it

    def due(self, step, start_step, last_step):
        """Whether to save at step: every interval steps and at the end, but not the step resumed from."""
        return step > start_step and (last_step or bool(self.interval and step % self.interval == 0))

    def save(self, step, flags):
        """Saves every part at step, with flags (TrainConfig.flags()) as the run's record, on every
        rank at once: a refusal (weights that are not finite) then stops every rank, none left
        waiting at the next collective. An interval of -1 saves nothing."""
        if self.interval < 0:
            return
        if self.claim:
            self.claim.check()
        finite = self.parts["model"].finite()
        agree(None if finite else f"the weights at step {step} are not finite: not checkpointing them")
        self.wait()  # one checkpoint at a time
        record = checkpoint_record(self.parts, step, flags, self.run)
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
            if self.claim:
                self.claim.check()
            prune_checkpoints(self.log_dir, self.keep_last)
        self.log(f"saved {path}")

    def restore(self, resume, max_steps, flags):
        """Restores every part from the checkpoint resume names ("auto", "none" or a path), under
        this run's hyperparameters; given the run's flags (TrainConfig.flags()), logs those that
        differ from the checkpoint's record in one line. Returns the step to start from, and settles
        the run's identity (run_identity). Every rank reads the checkpoint itself, so all must find
        the same one: on several nodes, log_dir must be shared storage. Under "auto", a sharded
        checkpoint whose storage files cannot be read (damage shows only then) is passed over for
        the next older one, which overwrites whatever the failed restore had loaded."""
        found = find_resume(resume, self.log_dir)
        while True:
            steps = every_rank(found[1].get("step") if found else None)  # a model-only one has none: restore says so
            if len(set(steps)) > 1:
                raise RunError(f"the ranks found different checkpoints to resume from (step per rank: {steps}): "
                               f"on several nodes, --log_dir must be a directory they all share")
            if found is None:
                self.run = run_identity(None)
                return 0
            path, state = found
            try:
                step = restore_parts(found, self.parts, self.log, flags)
                break
            except UnreadableStorage as e:
                if resume != "auto":
                    raise
                self.log(f"warning: skipping {e}")
                found = latest_checkpoint(self.log_dir, before=checkpoint_step(path))
        self.run = run_identity(state)
        self.log(f"resuming from {path} at step {step}")
        changed = changed_hyperparameters(recorded_flags(state), flags)
        if changed:
            self.log(f"this run's flags win over the checkpoint's: {', '.join(changed)}")
        for line in changed_inputs(recorded_flags(state), flags, self.parts["train_loader"].loader.epoch):
            self.log(line)
        if resume != "auto" and step < max_steps:
            check_no_later_checkpoints(self.log_dir, step)
        return step


# ----------------------------------------------------------------------------- the parts of a run

def training_parts(trainable, train_loader):
    """The stateful parts of a run (trainable: step.Trainable), by the name each has in a
    checkpoint. Each has state_dict() and load_state_dict(saved), which returns None or a note on
    the checkpoint to log after its path; those whose tensors a sharded checkpoint holds in DCP's
    storage files (in_storage) also have dcp_state_dict() and load_dcp_state_dict(loaded), in
    DCP's form: keyed by the parameters' names, each rank's slices under FSDP."""
    model = trainable.raw_model
    return {"model": ModelPart(model), "optimizer": OptimizerPart(model, trainable.optimizer),
            "scaler": ScalerPart(trainable.scaler), "train_loader": LoaderPart(train_loader),
            "rng": RandomStates(model.config.dropout)}


def checkpoint_record(parts, step, flags, run):
    """What a checkpoint records of its run beside the parts' states: the step, the run's identity
    (run_identity), the model's config (GPTConfig as a dict) and the run's flags (TrainConfig.flags())."""
    return {"step": step, "run": run, "config": asdict(parts["model"].raw_model.config), "flags": flags}


def run_identity(state):
    """The identity of the run that resumes state (a checkpoint's; None where it starts afresh),
    the same on every rank: its record's, or a new one (rank 0's) where it records none, at a
    fresh start or from a checkpoint written before runs had one. With the step, it tells which of
    two checkpoints is the later of a run (checkpoint_files.Saved), whatever their files' times."""
    recorded = state.get("run") if state else None
    return every_rank(recorded or new_run_identity())[0]


class OptimizerPart:
    """What the optimizer learned (AdamW's moments, Muon's momentum buffers, the step counts),
    restored under this run's settings (optimizer_state.py: load_optimizer_state), then checked on
    every rank before any steps (optimizer_state_problem), against the run that saved it where
    expect gave it. state_dict() is keyed by each parameter's place in its optimizer, a MuonAdamW's
    as {"adamw": ..., "muon": ...}, as one file holds it."""

    def __init__(self, raw_model, optimizer):
        self.raw_model, self.optimizer = raw_model, optimizer
        self.run = None  # the SavedRun of the checkpoint being restored

    def expect(self, run):
        """The next state loaded is of run (a SavedRun): its step counts and moments are checked against it."""
        self.run = run

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, saved):
        problem = saved_optimizer_problem(self.raw_model, self.optimizer, saved)
        if problem:
            raise Unrestorable(problem)
        saved = with_tensors_of_their_own(self.optimizer, saved)
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
        refuse_on_every_rank(optimizer_state_problem(self.raw_model, self.optimizer, self.run))


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
    run read other micro-batches (another -B, -B auto on another GPU, another number of ranks),
    beside what identifies the shards it read (ShardLoader.identity): a resume reads on only from
    the same shards, at a position that the saved run's steps reach (expect gives that run)."""

    def __init__(self, loader):
        self.loader = loader
        self.run = None  # the SavedRun of the checkpoint being restored

    def expect(self, run):
        """The next position loaded is of run (a SavedRun): it must be one that run's steps reach."""
        self.run = run

    def state_dict(self):
        return {**self.loader.state_dict(), "shards": self.loader.identity}

    def load_state_dict(self, saved):
        refuse_on_every_rank(self.saved_problem(saved))  # each rank's copy of the shards checked
        self.loader.load_state_dict(saved)
        notes = []
        if "shards" not in saved:
            notes.append(f"records no identity of the train shards it read (saved before that record): resuming "
                         f"on those of {os.path.dirname(self.loader.shards[0].path)} unchecked")
        if saved["tokens_per_index"] != self.loader.tokens_per_index:
            notes.append(f"was saved by a run of micro-batches of {saved['tokens_per_index']:,} tokens over all "
                         f"ranks, this run's are {self.loader.tokens_per_index:,}: the same tokens per optimizer "
                         f"step, in other micro-steps")
        return "; it ".join(notes) or None

    def saved_problem(self, saved):
        """Why saved cannot be this loader's position, or None: a position of these shards
        (position_problem) that are the shards the saved run read (identity_problem; a checkpoint
        from before that record has none), and one that the expected run's steps reach (step_problem)."""
        problem = self.loader.position_problem(saved)
        if problem is None and "shards" in saved:
            problem = self.loader.identity_problem(saved["shards"])
        run = self.run
        if problem is None and run is not None and run.tokens_per_step and run.seq_len:
            problem = self.loader.step_problem(saved, run.step, run.tokens_per_step, run.seq_len)
        return problem


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
    refuse_on_every_rank(problem)
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

def restore_parts(checkpoint, parts, log=print, flags=None):
    """Puts every part back as checkpoint (a Checkpoint, as load_checkpoint reads one) saved it,
    from either format into a model sharded or not, once its record is found to fit this run
    (check_resumable); each part that checks its state against the run that saved it (expect) is
    given that run (SavedRun: of the record, or for a flag it lacks this run's flags, TrainConfig.flags(),
    if given). Logs each part's note on it, and returns its step."""
    step = check_resumable(checkpoint, parts, log)
    run = saved_run(checkpoint.path, checkpoint.state, flags or {})
    for part in parts.values():
        if hasattr(part, "expect"):
            part.expect(run)
    for note in load_parts(checkpoint, parts):
        log(f"note: {checkpoint.path} {note}")
    return step


class SavedRun(NamedTuple):
    """What a checkpoint's record says of the run that saved it, against which its parts' states
    are checked: where that run was (its step) and the flags that decide what its steps did. A
    step reads tokens_per_step tokens (--total_batch_size) in micro-batches of sequences of
    seq_len (-T), and its gradient is clipped to a norm of grad_clip: the larger of its recorded
    --grad_clip and this run's (0 where either is 0, unclipped), so that a run which lowered the
    flag on resume, whose moments keep the larger clip's gradients for a while, resumes under it."""
    step: int
    tokens_per_step: int | None  # None: neither the record nor this run says
    seq_len: int | None
    grad_clip: float


def saved_run(path, state, flags):
    """The SavedRun of the checkpoint at path (state: its contents, its step checked), each flag
    as its record holds it, else as flags (this run's, TrainConfig.flags()) do; a recorded value
    the flag cannot take is a CheckpointError."""
    def positive(value):
        return value is None or type(value) is int and value > 0

    def flag(name, valid):
        return recorded_flag(path, state, name, flags.get(name), valid)
    clips = [clip for clip in (flag("grad_clip", lambda value: value is None or number_in(value, 0, math.inf)),
                               flags.get("grad_clip")) if clip is not None]
    grad_clip = max(clips) if clips and 0 not in clips else 0
    return SavedRun(state["step"], flag("total_batch_size", positive), flag("seq_len", positive), grad_clip)


def check_resumable(checkpoint, parts, log):
    """The step of checkpoint (a Checkpoint), once its record is found to fit this run's parts
    before any is read: a state for each part (a sharded one's tensors are in its storage files),
    a step, the model's architecture and the optimizer's kind. The model's dropout is this run's:
    a checkpoint trained at another is resumed at this one, with a note to log."""
    path, state = checkpoint
    missing = [key for key in (*parts, "step") if not checkpoint.holds(key, parts)]
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
    if not is_step(step):
        raise CheckpointError(f"{path}: its step is {brief(step)}, not a step number")
    saved_optimizer, this_optimizer = saved_optimizer_name(path, state), optimizer_name(parts["optimizer"].optimizer)
    if saved_optimizer != this_optimizer:
        raise CheckpointError(f"{path} is a run of --optimizer {saved_optimizer}, this one is of --optimizer "
                              f"{this_optimizer}: resume it with --optimizer {saved_optimizer}, or start over "
                              f"in another --log_dir")
    return step


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


def changed_hyperparameters(saved_flags, flags):
    """["name old -> new"] for each of HYPERPARAMETER_FLAGS whose value in flags (this run's, as
    TrainConfig.flags() gives them) differs from saved_flags, a checkpoint's record of its run's
    (recorded_flags); nothing for a flag the record lacks, or a checkpoint with no record."""
    if not isinstance(saved_flags, dict):
        return []
    return [f"{name} {brief(saved_flags[name])} -> {flags[name]}" for name in HYPERPARAMETER_FLAGS
            if name in saved_flags and name in flags and saved_flags[name] != flags[name]]


def changed_inputs(saved_flags, flags, epoch):
    """A line for each flag that sets what the run reads, -T and --seed, whose value in flags differs
    from saved_flags (as changed_hyperparameters), saying what the change does to a run resumed in
    its epoch (the loader's, from 0): this run's value wins there too."""
    if not isinstance(saved_flags, dict):
        return []
    changed = {name: f"({brief(saved_flags[name])} -> {flags[name]})" for name in ("seq_len", "seed")
               if name in saved_flags and name in flags and saved_flags[name] != flags[name]}
    lines = []
    if "seq_len" in changed:
        lines.append(f"this run's -T wins over the checkpoint's {changed['seq_len']}: the model trains on sequences "
                     f"of {flags['seq_len']} tokens from here, cut from the data at other places; its val loss, over "
                     f"such sequences too, is not comparable with the one before")
    if "seed" in changed:
        # The seed shuffles each epoch after the first (data.ShardLoader); the random states that
        # draw dropout's masks are the checkpoint's, restored.
        order = ("the data is read in file order all the same (--shuffle 0)" if not flags.get("shuffle") else
                 "the epochs after the first, which it shuffles, are read in another order" if epoch == 0 else
                 "this epoch and the later ones, which it shuffles, are read in another order: some of this "
                 "epoch's sequences are read twice, others not at all")
        lines.append(f"this run's --seed wins over the checkpoint's {changed['seed']}: {order}, and the samples differ")
    return lines

