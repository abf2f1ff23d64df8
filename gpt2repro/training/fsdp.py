"""FSDP2 for models that do not fit under DDP: parameters, gradients and AdamW's state sharded
over the ranks, with PyTorch's own fully_shard, as torchtitan uses it.

Each Block is one unit (its weights gathered just before its forward and backward, freed just
after), the root another: it keeps the tied token embedding and head together. A model too
large to build whole on every rank is built on the meta device, sharded, then materialized one
parameter at a time, with exactly the initial weights GPT(config) draws in one process.
"""
import math
import warnings
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

from gpt2repro.common import devices
from model import GPT


def apply_fsdp(model, dtype, compile_mode=None, qkv_by_columns=False):
    """Applies FSDP2 to model in place: each Block, then the root, each weight split over the
    ranks by rows; with qkv_by_columns, attention's c_attn weight by columns, so that its q, k and
    v row blocks are views of each rank's slice (--optimizer muon orthogonalizes them apart). Under bf16 or fp16 the weights are
    gathered and computed in that dtype while the sharded masters stay float32, and gradients
    are reduced in float32. compile_mode compiles each Block's forward, as torchtitan compiles each
    block: FSDP's hooks stay outside the graph, which the blocks share (one compilation), and the
    parameters keep their names (a compiled wrapper would add _orig_mod. to them)."""
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        if compile_mode is not None:
            block.forward = devices.compiled(block.forward, compile_mode)
        qkv = block.attn.c_attn.weight if qkv_by_columns else None
        fully_shard(block, mp_policy=policy, shard_placement_fn=lambda p, qkv=qkv: Shard(1) if p is qkv else None)
    fully_shard(model, mp_policy=policy)
    # The logits are a view (the padded vocabulary's extra rows sliced away). FSDP warns about any
    # view its modules return, for the in-place op on it that would skip its backward hook; no
    # caller here modifies logits in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor")
    return model


def is_sharded(model):
    return isinstance(model, FSDPModule)


class RecordedInit(TorchFunctionMode):
    """Records the in-place initialisations that building a module applies to its parameters
    (nn.init's functions, Tensor.zero_ and fill_), in order, so that they can be replayed on
    real tensors after the module was built on the meta device, where they do nothing."""

    def __init__(self):
        super().__init__()
        self.calls = []  # (parameter, function, args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            targets = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Parameter)]
            if targets:
                self.calls.append((targets[0], func, args, kwargs))
        return func(*args, **kwargs)


def build_on_meta(config, **options):
    """(GPT(config, **options) on the meta device, its initialisation: the recorded calls, each with the
    name of the parameter it writes (None for a tensor that is no parameter any more, such as
    the head's own weight before it was tied to the embedding), and the RNG state to replay from)."""
    rng_state = torch.get_rng_state()
    with torch.device("meta"), RecordedInit() as recorded:
        model = GPT(config, **options)
    names = {}
    for name, p in model.named_parameters():  # a tied parameter under its first name, as FSDP keeps it
        names[id(p)] = name
    calls = [(names.get(id(target)), target, func, args, kwargs) for target, func, args, kwargs in recorded.calls]
    return model, (calls, rng_state)


def materialize(model, init, device):
    """Allocates a sharded model that build_on_meta built on device, and replays its
    initialisation one full parameter at a time on the CPU, keeping this rank's slice of each.
    Every call is replayed, in order, from the same RNG state, so the draws are those of
    GPT(config) built in one process; a parameter takes the value of the last call that wrote it."""
    calls, rng_state = init
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    last_write = {name: i for i, (name, *_) in enumerate(calls)}
    torch.set_rng_state(rng_state)
    with torch.no_grad():
        for i, (name, target, func, args, kwargs) in enumerate(calls):
            full = torch.empty(target.shape, dtype=target.dtype)
            func(*[full if a is target else a for a in args], **{k: full if v is target else v for k, v in kwargs.items()})
            if name is not None and last_write[name] == i:
                param = params[name]
                spread = distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(spread.to_local())


@contextmanager
def root_gathered(model):
    """Under FSDP, the root's own weights (the embeddings, the last LayerNorm, the head) gathered
    for calls that do not go through its forward, such as hidden_states and head (the Blocks
    gather theirs in their forwards); elsewhere nothing."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def clip_grad_norm(params, max_norm):
    """Clips the gradients to max_norm (0: no clipping) and returns their norm before clipping, that
    of the whole gradient: under FSDP each rank holds slices, and the norm is over all of them."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm or math.inf, norm, foreach=True)
    return norm
