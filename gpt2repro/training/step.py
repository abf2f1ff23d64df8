"""The training step: what it works on (Trainable: the GPT wrapped as the step runs it, DDP across
ranks or FSDP2's shards, then torch.compile; its optimizer and its loss scaler), built once by
build_trainable from a StepConfig; then one optimizer step, train_step: a forward-backward pass per
micro-batch, the ranks' agreement on the loss, clipping and the optimizer's step. train_gpt2.py's
loop and bench.py's timings run this same step."""
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2repro.common import devices, distributed
from gpt2repro.common.devices import autocast, synchronize
from gpt2repro.common.distributed import RunError
from gpt2repro.training import fsdp
from gpt2repro.training.optimizers import OptimizerConfig, build_optimizer, set_lr
from model import GPT

# ----------------------------------------------------------------------------- what the step works on

@dataclass(frozen=True)
class StepConfig:
    """How build_trainable builds a Trainable and how its steps run, nothing left auto: a run's
    flags as they settle on its device (train_gpt2.settle_step), or a benchmark's own choice."""
    dtype: torch.dtype  # autocast's; float32 is none
    tokens_per_step: int  # over all ranks: each rank's micro-batches accumulate to its share
    optimizer: OptimizerConfig = OptimizerConfig()  # the recipe's AdamW, and its clipping
    fsdp: bool = False  # sharded over the ranks (FSDP2), else replicated (DDP); recompute is the model's own
    loss_kind: str = "masked"  # how the loss is computed: one of loss.LOSSES
    compile_mode: str | None = None  # None: eager


@dataclass
class Trainable:
    """What a training step works on, built once by build_trainable (bench.py times the same)."""
    step_model: torch.nn.Module  # the GPT as the step runs it: DDP-wrapped and/or compiled, or raw_model itself
    raw_model: GPT  # the plain GPT underneath, sharing the weights: checkpoints, HellaSwag, samples
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a no-op in other dtypes
    device: str
    step_config: StepConfig  # what it was built with: the dtype, step size, clipping and loss its steps use

    def ddp(self):
        """The DDP wrapper the forward runs through (under torch.compile's), or None."""
        model = getattr(self.step_model, "_orig_mod", self.step_model)
        return model if isinstance(model, DDP) else None

    def forward_context(self):
        """Autocast, for one forward pass (and the backward it records)."""
        return autocast(self.device.split(":")[0], self.step_config.dtype)


def build_trainable(raw_model, device, step_config, init=None):
    """The Trainable of a GPT, as step_config says: on device, DDP-wrapped across ranks, then
    compiled in step_config.compile_mode; compiling the DDP wrapper, not the model inside it, lets
    dynamo cut the graph at DDP's buckets, so the all-reduce of one bucket overlaps the backward of
    the rest. Or, with step_config.fsdp, sharded over the ranks (see fsdp.py), and built on the meta
    device when init is its recorded initialisation. Then step_config.optimizer over the parameters
    or their FSDP slices (optimizers.build_optimizer). How the model runs (recompute, attention) is
    its own (train_gpt2.build_model)."""
    if step_config.fsdp:
        model = fsdp.apply_fsdp(raw_model, step_config.dtype, step_config.compile_mode,
                               qkv_by_columns=step_config.optimizer.name == "muon")
        if init is not None:
            fsdp.materialize(raw_model, init, device)
    else:
        model = raw_model
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Gradients as views into DDP's all-reduce buckets (kept, see train_step): no second copy.
            model = DDP(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
                        gradient_as_bucket_view=True)
        if step_config.compile_mode is not None:
            model = devices.compiled(model, step_config.compile_mode)
    optimizer = build_optimizer(raw_model, step_config.optimizer, device.split(":")[0])
    # Under FSDP a rank's slice may hold an overflow that the others lack: the sharded scaler agrees on it.
    scaler = (ShardedGradScaler if step_config.fsdp else torch.amp.GradScaler)(
        device.split(":")[0], enabled=step_config.dtype == torch.float16)
    return Trainable(model, raw_model, optimizer, scaler, device, step_config)


# ----------------------------------------------------------------------------- the step

def to_device(tokens, device):
    # From pinned host memory the copy runs asynchronously, overlapping the GPU's work.
    return tokens.pin_memory().to(device, non_blocking=True) if device.startswith("cuda") else tokens.to(device)


@dataclass
class StepResult:
    loss: float  # the mean over micro-steps and ranks
    grad_norm: float  # before clipping
    lr: float  # the schedule's; each param group steps at a multiple of it
    skipped: bool  # a non-finite loss or gradient: the weights did not change


class StepOutOfMemory(Exception):
    """A training step that ran out of memory on some rank: every rank dropped its partial work."""


def no_stop(*conditions):
    """train_step's stop_requested where no signal stops a step: [False, then whether each of
    conditions is true on any rank]."""
    return distributed.any_rank(False, *conditions)


