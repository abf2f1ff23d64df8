"""How much memory training takes, per GPU (or CPU process), before any is allocated: train_gpt2.py
--plan, -B auto's choice against a GPU's free memory or a host's available memory, the presets table
in docs/scaling.md (`python -m gpt2repro.training.memory` prints it), and the check, shared by the trainer and
bench.py, that refuses a model its device cannot hold.

Weights, gradients and AdamW's two moments are float32 (16 bytes a parameter), divided over the
ranks under FSDP; under --optimizer muon the blocks' matrices have Muon's one momentum buffer
instead of AdamW's two moments (12 bytes for those parameters). Activations are what the forward pass keeps for the backward, counted per
position of the micro-batch: the residual stream and LayerNorms in float32, what the matmuls read
in the autocast dtype. Under --dropout, each dropout's mask (one byte an element, as CUDA's
kernel keeps it) after the embeddings and on each residual branch; the attention probabilities'
mask is none, as flash attention draws it again in the backward from a seed (the math kernel
would keep n_head * seq_len bytes a position per block). tests/training/test_memory.py checks them against
the tensors a tiny model saves.
"""
import os
import sys
from dataclasses import dataclass, replace

import torch

from gpt2repro.common.cli import Parser, preset_names, preset_path, read_config
from gpt2repro.common.devices import auto_device_type, available_memory, device_memory, pick_dtype, resolve_compile
from gpt2repro.common.distributed import agree, every_rank
from gpt2repro.lm.loss import CHUNK, LOSSES, pick_loss
from gpt2repro.lm.tokenizer import N_VOCAB, PADDED_VOCAB
from gpt2repro.training.train_config import AUTO_MAX_MICRO_BATCH, BatchConfig, ScaleConfig, TrainConfig
from model import GPTConfig, n_params

GiB = 2**30


@dataclass
class Plan:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int

    @property
    def total(self):
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def table(self):
        rows = [(name, getattr(self, name)) for name in ("weights", "gradients", "optimizer", "activations", "logits")]
        return "\n".join(f"  {name:<12} {size / GiB:8.2f} GiB" for name, size in rows + [("total", self.total)])


@dataclass(frozen=True)
class Compute:
    """How a step computes, as the plan counts it: the bytes of the autocast dtype (4: float32, no
    autocast), compiled or eager, and the loss's kind (one of loss.LOSSES: settled, never auto)."""
    dtype_bytes: int = 2
    compiled: bool = False
    loss_kind: str = "masked"

    @classmethod
    def of(cls, step_config):
        """How the steps of a StepConfig (step.py) compute."""
        return cls(step_config.dtype.itemsize, step_config.compile_mode is not None, step_config.loss_kind)


def n_muon_params(config):
    """Parameters Muon takes under --optimizer muon: the four matrices of each block (12 C^2)."""
    return config.n_layer * 12 * config.n_embd * config.n_embd


def optimizer_bytes(config, optimizer="adamw"):
    """The optimizer's state, float32: AdamW's two moments (8 bytes a parameter), or under
    muon Muon's momentum (4 bytes) for its matrices and AdamW's for the rest."""
    P = n_params(config)
    if optimizer == "adamw":
        return 8 * P
    if optimizer == "muon":
        return 8 * (P - n_muon_params(config)) + 4 * n_muon_params(config)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def block_activation_bytes(config, recompute, a):
    """Bytes a Block keeps for the backward pass, per position: a = bytes of the autocast dtype."""
    C, H = config.n_embd, config.n_head
    inputs = 4 * C  # the block's input, float32: kept in every mode
    if recompute == "full":
        return inputs
    mask = C if config.dropout else 0  # a residual branch's dropout mask
    attention = 8 + a * (C + 3 * C + C) + 4 * H + mask  # LayerNorm stats, ln_1 out, q k v, SDPA out, log-sum-exp
    if recompute == "attn":
        attention = 0
    elif recompute == "core_attn":  # SDPA's output is kept anyway, as c_proj's input: only the log-sum-exp goes
        attention -= 4 * H
    mlp = 4 * C + 8 + a * (C + 4 * C + 4 * C) + mask  # its float32 input, LayerNorm stats, ln_2 out, c_fc out, GELU out
    return inputs + attention + mlp


