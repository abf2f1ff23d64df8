"""The run's optimizer (--optimizer): the recipe's AdamW for every parameter (GPT.configure_optimizers'
two groups), or, under --optimizer muon, torch.optim.Muon for the matrices inside the blocks and that
AdamW for everything else, as one optimizer object that the trainer, torch.amp.GradScaler and the
checkpoints treat as they treat AdamW alone; and the learning rate each of its groups steps at.

Muon's parameters are the four matrices of each Block: attention's c_attn and c_proj, the MLP's
c_fc and c_proj. They are nn.Linear weights, (out, in), the orientation Muon's shape adjustment
(sqrt(max(1, out/in))) expects. c_attn holds q, k and v as one (3C, C) matrix; they are
orthogonalized apart, as three (C, C) matrices (BlockMuon), as modded-nanogpt does: on Tiny
Shakespeare that ended 0.02 to 0.03 nats below the whole matrix (bench/results/muon-cpu-2core/).
The tied token embedding and head, the position embedding, the biases and the LayerNorms stay with
AdamW, in configure_optimizers' two groups.

Under FSDP2 (--fsdp 1) the matrices are DTensors: torch.optim.Muon's Newton-Schulz matmuls are
DTensor ops, which DTensor carries out across the ranks, so 2 ranks step as one process does.
The trainer then has fsdp.py split c_attn over the ranks by columns, so that its q, k and v
row blocks are views of each rank's slice.

The schedule: set_lr sets each param group's lr to the schedule's lr(step) times the group's own
"lr_scale" (1 where it has none: AdamW's, whose lr is then the schedule's exactly), as a LambdaLR
scales each group's lr. Muon's groups carry lr_scale = muon_lr / max_lr, so their lr warms up and
decays with AdamW's and peaks at muon_lr.
"""
from dataclasses import dataclass

import torch

from gpt2repro.common.settings import check_not_negative, check_positive, setting

OPTIMIZERS = ("adamw", "muon")
# --muon_lr, --muon_momentum and --muon_weight_decay by default: the best measured (bench/results/muon-cpu-2core/).
MUON_LR, MUON_MOMENTUM, MUON_WEIGHT_DECAY = 0.02, 0.9, 0.1
MUON_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # in each Block


@dataclass(frozen=True)
class OptimizerConfig:
    """A run's optimizer: the recipe's AdamW for every parameter, or Muon for the blocks' matrices
    and that AdamW for the rest. max_lr and muon_lr are the peaks that the schedule scales."""
    name: str = setting("adamw", "adamw: AdamW for every parameter (the recipe); muon: torch.optim.Muon for the "
                                 "blocks' four matrices (qkv, attention projection, MLP in and out), AdamW as in the "
                                 "recipe for the rest", flag="optimizer", choices=OPTIMIZERS)
    max_lr: float = setting(6e-4, "peak learning rate, reached after warmup")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings")
    grad_clip: float = setting(1.0, "max global grad norm (0: no clipping)")
    muon_lr: float = setting(MUON_LR, "Muon's peak lr; the schedule scales it as it scales --max_lr")
    muon_momentum: float = setting(MUON_MOMENTUM, "Muon's (Nesterov) momentum")
    muon_weight_decay: float = setting(MUON_WEIGHT_DECAY, "Muon's decoupled weight decay (times its lr, as AdamW's)")
    fused_adamw: bool | None = None  # AdamW's fused kernel; None: on CUDA

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, not {self.name!r}")
        check_positive(self, "max_lr")
        check_not_negative(self, "weight_decay", "grad_clip")
        for name in ("max_lr", "weight_decay", "muon_lr", "muon_weight_decay"):  # stepped as float32 scalars
            if abs(getattr(self, name)) > torch.finfo(torch.float32).max:
                raise ValueError(f"--{name} {getattr(self, name)} is past float32's range, in which the optimizer "
                                 f"steps")
        if self.name == "muon":
            check_positive(self, "muon_lr")
            check_not_negative(self, "muon_weight_decay")
            if not 0 <= self.muon_momentum < 1:
                raise ValueError(f"--muon_momentum must be in [0, 1), not {self.muon_momentum}")


def muon_params(raw_model):
    """The weights Muon takes: the four matrices of every Block, in the model's order."""
    return [getattr(getattr(block, matrix.split(".")[0]), matrix.split(".")[1]).weight
            for block in raw_model.transformer.h for matrix in MUON_MATRICES]


