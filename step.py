"""What a training step works on (Trainable): the GPT wrapped as the step runs it (DDP across ranks,
or FSDP2's shards, then torch.compile), its optimizer and its loss scaler, built once by
build_trainable from a StepConfig. train_gpt2.py's step and bench.py's timings run the same."""
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

import devices
import sharding
from devices import autocast
from model import GPT
from optimizers import OptimizerConfig, build_optimizer
from train_config import ScaleConfig


@dataclass(frozen=True)
class StepConfig:
    """How build_trainable builds a Trainable and how its steps run: the run's optimizer and
    scale settings, and what its flags settle to on one device."""
    dtype: torch.dtype  # autocast's; float32 is none
    tokens_per_step: int  # over all ranks: each rank's micro-batches accumulate to its share
    optimizer: OptimizerConfig = OptimizerConfig()  # the recipe's AdamW, and its clipping
    scale: ScaleConfig = ScaleConfig(loss="masked")  # FSDP, and the loss (recompute is the model's own)
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

    def loss_options(self):
        """The training forward's keywords that pick how the loss is computed (ScaleConfig.loss)."""
        return dict(loss_kind=self.step_config.scale.loss)

    def ddp(self):
        """The DDP wrapper the forward runs through (under torch.compile's), or None."""
        model = getattr(self.step_model, "_orig_mod", self.step_model)
        return model if isinstance(model, DDP) else None

    def forward_context(self):
        """Autocast, for one forward pass (and the backward it records)."""
        return autocast(self.device.split(":")[0], self.step_config.dtype)


def to_device(batch, device):
    # From pinned host memory the copy runs asynchronously, overlapping the GPU's work.
    return batch.pin_memory().to(device, non_blocking=True) if device.startswith("cuda") else batch.to(device)


def build_trainable(raw_model, device, config, init=None):
    """The Trainable of a GPT, as config (a StepConfig) says: on device, DDP-wrapped across ranks,
    then compiled in config.compile_mode; compiling the DDP wrapper, not the model inside it, lets
    dynamo cut the graph at DDP's buckets, so the all-reduce of one bucket overlaps the backward of
    the rest. Or, with config.scale.fsdp, sharded over the ranks (see sharding.py), and built on the meta
    device when init is its recorded initialisation. Then config.optimizer over the parameters or
    their FSDP slices (optimizers.build_optimizer). How the model runs (recompute, attention) is its
    own: see setup. The loss is config's, auto resolved for device (loss.pick_loss)."""
    config = replace(config, scale=config.scale.settled(device.split(":")[0]))
    dtype = config.dtype
    if config.scale.fsdp:
        model = sharding.apply_fsdp(raw_model, dtype, config.compile_mode, qkv_by_columns=config.optimizer.name == "muon")
        if init is not None:
            sharding.materialize(raw_model, init, device)
    else:
        model = raw_model
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Gradients as views into DDP's all-reduce buckets (kept, see train_step): no second copy.
            model = DDP(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
                        gradient_as_bucket_view=True)
        if config.compile_mode is not None:
            model = devices.compiled(model, config.compile_mode)
    optimizer = build_optimizer(raw_model, config.optimizer, device.split(":")[0])
    # Under FSDP a rank's slice may hold an overflow that the others lack: the sharded scaler agrees on it.
    scaler = (ShardedGradScaler if config.scale.fsdp else torch.amp.GradScaler)(device.split(":")[0],
                                                                         enabled=dtype == torch.float16)
    return Trainable(model, raw_model, optimizer, scaler, device, config)