def activation_bytes(config, micro_batch, seq_len, recompute="none", every=1, a=2):
    """What the forward pass keeps for the backward, the loss's logits aside. Blocks 0, every,
    2*every, ... recompute, the others keep everything."""
    recomputing = -(-config.n_layer // every)  # counted, not summed block by block: any n_layer at once
    blocks = (recomputing * block_activation_bytes(config, recompute, a)
              + (config.n_layer - recomputing) * block_activation_bytes(config, "none", a))
    # ids, targets, the embeddings' dropout mask, ln_f's input, stats and output
    top = 8 + 8 + (config.n_embd if config.dropout else 0) + 4 * config.n_embd + 8 + 4 * config.n_embd
    return micro_batch * seq_len * (blocks + top)


def logits_bytes(config, micro_batch, seq_len, loss_kind, a=2, compiled=False):
    """The peak of the loss of loss_kind (one of loss.LOSSES), by what it does with the (positions,
    vocab) logits:
    - fused: one chunk's logits in the autocast dtype alone, their gradient written over them, plus
      the head's float32 gradient it keeps for the backward (head_gradient_bytes);
    - chunked: the same, and the float32 copy of the chunk's real columns that torch's row kernel
      turns into their gradient in place (none in float32, where the buffer is that copy);
    - masked, eager: three float32 tensors at the backward's peak (the log-softmax, the gradient it
      gets and the one it passes back), whatever the dtype;
    - masked, compiled: 6 bytes an entry, as if the logits in the autocast dtype and one float32
      tensor of their size were held at once: fitted to the peak measured at GPT-2 (124M), B=64,
      bf16 on an H200 (41.2 GiB; docs/scaling.md), how the step's peak splits between the
      activations and the loss being unmeasured."""
    if loss_kind not in LOSSES:
        raise ValueError(f"the plan needs the loss the run computes, one of {', '.join(LOSSES)}, not {loss_kind!r}")
    if loss_kind == "masked":
        return micro_batch * seq_len * config.vocab_size * ((a + 4) if compiled else 12)
    rows = min(micro_batch * seq_len, CHUNK)
    copy = rows * min(config.vocab_size, N_VOCAB) * 4 if loss_kind == "chunked" and a < 4 else 0
    return rows * config.vocab_size * a + copy + head_gradient_bytes(config)


def head_gradient_bytes(config):
    """The head's float32 weight gradient, which the chunked and fused losses compute in the forward pass
    and keep for the backward (its input's gradient takes the place of the input itself)."""
    return 4 * config.vocab_size * config.n_embd


def plan(config, micro_batch, seq_len, scale=ScaleConfig(), world_size=1, compute=Compute(), optimizer="adamw"):
    """The memory one GPU needs for a training step of a GPT of config, micro_batch sequences of seq_len
    a micro-step, with scale's levers (FSDP over world_size ranks, recompute), computing as compute
    says (the dtype, compiled or eager, the loss's kind), split as Plan's fields. ValueError for
    sizes whose total is past a float's range: no figure in GiB can be printed for them."""
    P, dtype_bytes = n_params(config), compute.dtype_bytes
    state = optimizer_bytes(config, optimizer)
    if scale.fsdp:
        # A rank's slice of everything, plus what is whole for a moment: the blocks gathered at once (this
        # one and the next, prefetched) and the root (embeddings), with their float32 gradients.
        root = (config.vocab_size + config.block_size) * config.n_embd + 2 * config.n_embd
        gathered = root + 2 * (P - root) // config.n_layer
        weights, gradients, state = (4 * P // world_size + dtype_bytes * gathered,
                                     4 * P // world_size + 4 * gathered, state // world_size)
    else:
        copies = dtype_bytes * P if dtype_bytes < 4 else 0  # autocast's low-precision copies of the weights
        weights, gradients = 4 * P + copies, 4 * P
    estimate = Plan(weights, gradients, state,
                    activation_bytes(config, micro_batch, seq_len, scale.recompute, scale.recompute_every, dtype_bytes),
                    logits_bytes(config, micro_batch, seq_len, compute.loss_kind, dtype_bytes, compute.compiled))
    if estimate.total > sys.float_info.max:
        raise ValueError(f"a GPT of these sizes needs more than {sys.float_info.max:.1e} bytes: too many to plan")
    return estimate


def fit_problem(config, device, world_size=1, fsdp=False):
    """Why a GPT of config cannot train on device, or None: its weights, gradients and AdamW state
    alone (16 bytes a parameter, over the ranks under FSDP) exceed the device's memory. Asked before
    allocating: a typo in a size would otherwise be an out-of-memory crash or hours of swapping."""
    try:
        estimate = plan(config, 1, 1, ScaleConfig(fsdp=fsdp), world_size, Compute(dtype_bytes=4))
    except ValueError as e:  # past a float's range: past any device too
        return str(e)
    need, have = estimate.weights + estimate.gradients + estimate.optimizer, device_memory(device)
    if need <= have:
        return None
    return (f"a GPT of {n_params(config):,} parameters needs {need / GiB:,.0f} GiB per rank for its weights, "
            f"gradients and AdamW state; {device} has {have / GiB:,.0f} GiB")


# Of a GPU's memory (its free memory, for -B auto), the most a plan may fill: the rest is for the
# allocator's fragmentation and, on a whole card, CUDA's context.
HEADROOM = 0.9
# Of a host's available memory, the most a CPU run's plan may fill: a CPU step's peak resident memory
# was measured up to 7% over its plan (docs/scaling.md), and the host's other processes grow too.
HOST_HEADROOM = 0.8


def headroom(device):
    """The share of device's memory (free on a GPU, available on the host) a plan may fill."""
    return HEADROOM if str(device).startswith("cuda") else HOST_HEADROOM


def size(n_bytes):
    """n_bytes for a message: GiB, or MiB below a tenth of one."""
    return f"{n_bytes / GiB:,.1f} GiB" if n_bytes >= GiB / 10 else f"{n_bytes / 2**20:.1f} MiB"


def described(memory_bytes, device):
    """memory_bytes of device, as -B auto reads it: a GPU's free memory, a host's available memory."""
    return f"{size(memory_bytes)} {'free' if str(device).startswith('cuda') else 'available'}"


def run_plan(cfg, micro_batch, world_size, compute, gpt_config=None, scale=None):
    """plan() of the run of cfg (a TrainConfig) at micro_batch sequences, computing as compute says,
    for a GPT of gpt_config (default: cfg.model) with scale (default: cfg.scale)."""
    return plan(gpt_config or cfg.model, micro_batch, cfg.batch.seq_len, scale or cfg.scale, world_size, compute,
                cfg.optimizer.name)


def fits(estimate, memory_bytes, device="cuda"):
    return estimate.total <= headroom(device) * memory_bytes


def pick_micro_batch(cfg, world_size, memory_bytes, compute, gpt_config=None, device="cuda"):
    """The largest of BatchConfig.auto_micro_batches whose plan fits in headroom(device) of
    memory_bytes of device, or None."""
    return next((micro_batch for micro_batch in cfg.batch.auto_micro_batches(world_size)
                 if fits(run_plan(cfg, micro_batch, world_size, compute, gpt_config), memory_bytes, device)), None)


def auto_micro_batch(cfg, world_size, memory_bytes, compute, gpt_config=None, device="cuda"):
    """-B auto's micro-batch on memory_bytes of device (a GPU's free memory, a host's available):
    pick_micro_batch's, or where memory_bytes is None (it cannot be read) the largest candidate.
    ValueError, one line of unfit_advice, where none fits."""
    if memory_bytes is None:
        return cfg.batch.auto_micro_batches(world_size)[0]
    picked = pick_micro_batch(cfg, world_size, memory_bytes, compute, gpt_config, device)
    if picked is None:
        raise ValueError(f"-B auto: {unfit_advice(cfg, world_size, memory_bytes, compute, gpt_config, device)}")
    return picked


def unfit_advice(cfg, world_size, memory_bytes, compute, gpt_config=None, device="cuda"):
    """One line: what the run of cfg plans at one sequence against memory_bytes of device (free on a
    GPU, available on a host), and what would fit: the plan of --recompute full, or on GPUs of --fsdp
    1 with it over enough of them; or that nothing does. Where the plan fits (the step ran out of
    memory all the same), it says so, naming --recompute full only if that plans a tenth less."""
    gpt_config, gpu = gpt_config or cfg.model, str(device).startswith("cuda")

    def need(scale, ranks):
        return run_plan(cfg, 1, ranks, compute, gpt_config, scale)

    def fit(scale, ranks=world_size):
        return fits(need(scale, ranks), memory_bytes, device)
    recompute = replace(cfg.scale, recompute="full")
    now, recomputed = need(cfg.scale, world_size).total, need(recompute, world_size).total
    line = (f"a GPT of {n_params(gpt_config):,} parameters plans {size(now)} per {'GPU' if gpu else 'process'} at "
            f"micro-batch 1, {'within' if fit(cfg.scale) else 'over'} {headroom(device):.0%} of "
            f"{described(memory_bytes, device)}")
    if fit(cfg.scale):  # out of memory all the same: what took the memory is not in the plan
        return (f"{line}, so memory the plan does not count ran out (another process's?): " +
                (f"--recompute full plans {size(recomputed)}" if recomputed <= 0.9 * now else
                 "no setting the plan knows lowers it by a tenth"))
    if fit(recompute):
        return f"{line}: --recompute full plans {size(recomputed)}"
    if not gpu:  # more processes on one host share its memory: no help
        return f"{line}, and so is --recompute full's {size(recomputed)}: nothing fits this host"
    sharded = replace(recompute, fsdp=1)
    gpus = next((n for n in (2**k for k in range(13)) if fit(sharded, n)), None)
    if gpus is None:
        return f"{line}, and over any number of GPUs up to {2**12} with --fsdp 1 --recompute full"
    return (f"{line}: --fsdp 1 --recompute full over {gpus} GPUs plans {size(need(sharded, gpus).total)} "
            f"each (torchrun --nproc_per_node={gpus})")


def out_of_memory_advice(cfg, world_size, trainable):
    """unfit_advice for the run of cfg, whose step on trainable (step.Trainable) ran out of
    memory at one sequence: against the device's memory as -B auto reads it, else its total."""
    device, gpt_config = trainable.device, trainable.raw_model.config
    return unfit_advice(cfg, world_size, free_memory(device, gpt_config) or device_memory(device),
                        Compute.of(trainable.step_config), gpt_config, device)


def free_memory(device, gpt_config=None):
    """Bytes that a training step may plan to fill on device: a CUDA device's free memory, with what
    this process holds there counted as free (the model, for a plan that counts it; the cache of a
    step that ran out of memory); on a CPU, the host's available memory, shared by the processes
    torchrun started on it, with the float32 weights of a GPT of gpt_config (built already) counted
    as free. None where it cannot be read: MPS, a failing driver, a host that does not say."""
    if str(device) == "cpu":
        available = available_memory()
        held = 4 * n_params(gpt_config) if gpt_config else 0
        return None if available is None else available // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) + held
    if not str(device).startswith("cuda"):
        return None
    try:
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    except RuntimeError:
        return None


def resolve_micro_batch(cfg, compute, gpt_config, device, world_size, log):
    """The micro-batch the run of cfg takes on device, computing as compute says: -B N's N, or -B
    auto's pick for a GPT of gpt_config (auto_micro_batch), the same on every rank (the smallest any
    rank picked), with a line saying so. RunError on every rank where the model does not fit at one
    sequence."""
    if cfg.batch.micro_batch_size != "auto":
        return cfg.batch.micro_batch_size
    free = free_memory(device, gpt_config)
    try:
        picked, error = auto_micro_batch(cfg, world_size, free, compute, gpt_config, device), None
    except ValueError as e:
        picked, error = None, str(e)
    agree(error)
    picked = min(every_rank(picked))
    if free is None:
        why = (f"the largest up to {AUTO_MAX_MICRO_BATCH} that divides the step: "
               + ("the GPU's free memory cannot be read" if device.startswith("cuda") else
                  "the host's available memory cannot be read" if device == "cpu" else
                  f"{device.split(':')[0]} memory is not planned"))
    else:
        why = f"plan {size(run_plan(cfg, picked, world_size, compute, gpt_config).total)} of {described(free, device)}"
    log(f"micro-batch auto: {picked} ({why})")
    return picked


def print_plan(cfg):
    """train_gpt2.py --plan: the memory per device that plan() estimates for the run of cfg (a
    TrainConfig), on the device and in the dtype it would take (a GPU this machine lacks, or one of
    --gpu_memory GiB: bfloat16), compiled where the run would be; under -B auto, at the micro-batch
    it would pick on that GPU (--gpu_memory's, else this machine's)."""
    world_size = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", 1))
    device_type = "cuda" if cfg.gpu_memory else auto_device_type() if cfg.runtime.device == "auto" else \
        cfg.runtime.device.split(":")[0]
    elsewhere = device_type == "cuda" and bool(cfg.gpu_memory or not torch.cuda.is_available())  # a GPU this machine lacks
    if elsewhere and cfg.runtime.dtype == "auto":
        dtype = torch.bfloat16  # an Ampere or later
    else:
        dtype = pick_dtype(cfg.runtime.dtype, device_type)
    compiled = resolve_compile(cfg.runtime.compile, device_type, log=lambda message: None)
    where = "cuda" if cfg.gpu_memory else device_type  # whose memory -B auto fits: a GPU's free, a host's available
    card = cfg.gpu_memory * GiB if cfg.gpu_memory else None if device_type == "cuda" and not \
        torch.cuda.is_available() else free_memory(device_type)
    try:
        # On a GPU this machine lacks, with Triton: torch's CUDA builds bring it.
        compute = Compute(dtype.itemsize, compiled, pick_loss(cfg.runtime.loss_kind, device_type, elsewhere or None))
        if cfg.world_size_problem(world_size):
            raise ValueError(cfg.world_size_problem(world_size))
        micro_batch, choice = cfg.batch.micro_batch_size, None
        if micro_batch == "auto":
            micro_batch = auto_micro_batch(cfg, world_size, card, compute, device=where)
            choice = (f"-B auto: {micro_batch} on {size(card) if cfg.gpu_memory else described(card, where)}" if card
                      else f"-B auto: {micro_batch}, the largest up to {AUTO_MAX_MICRO_BATCH} that divides the step "
                           f"(no {'GPU' if device_type == 'cuda' else device_type} memory to fit it in: --gpu_memory GIB "
                           f"plans for a card)")
        estimate = run_plan(cfg, micro_batch, world_size, compute)
    except ValueError as e:
        sys.exit(f"error: {e}")
    precision = "float32, no autocast" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} autocast"
    scale = cfg.scale
    print(f"{n_params(cfg.model):,} parameters; {world_size} x {device_type} under "
          f"{'FSDP' if scale.fsdp else 'DDP'}, recompute {scale.recompute} (every {scale.recompute_every}), {precision}, "
          f"{'compiled' if compiled else 'eager'}, micro-batch {micro_batch}x{cfg.batch.seq_len}, {compute.loss_kind} "
          f"loss, optimizer {cfg.optimizer.name}; "
          f"per {'GPU' if device_type == 'cuda' else 'device'}:")
    print(estimate.table())
    if choice:
        print(choice)
    elif cfg.gpu_memory:
        print(f"-B {micro_batch} {'fits' if fits(estimate, card) else 'does not fit'} in {HEADROOM:.0%} of "
              f"{cfg.gpu_memory:g} GiB" + ("" if fits(estimate, card) else ": try -B auto"))


def largest_micro_batch(config, gib, scale, loss_kind, world_size=1):
    """The largest micro-batch of 1024 positions whose plan, compiled in bfloat16 with the loss of
    loss_kind, fits a GPU of gib GiB (fits), or 0."""
    compute, micro_batch = Compute(2, True, loss_kind), 0
    while micro_batch < 512 and fits(plan(config, micro_batch + 1, 1024, scale, world_size, compute), gib * GiB):
        micro_batch += 1
    return micro_batch


def preset_model(name):
    """(GPTConfig, loss kind) of the preset configs/NAME.toml: its model flags over the trainer's
    defaults, GPT-2 (124M) at the padded vocabulary, and the loss's kind on a GPU."""
    values = read_config(preset_path(name))
    fields = {key: values[key] for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout")
              if key in values}
    return GPTConfig(**{"vocab_size": PADDED_VOCAB, **fields}), pick_loss(values.get("loss", "auto"), "cuda", True)


def presets_table(gpus=(24, 40, 80), world_size=8):
    """Markdown: for each preset, what -B auto picks on one GPU, and the largest micro-batch per GPU
    under DDP and FSDP, without and with full recompute, compiled in bfloat16, with the preset's
    loss on a GPU (fused, --loss auto's there) and total batch."""
    ways = [("DDP", dict(), 1), ("DDP, recompute full", dict(recompute="full"), 1),
            (f"FSDP ×{world_size}", dict(fsdp=True), world_size),
            (f"FSDP ×{world_size}, recompute full", dict(fsdp=True, recompute="full"), world_size)]
    lines = ["| model | params | GPU | `-B auto` | " + " | ".join(name for name, _, _ in ways) + " |",
             "|---" * (4 + len(ways)) + "|"]
    presets = {name: preset_model(name) for name in preset_names() if name != "demo"}
    for name, (config, loss_kind) in sorted(presets.items(), key=lambda item: (n_params(item[1][0]), item[0])):
        total = read_config(preset_path(name)).get("total_batch_size", BatchConfig().total_batch_size)
        run = TrainConfig(model=config, batch=BatchConfig(total))
        for gib in gpus:
            micro_batches = [pick_micro_batch(run, 1, gib * GiB, Compute(2, True, loss_kind)) or "—"]
            micro_batches += [largest_micro_batch(config, gib, ScaleConfig(**levers), loss_kind, ranks) or "—"
                              for _, levers, ranks in ways]
            lines.append(f"| {name} | {n_params(config) / 1e6:,.0f}M | {gib} GB | " + " | ".join(map(str, micro_batches)) + " |")
    return "\n".join(lines)


def main(argv=None):
    """python -m gpt2repro.training.memory: the presets' memory table of docs/scaling.md; it takes no arguments (a
    model's own plan is train_gpt2.py --plan's)."""
    Parser(prog="gpt2repro.training.memory", description=main.__doc__).parse_args(argv)
    print(presets_table())


if __name__ == "__main__":
    main()
