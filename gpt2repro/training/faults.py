"""Faults injected into a training run on purpose (train_gpt2.py --fault), to test that runs
survive them: a non-finite loss, an out-of-memory error, a SIGTERM, a SIGKILL, at a given step,
on one rank or all. The training step knows nothing of them: the loss is poisoned, and the
out-of-memory error raised, by hooks on the model's forward."""
import argparse
import os
import signal

import torch

from gpt2repro.common.distributed import RunError
from gpt2repro.common.inputs import brief

KINDS = ("nan", "oom", "sigterm", "sigkill")
IMPOSSIBLE_BYTES = 2**62  # what --fault oom allocates: past any memory, and past any address space


def parse_fault(spec):
    """KIND@STEP[:RANK] -> (kind, step, rank or None); the --fault flag's type."""
    kind, _, where = spec.partition("@")
    step, colon, rank = where.partition(":")
    if kind not in KINDS or not step.isdecimal() or (colon and not rank.isdecimal()):
        raise argparse.ArgumentTypeError(f"{brief(spec)} is not KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}")
    return kind, int(step), int(rank) if colon else None


def fault_problem(specs, steps, world_size=None):
    """Why a fault of specs (parse_fault's tuples) would never fire in a run that trains steps (a
    range) on world_size ranks (None: not known yet), or None: a fault test whose fault never
    fires would pass without testing anything."""
    for kind, step, rank in specs or []:
        spec = f"--fault {kind}@{step}" + ("" if rank is None else f":{rank}")
        if step not in steps:
            trained = f"steps {steps.start} to {steps.stop - 1}" if steps else "no step"
            return f"{spec}: this run trains {trained}, never step {step}"
        if world_size is not None and rank is not None and rank >= world_size:
            return f"{spec}: no rank {rank} in a run of {world_size} rank(s)"
    return None


class Faults:
    """The faults of specs (parse_fault's tuples) that fall on rank, fired by before_step; a
    RunError, on every rank alike, if one falls on none of steps (the range the run trains)."""

    def __init__(self, specs, rank, model, steps):
        if problem := fault_problem(specs, steps):
            raise RunError(problem)
        self.at_step = {}
        self.nan_now = self.oom_now = False
        for kind, step, only_rank in specs or []:
            if only_rank is None or only_rank == rank:
                self.at_step.setdefault(step, set()).add(kind)
        if any("nan" in kinds for kinds in self.at_step.values()):
            model.register_forward_hook(self.poison)
        if any("oom" in kinds for kinds in self.at_step.values()):
            model.register_forward_pre_hook(self.out_of_memory)

    def before_step(self, step):
        kinds = self.at_step.get(step, ())
        self.nan_now, self.oom_now = "nan" in kinds, "oom" in kinds
        if "sigterm" in kinds:
            os.kill(os.getpid(), signal.SIGTERM)
        # Only in torchrun's first attempt, so that a restarted worker gets past this step.
        if "sigkill" in kinds and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    def poison(self, model, inputs, output):
        """A forward hook: the training loss of a nan step made NaN (evaluation, in eval mode, is not)."""
        logits, loss = output
        if self.nan_now and model.training and loss is not None:
            return logits, loss * float("nan")
        return output

    def out_of_memory(self, model, inputs):
        """A forward pre-hook: the first training forward of an oom step asks its device for more
        memory than any has, and its allocator fails as when memory runs out (torch.OutOfMemoryError
        on a GPU, a RuntimeError on the host); the step's retry, at half the micro-batch, then runs."""
        if self.oom_now and model.training:
            self.oom_now = False
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device=inputs[0].device)