def train_step(trainable, loader, lr, stop_requested=no_stop):
    """One optimizer step of trainable.step_config.tokens_per_step tokens: a forward-backward pass per
    micro-batch of the loader's, all-reduced (under DDP) only on the last; then the ranks agree on
    the loss, the gradients are unscaled and clipped, and the optimizer steps at lr, unless the loss
    or gradient is not finite. Returns once the device has finished, so the caller's clock times
    the whole step. After each forward pass the ranks agree (stop_requested(out_of_memory) ->
    [stop, out_of_memory], each true if on any rank): a stop returns None, an out-of-memory error
    raises StepOutOfMemory, the weights and optimizer untouched and the loader and random state back
    at the step's start (step_start). A stop never waits for a long step (torchrun SIGKILLs). A
    gradient of norm exactly 0 at a finite loss, which no working configuration gives, is a
    RunError on every rank before the step."""
    ddp = trainable.ddp() is not None
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay
    # so. Set to None, each step would allocate a second set and copy it into the buckets.
    trainable.optimizer.zero_grad(set_to_none=not ddp)
    loss_sum = torch.zeros((), device=trainable.device)
    rewind = step_start(loader, trainable.device)
    out_of_memory = False  # on this rank, in this micro-step's forward pass or an earlier backward pass
    grad_accum_steps = loader.micro_steps(trainable.step_config.tokens_per_step)
    for micro_step in range(grad_accum_steps):
        x, y = (to_device(b, trainable.device) for b in loader.next_batch())
        last = micro_step == grad_accum_steps - 1
        try:
            with trainable.step_model.no_sync() if ddp and not last else nullcontext(), trainable.forward_context():
                loss = trainable.step_model(x, y, loss_kind=trainable.step_config.loss_kind)[1]  # [1]: no logits kept
        except RuntimeError as e:
            if not devices.is_out_of_memory(e):
                raise
            out_of_memory = True
        # Agreed before the backward pass, whose all-reduce (under DDP, the last's) a rank out of memory would miss.
        stop, out_of_memory = stop_requested(out_of_memory)
        if stop or out_of_memory:
            rewind()
            if out_of_memory:
                raise StepOutOfMemory
            return None
        loss = loss / grad_accum_steps  # a sum of micro-batch means would be grad_accum_steps too big
        loss_sum += loss.detach()
        try:
            trainable.scaler.scale(loss).backward()
        except RuntimeError as e:
            if not devices.is_out_of_memory(e):
                raise
            out_of_memory = True
    if distributed.any_rank(out_of_memory)[0]:  # in the last backward pass
        rewind()
        raise StepOutOfMemory
    return optimizer_step(trainable, loss_sum, lr)


def step_start(loader, device):
    """A function that puts back what a dropped step has moved on: the loader's position and the
    random state that draws dropout's masks (the CPU generator's, and on a GPU its own). The step,
    run again here or from the checkpoint a stop writes, then draws the masks it would have."""
    position, cpu = loader.state_dict(), torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.startswith("cuda") else None

    def rewind():
        loader.load_state_dict(position)
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
    return rewind


def optimizer_step(trainable, loss_sum, lr):
    """train_step's end, once the micro-steps' gradients are in: the ranks agree on the loss, the
    gradients are unscaled and clipped, and the optimizer steps at lr, unless the loss or gradient
    is not finite; a gradient of norm exactly 0 at a finite loss is a RunError."""
    # One all-reduce and one wait for the device: every rank gets the same loss (non-finite if any
    # rank's was) and norm (of gradients already all-reduced), so all decide alike.
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    trainable.scaler.unscale_(trainable.optimizer)
    norm = fsdp.clip_grad_norm(trainable.raw_model.parameters(), trainable.step_config.optimizer.grad_clip)
    loss_sum, norm = torch.stack([loss_sum, norm]).tolist()
    loss = loss_sum / distributed.world_size()
    if norm == 0 and math.isfinite(loss):  # no correct configuration gives an exact 0: refused before it steps
        raise RunError(f"no parameter received a gradient (the gradient norm is exactly 0 at loss {loss:.4f}) under "
                       f"--loss {trainable.step_config.loss_kind}: this configuration trains nothing")
    # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that step itself.
    skipped = not (math.isfinite(loss) and (math.isfinite(norm) or trainable.scaler.is_enabled()))
    if not skipped:
        set_lr(trainable.optimizer, lr)
        trainable.scaler.step(trainable.optimizer)
    trainable.scaler.update()  # after every unscale_, or the next step's unscale_ raises
    synchronize(trainable.device)
    return StepResult(loss, norm, lr, skipped)


def train_step_fitting(trainable, loader, lr, stop_requested=no_stop, halve=True, log=lambda line: None):
    """train_step's result. With halve, each time the step runs out of memory it runs again at half
    the micro-batch and twice the micro-steps: the same tokens (ShardLoader.resize), the same
    optimizer step, and a line to log. StepOutOfMemory where it cannot: without halve, or at one
    sequence."""
    while True:
        try:
            return train_step(trainable, loader, lr, stop_requested)
        except StepOutOfMemory:
            if not halve or loader.B == 1:
                raise
        ddp = trainable.ddp()
        if ddp is not None:  # its last forward readied an all-reduce no backward will start
            ddp.reducer._reset_state()
        micro_batch = loader.B
        loader.resize(micro_batch // 2)
        if trainable.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the failed step's blocks, cached: a smaller micro-batch needs other sizes
        log(f"micro-batch {micro_batch} -> {loader.B}, {loader.micro_steps(trainable.step_config.tokens_per_step)} "
            f"micro-steps per step")