class MuonAdamW:
    """torch.optim.Muon over muon_params, AdamW over the rest, as one optimizer. param_groups are
    the children's own group dicts (AdamW's, then Muon's), so setting a group's lr sets the child's
    and GradScaler.unscale_ reaches every gradient; zero_grad and step do both; state_dict is
    {"adamw": ..., "muon": ...}. Not an Optimizer subclass: it holds no parameters of its own."""

    name = "muon"

    def __init__(self, adamw, muon):
        self.children = {"adamw": adamw, "muon": muon}

    @property
    def adamw(self):
        return self.children["adamw"]

    @property
    def muon(self):
        return self.children["muon"]

    @property
    def param_groups(self):
        return [group for child in self.children.values() for group in child.param_groups]

    @property
    def state(self):
        return {**self.adamw.state, **self.muon.state}

    def zero_grad(self, set_to_none=True):
        for child in self.children.values():
            child.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for child in self.children.values():
            child.step()

    def state_dict(self):
        return {name: child.state_dict() for name, child in self.children.items()}

    def load_state_dict(self, state_dict):
        """Each child from its own entry (optimizer_state.load_optimizer_state also keeps this run's
        settings in every group)."""
        for name, child in self.children.items():
            child.load_state_dict(state_dict[name])


def torch_optimizers(optimizer):
    """The torch.optim optimizers that optimizer is made of (for torch.distributed.checkpoint's
    state dict functions, which take several): a MuonAdamW's AdamW and Muon, else itself."""
    return tuple(optimizer.children.values()) if isinstance(optimizer, MuonAdamW) else (optimizer,)


def saved_states_of(optimizer, saved):
    """[(torch optimizer, its state dict)] for each of torch_optimizers(optimizer), from saved, a
    state_dict() of optimizer's kind. KeyError where saved lacks a child's."""
    if isinstance(optimizer, MuonAdamW):
        return [(child, saved[name]) for name, child in optimizer.children.items()]
    return [(optimizer, saved)]


class BlockMuon(torch.optim.Muon):
    """torch.optim.Muon, but the matrices of a group with "row_blocks": n are orthogonalized as n
    row blocks apart (c_attn's q, k and v). Momentum and weight decay are elementwise, so only the
    Newton-Schulz step and the shape's lr adjustment see the blocks; the state stays one momentum
    buffer per matrix."""

    def _init_group(self, group, params, grads, momentum_buffers):
        has_complex = super()._init_group(group, params, grads, momentum_buffers)
        n = group.get("row_blocks", 1)
        if n > 1:  # views: the step writes into the matrix and its buffer
            for tensors in (params, grads, momentum_buffers):
                tensors[:] = [block for tensor in tensors for block in tensor.chunk(n)]
        return has_complex


def build_optimizer(raw_model, config, device_type):
    """The optimizer of an OptimizerConfig: configure_optimizers' AdamW (adamw), or a MuonAdamW
    whose AdamW is configure_optimizers' less muon_params, and whose Muon (nesterov, torch's
    Newton-Schulz defaults) has two groups: the c_attn matrices, as q, k and v apart, then the
    others. Muon's groups carry their lr_scale, the multiple of the schedule's lr they step at."""
    matrices = muon_params(raw_model) if config.name == "muon" else []
    adamw = raw_model.configure_optimizers(config.weight_decay, config.max_lr, device_type, fused=config.fused_adamw,
                                           exclude=matrices)
    if config.name == "adamw":
        return adamw
    qkv = [block.attn.c_attn.weight for block in raw_model.transformer.h]
    others = [p for p in matrices if all(p is not q for q in qkv)]
    scale = config.muon_lr / config.max_lr
    muon = BlockMuon([{"params": qkv, "row_blocks": 3, "lr_scale": scale}, {"params": others, "lr_scale": scale}],
                     lr=config.muon_lr, weight_decay=config.muon_weight_decay, momentum=config.muon_momentum)
    return MuonAdamW(adamw, muon)


def set_lr(optimizer, lr):
    """Sets each param group's lr to lr, the schedule's, times the group's lr_scale (1 where it has none)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1)


def current_muon_lr(optimizer):
    """The lr Muon's groups stepped at last, or None for an optimizer without Muon."""
    return optimizer.muon.param_groups[0]["lr"] if isinstance(optimizer, MuonAdamW) else None


def describe(optimizer, config):
    """A MuonAdamW, in the line the trainer logs."""
    matrices = [p for group in optimizer.muon.param_groups for p in group["params"]]
    return (f"optimizer: Muon (peak lr {config.muon_lr}, momentum {config.muon_momentum}, weight decay "
            f"{config.muon_weight_decay}) on {len(matrices)} matrices ({sum(p.numel() for p in matrices):,} "
            f"parameters), AdamW (peak lr {config.max_lr}) on the rest")


def optimizer_name(optimizer):
    """"muon" for a MuonAdamW, "adamw" for anything else (configure_optimizers' AdamW)."""
    return getattr(optimizer, "name", "adamw")
