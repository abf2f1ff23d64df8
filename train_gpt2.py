"""Train GPT-2 on token shards, on one process or many.

    python train_gpt2.py --preset demo                        # a small GPT on Tiny Shakespeare, CPU is fine
    python train_gpt2.py                                      # GPT-2 (124M) on FineWeb-Edu 10B, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py    # the same on 8 GPUs

The defaults are the GPT-2 (124M) reproduction: 524,288-token batches, AdamW at 6e-4
with 715 warmup steps and cosine decay to 10% at step 19,073 (one pass over 10B tokens).
"""
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import devices
import distributed
import hellaswag
import logdir
import memory
import sharding
from checkpoint import CheckpointError, Checkpointer, list_checkpoints
from cli import Parser, gpt2_vocab_problem, preset_names, preset_path, read_config
from data import TINY_SHAKESPEARE, ShardError, ShardLoader, list_shards
from devices import autocast, peak_flops, pick_dtype, synchronize
from distributed import RunError, every_rank, on_every_rank
from faults import Faults, parse_fault
from loading import load_model
from logdir import MetricsLog
from model import GPT, RECOMPUTE
from muon import MUON_LR, MUON_MOMENTUM, MUON_WEIGHT_DECAY, OPTIMIZERS, OptimizerConfig, build_optimizer
from tokenizer import PADDED_VOCAB, get_encoding
from train_config import TrainConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY_PATHS = ("data_dir", "hellaswag_path")  # in a preset, relative to the repository: its bundled files
SAMPLE_PROMPT = "Hello, I'm a language model,"


def build_parser(add_help=True):
    p = Parser(description=__doc__, add_help=add_help)
    add_run_and_model_flags(p.add_argument)
    add_optimization_flags(p.add_argument)
    add_evaluation_flags(p.add_argument)
    add_checkpoint_and_scale_flags(p.add_argument)
    add_runtime_flags(p.add_argument)
    testing = p.add_argument_group("testing", "faults injected on purpose, to test that runs survive them")
    testing.add_argument("--fault", action="append", type=parse_fault, default=None, metavar="KIND@STEP[:RANK]",
                         help="nan (poison the loss), sigterm or sigkill (signal itself) at STEP, on RANK or all")
    return p


def add_run_and_model_flags(a):
    """What to train on, where its files go, and the model."""
    presets = preset_names()  # only the one named is read
    a("--preset", default="gpt2", choices=presets, metavar="NAME",
      help=f"a named recipe, configs/NAME.toml, whose values become the defaults: {', '.join(presets)}")
    a("--config", metavar="FILE", default=None,
      help="a TOML file of the same form as a preset's (keys: the flags' long names without dashes), read after "
           "the preset; flags given on the command line override both")
    a("--data_dir", default="edu_fineweb10B", help="directory of *_train_*.npy and *_val_*.npy shards")
    a("--log_dir", default="log", help="log.jsonl and checkpoints go here")
    a("--init_from", default="scratch",
      help="scratch (random init), or the weights of gpt2 ... gpt2-xl, a Hugging Face GPT-2 directory or a checkpoint "
           "(weights only: a fresh optimizer at step 0); their architecture overrides the model flags")
    a("--n_layer", type=int, default=12, help="transformer blocks")
    a("--n_head", type=int, default=12, help="attention heads per block")
    a("--n_embd", type=int, default=768, help="width of the residual stream")
    a("--block_size", type=int, default=1024, help="context length of the model")
    a("--vocab_size", type=int, default=PADDED_VOCAB, help="embedding rows: GPT-2's 50257 padded to a multiple of 128")


def add_optimization_flags(a):
    """The batch, the schedule and the optimizer: build-nanogpt's recipe by default."""
    a("--total_batch_size", type=int, default=524288, help="tokens per optimizer step, over all ranks")
    a("-B", "--micro_batch_size", type=int, default=64, help="sequences per forward pass per rank")
    a("-T", "--seq_len", type=int, default=1024, help="tokens per sequence")
    a("--max_steps", type=int, default=19073,
      help="optimizer steps in the run (0: train nothing, evaluate the starting point and exit)")
    a("--warmup_steps", type=int, default=715, help="steps of linear lr warmup")
    a("--decay_steps", type=int, default=None, help="step at which the cosine reaches min lr (default: max_steps)")
    a("--max_lr", type=float, default=6e-4, help="peak learning rate, reached after warmup")
    a("--min_lr_ratio", type=float, default=0.1, help="min lr as a fraction of max lr")
    a("--weight_decay", type=float, default=0.1, help="AdamW weight decay of matrices and embeddings")
    a("--optimizer", default="adamw", choices=OPTIMIZERS,
      help="adamw: AdamW for every parameter (the recipe); muon: torch.optim.Muon for the blocks' four matrices "
           "(qkv, attention projection, MLP in and out), AdamW as in the recipe for the rest")
    a("--muon_lr", type=float, default=MUON_LR, help="Muon's peak lr; the schedule scales it as it scales --max_lr")
    a("--muon_momentum", type=float, default=MUON_MOMENTUM, help="Muon's (Nesterov) momentum")
    a("--muon_weight_decay", type=float, default=MUON_WEIGHT_DECAY,
      help="Muon's decoupled weight decay (times its lr, as AdamW's)")
    a("--grad_clip", type=float, default=1.0, help="max global grad norm (0: no clipping)")


def add_evaluation_flags(a):
    """Val loss, HellaSwag and samples during the run."""
    a("--eval_interval", type=int, default=250, help="val loss and HellaSwag every N steps and at the end (0: never)")
    a("--val_steps", type=int, default=20, help="micro-batches per val loss")
    a("--hellaswag", type=int, default=1, choices=[0, 1], help="HellaSwag acc_norm at every eval")
    a("--hellaswag_path", default=None, help="local HellaSwag jsonl (default: download the val split once)")
    a("--hellaswag_limit", type=int, default=0, help="score only the first N examples (0: all)")
    a("--sample_interval", type=int, default=250, help="print samples every N steps and at the end (0: never)")


def add_checkpoint_and_scale_flags(a):
    """Checkpoints and resume; FSDP, recompute and the memory plan."""
    a("--checkpoint_interval", type=int, default=5000, help="checkpoint every N steps and at the end (0: only at the end)")
    a("--keep_last", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    a("--fsdp", type=int, default=0, choices=[0, 1],
      help="shard parameters, gradients and AdamW's state over the ranks (FSDP2), for models that do not fit "
           "under DDP; checkpoints are then sharded directories")
    a("--recompute", default="none", choices=RECOMPUTE,
      help="recompute in the backward pass instead of keeping activations: the whole block, its attention "
           "sublayer, or only SDPA's core (less memory, more compute)")
    a("--recompute_every", type=int, default=1, help="recompute in every Nth block only (1: all)")
    a("--chunked_loss", type=int, default=0, choices=[0, 1],
      help="compute the loss and its gradients over chunks of positions, never a (B*T, vocab) float32 tensor: "
           "less memory (on in the presets larger than gpt2-medium)")
    a("--plan", action="store_true",
      help="print the estimated memory per GPU (or device) of this run, on the device and in the dtype it would "
           "take, then exit: no data, device or log_dir is touched")
    a("--plan_world_size", type=int, default=None, help="the ranks --plan assumes (default: torchrun's, else 1)")
    a("--async_checkpoint", action="store_true",
      help="with --fsdp 1, write checkpoints in the background while training goes on")
    a("--resume", default="auto", help="auto: newest checkpoint in log_dir, if any; none: start over; or a checkpoint path")


def add_runtime_flags(a):
    """Device, precision, compile, seeds, data checks and logging."""
    a("--device", default="auto",
      help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:K (one process only: under torchrun each takes cuda:LOCAL_RANK), mps")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
      help="autocast dtype; auto: bfloat16 on CUDA from Ampere on, float16 with loss scaling before, else float32")
    a("--compile", default="auto", choices=["auto", "1", "0"], help="torch.compile the model; auto: on for CUDA")
    a("--compile_mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
      help="torch.compile's mode: max-autotune tries more kernels, minutes longer to compile")
    a("--attention", default="auto", choices=["auto", "cudnn", "math"],
      help="SDPA's kernel: auto (torch's choice: flash attention on recent GPUs), cuDNN's, or the math reference")
    a("--seed", type=int, default=1337, help="seeds the init, the data order and the samples")
    a("--shuffle", type=int, default=1, choices=[0, 1],
      help="from the second epoch on, permute the shards and the windows within them (the first is in file order)")
    a("--check_data", default="quick", choices=["quick", "full"],
      help="before training, check every shard's header and token ids: quick samples the ids, full reads them all")
    a("--max_bad_steps", type=int, default=5, help="stop after this many non-finite steps in a row")
    a("--wandb", action="store_true", help="also log to Weights & Biases (needs wandb)")
    a("--wandb_project", default="gpt2-reproduction", help="the wandb project of --wandb")
    a("--tensorboard", action="store_true", help="also log to TensorBoard, in log_dir/tensorboard (needs tensorboard)")


def parse_args(argv=None):
    """The run's TrainConfig, from the flags, over --config's values, over the preset's."""
    # A preset's and a config's values become defaults, so flags given on the command line still
    # win, and --help shows them. They are named first, to a parser that leaves --help for later.
    named = build_parser(add_help=False).parse_known_args(argv)[0]
    parser = build_parser()
    preset = parser.config_defaults(preset_path(named.preset), not_keys=("preset", "config"))
    for key in REPOSITORY_PATHS:
        if key in preset:
            preset[key] = os.path.join(HERE, preset[key])
    parser.set_defaults(**preset)
    if named.config is not None:
        parser.set_defaults(**parser.config_defaults(named.config, not_keys=("preset", "config")))
    args = parser.parse_args(argv)
    for action in parser._actions:  # from a flag or a file: inf would train on, to fail only at the end
        if action.type is float and not math.isfinite(getattr(args, action.dest)):
            parser.error(f"--{action.dest} must be a finite number, not {getattr(args, action.dest)}")
    if args.plan_world_size is not None and args.plan_world_size < 1:  # 0 would read as torchrun's, or 1
        parser.error(f"--plan_world_size must be positive, not {args.plan_world_size}")
    try:
        return TrainConfig.from_flags(vars(args))
    except ValueError as e:  # model sizes no GPT can have: GPTConfig's own check
        parser.error(f"--{e}")


def check_config(cfg, world_size):
    """Raises RunError for any combination that cannot train, before anything is built."""
    def need(ok, message):
        if not ok:
            raise RunError(message)
    flags = cfg.flags()
    for name in ("micro_batch_size", "seq_len", "total_batch_size", "val_steps", "max_bad_steps"):
        need(flags[name] > 0, f"--{name} must be positive, not {flags[name]}")
    for name in ("max_steps", "warmup_steps", "eval_interval", "sample_interval", "checkpoint_interval", "keep_last",
                 "hellaswag_limit", "grad_clip", "weight_decay"):
        need(flags[name] >= 0, f"--{name} must not be negative, not {flags[name]}")
    schedule, optimizer, batch = cfg.schedule, cfg.optimizer, cfg.batch
    need(schedule.max_steps or cfg.eval.eval_interval, "--max_steps 0 only evaluates: it needs --eval_interval above 0")
    need(schedule.max_lr > 0 and 0 <= schedule.min_lr_ratio <= 1, "--max_lr must be positive and --min_lr_ratio in [0, 1]")
    if optimizer.name == "muon":
        need(optimizer.muon_lr > 0 and 0 <= optimizer.muon_momentum < 1 and optimizer.muon_weight_decay >= 0,
             "--muon_lr must be positive, --muon_momentum in [0, 1) and --muon_weight_decay not negative")
    need(0 <= cfg.runtime.seed < 2**32, f"--seed must be in [0, 2**32), numpy's range, not {cfg.runtime.seed}")
    need(cfg.scale.recompute_every > 0, f"--recompute_every must be positive, not {cfg.scale.recompute_every}")
    need(batch.seq_len <= cfg.model.block_size,
         f"--seq_len {batch.seq_len} is longer than --block_size {cfg.model.block_size}")
    tokens_per_pass = batch.tokens_per_pass(world_size)
    if batch.total_batch_size % tokens_per_pass:
        # Rounded as a fraction, not a float: a float overflows at absurd sizes.
        suggestion = max(1, round(Fraction(batch.total_batch_size, tokens_per_pass))) * tokens_per_pass
        raise RunError(f"--total_batch_size {batch.total_batch_size} is not a multiple of B*T*world_size = "
                       f"{batch.micro_batch_size}*{batch.seq_len}*{world_size} = {tokens_per_pass}; "
                       f"try --total_batch_size {suggestion} or another -B")


# ----------------------------------------------------------------------------- the step

@dataclass(frozen=True)
class StepConfig:
    """How build_trainable builds a Trainable and how its steps run, settled for one device."""
    dtype: torch.dtype  # autocast's; float32 is none
    grad_accum_steps: int
    optimizer: OptimizerConfig = OptimizerConfig()  # the recipe's AdamW
    grad_clip: float = 1.0  # 0: no clipping
    compile_mode: str | None = None  # None: eager
    fsdp: bool = False
    chunked_loss: bool = False  # the loss by model.LinearCrossEntropy: no whole logits tensor


@dataclass
class Trainable:
    """What a training step works on, built once by build_trainable (bench.py times the same)."""
    model: torch.nn.Module  # what the forward runs through: the GPT, DDP-wrapped and/or compiled
    raw_model: GPT  # the plain GPT underneath, sharing the weights: checkpoints, HellaSwag, samples
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a no-op in other dtypes
    device: str
    config: StepConfig  # what it was built with: the dtype, accumulation, clipping and loss its steps use

    def forward_context(self):
        """Autocast, for one forward pass (and the backward it records)."""
        return autocast(self.device.split(":")[0], self.config.dtype)


ATTENTION_KERNELS = {"auto": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}


@dataclass
class StepResult:
    loss: float  # the mean over micro-steps and ranks
    grad_norm: float  # before clipping
    lr: float
    skipped: bool  # a non-finite loss or gradient: the weights did not change
    muon_lr: float = None  # Muon's, under --optimizer muon: lr times its group's lr_scale


def train_step(trainable, loader, lr, stop_requested=lambda: False):
    """One optimizer step: grad_accum_steps forward-backward passes, all-reduced (under DDP) only on
    the last; then the ranks agree on the loss, the gradients are unscaled and clipped, and the
    optimizer steps at lr, unless the loss or gradient is not finite. Returns once the device has
    finished, so the caller's clock times the whole step. Returns None, the weights and optimizer
    untouched and the loader back at the step's start, if stop_requested() is true before a
    micro-step: a stop never waits for a long step (torchrun SIGKILLs 30 s after a SIGTERM)."""
    ddp = isinstance(getattr(trainable.model, "_orig_mod", trainable.model), DDP)
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay
    # so. Set to None, each step would allocate a second set and copy it into the buckets.
    trainable.optimizer.zero_grad(set_to_none=not ddp)
    loss_sum = torch.zeros((), device=trainable.device)
    start = loader.state_dict()
    for micro_step in range(trainable.config.grad_accum_steps):
        if stop_requested():
            loader.load_state_dict(start)
            return None
        x, y = (to_device(b, trainable.device) for b in loader.next_batch())
        last = micro_step == trainable.config.grad_accum_steps - 1
        with trainable.model.no_sync() if ddp and not last else nullcontext(), trainable.forward_context():
            # [1]: no logits kept into the next micro-step
            loss = trainable.model(x, y, chunked_loss=trainable.config.chunked_loss)[1]
        loss = loss / trainable.config.grad_accum_steps  # a sum of micro-batch means would be grad_accum_steps too big
        loss_sum += loss.detach()
        trainable.scaler.scale(loss).backward()
    # One all-reduce and one wait for the device: every rank gets the same loss (non-finite if any
    # rank's was) and norm (of gradients already all-reduced), so all decide alike.
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    trainable.scaler.unscale_(trainable.optimizer)
    norm = clip_grad_norm(trainable.raw_model.parameters(), trainable.config.grad_clip)
    loss_sum, norm = torch.stack([loss_sum, norm]).tolist()
    loss = loss_sum / distributed.world_size()
    # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that step itself.
    skipped = not (math.isfinite(loss) and (math.isfinite(norm) or trainable.scaler.is_enabled()))
    muon_lr = None
    if not skipped:
        for group in trainable.optimizer.param_groups:
            # AdamW's groups at lr itself; Muon's (--optimizer muon) at lr times its peak over --max_lr.
            group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr
            muon_lr = group["lr"] if "lr_scale" in group else muon_lr
        trainable.scaler.step(trainable.optimizer)
    trainable.scaler.update()  # after every unscale_, or the next step's unscale_ raises
    synchronize(trainable.device)
    return StepResult(loss, norm, lr, skipped, muon_lr)


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


def to_device(batch, device):
    # From pinned host memory the copy runs asynchronously, overlapping the GPU's work.
    return batch.pin_memory().to(device, non_blocking=True) if device.startswith("cuda") else batch.to(device)


def build_trainable(raw_model, device, config, init=None):
    """The Trainable of a GPT, as config (a StepConfig) says: on device, DDP-wrapped across ranks,
    then compiled in config.compile_mode; compiling the DDP wrapper, not the model inside it, lets
    dynamo cut the graph at DDP's buckets, so the all-reduce of one bucket overlaps the backward of
    the rest. Or, with config.fsdp, sharded over the ranks (see sharding.py), and built on the meta
    device when init is its recorded initialisation. Then config.optimizer over the parameters or
    their FSDP slices (muon.build_optimizer). How the model runs (recompute, attention) is its
    own: see model_options."""
    dtype = config.dtype
    if config.fsdp:
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
    scaler = (ShardedGradScaler if config.fsdp else torch.amp.GradScaler)(device.split(":")[0],
                                                                         enabled=dtype == torch.float16)
    return Trainable(model, raw_model, optimizer, scaler, device, config)


# ----------------------------------------------------------------------------- the run

def train(cfg):
    t_start = time.perf_counter()
    run = setup(cfg)
    cfg, trainable, log = run.cfg, run.trainable, run.log
    faults = Faults(cfg.runtime.fault, run.rank, trainable.raw_model)
    bad_steps = 0  # non-finite steps in a row
    val_loss = None
    with distributed.StopSignal() as stop:
        step = run.start_step
        while True:
            last_step = step >= cfg.schedule.max_steps
            if run.checkpointer.due(step, run.start_step, last_step):
                run.checkpointer.save(step, trainable, run.train_loader, cfg.flags())
            if cfg.eval.eval_interval and (step % cfg.eval.eval_interval == 0 or last_step):
                val_loss = evaluate(run, step)
            if cfg.eval.sample_interval and (step % cfg.eval.sample_interval == 0 or last_step) and step > 0:
                write_samples(run, step)
            if last_step:
                break

            faults.before_step(step)
            t0 = time.perf_counter()
            result = train_step(trainable, run.train_loader, cfg.schedule.lr(step), stop.requested)
            if result is None:
                run.checkpointer.save(step, trainable, run.train_loader, cfg.flags())
                log(f"stopping on a signal at step {step}, its partial work dropped; `--resume auto` continues here")
                break
            bad_steps = bad_steps + 1 if result.skipped else 0
            log_step(run, step, result, time.perf_counter() - t0, bad_steps)
            if bad_steps >= cfg.runtime.max_bad_steps:
                raise RunError(f"{bad_steps} steps in a row had a non-finite loss or gradient (last: step {step}); "
                               f"the newest checkpoint in {cfg.log_dir} predates them: lower --max_lr or check the data")
            step += 1
    run.checkpointer.wait()
    if dist.is_initialized():
        # The ranks leave together, once rank 0 has written the last checkpoint: no rank reports
        # the run finished while the checkpoint it would resume from is still being written.
        dist.barrier()
    if run.log_dir_lock:
        run.log_dir_lock.close()
    newest = list_checkpoints(cfg.log_dir)[-1:] if run.rank == 0 else []
    log(f"done: step {step} of {cfg.schedule.max_steps}, {step * cfg.batch.total_batch_size:,} tokens, "
        f"{tqdm.format_interval(time.perf_counter() - t_start)} wall time, final val loss "
        f"{'none' if val_loss is None else f'{val_loss:.4f}'}, last checkpoint {newest[0] if newest else 'none'}")
    return trainable.raw_model


def log_step(run, step, result, seconds, bad_steps):
    tokens = step * run.cfg.batch.total_batch_size
    if result.skipped:
        run.log(f"step {step:5d} | skipped: non-finite loss {result.loss} or grad norm {result.grad_norm} "
                f"({bad_steps} in a row)")
        run.metrics.write(step=step, tokens=tokens, skipped_step=True, bad_steps=bad_steps)
        return
    tokens_per_sec = run.cfg.batch.total_batch_size / seconds
    mfu = f" | mfu {100 * run.flops_per_step / seconds / run.peak_flops:.1f}%" if run.peak_flops else ""
    mem = f" | mem {torch.cuda.max_memory_allocated(run.device) / 2**30:.1f}GiB" if run.device.startswith("cuda") else ""
    muon = {} if result.muon_lr is None else {"muon_lr": result.muon_lr}
    run.log(f"step {step:5d} | loss {result.loss:.6f} | lr {result.lr:.4e}"
            + ("" if result.muon_lr is None else f" | muon lr {result.muon_lr:.4e}")
            + f" | norm {result.grad_norm:.4f} | dt {1000 * seconds:.2f}ms | tok/s {tokens_per_sec:.0f}{mfu}{mem}")
    run.metrics.write(step=step, tokens=tokens, train_loss=result.loss, lr=result.lr, **muon,
                      grad_norm=result.grad_norm, dt_ms=1000 * seconds, tokens_per_sec=tokens_per_sec)


def evaluate(run, step):
    """Val loss and HellaSwag, on every rank, logged by rank 0; returns the val loss, None without val shards."""
    tokens = step * run.cfg.batch.total_batch_size
    val_loss = None
    if run.val_loader is not None:
        val_loss = estimate_val_loss(run.trainable, run.val_loader, run.cfg.eval.val_steps)
        run.log(f"step {step:5d} | val loss {val_loss:.4f}")
        run.metrics.write(step=step, tokens=tokens, val_loss=val_loss)
    if run.hellaswag_examples:
        acc, acc_norm, n = hellaswag_accuracy(run.trainable, run.hellaswag_examples, run.rank, run.world_size)
        run.log(f"step {step:5d} | hellaswag acc_norm {acc_norm:.4f} ({n} examples)")
        run.metrics.write(step=step, tokens=tokens, hellaswag_acc_norm=acc_norm, hellaswag_acc=acc, hellaswag_n=n)
    return val_loss


def write_samples(run, step):
    """Samples, logged by rank 0. Under FSDP every forward gathers weights from every rank: all
    ranks sample alike (the same seed), and rank 0 logs."""
    if run.rank == 0 or run.cfg.scale.fsdp:
        texts = sample_texts(run.trainable, seed=run.cfg.runtime.seed + step)
        run.log("\n".join(f"sample {i}: {text}" for i, text in enumerate(texts)))
        run.metrics.write(step=step, tokens=step * run.cfg.batch.total_batch_size, samples=texts)


# ----------------------------------------------------------------------------- setup

@dataclass
class Run:
    """Everything setup() builds for the loop."""
    cfg: TrainConfig  # as setup settled it (settle_evaluation)
    rank: int
    world_size: int
    device: str
    log: object  # print on rank 0, nothing elsewhere
    trainable: Trainable
    train_loader: ShardLoader
    val_loader: ShardLoader  # None without val shards
    hellaswag_examples: list  # None when not scored
    start_step: int
    metrics: MetricsLog
    checkpointer: Checkpointer
    flops_per_step: float
    peak_flops: float  # None where unknown: no MFU
    log_dir_lock: object  # on rank 0, the open file whose lock keeps other runs out of log_dir


def setup(cfg):
    """Processes, log_dir, data, model and optimizer, and the state to resume from, in that order."""
    rank, local_rank, world_size, device = distributed.init(cfg.runtime.device)
    log = print_on_rank_0(rank)
    check_config(cfg, world_size)
    if cfg.init_from == "scratch":
        on_every_rank(check_fits, cfg, device, world_size)
    batch = cfg.batch
    log(f"world size {world_size}, device {device}, {batch.grad_accum_steps(world_size)} micro-steps of "
        f"{batch.micro_batch_size}x{batch.seq_len} tokens per step of {batch.total_batch_size}")
    torch.manual_seed(cfg.runtime.seed)
    devices.allow_tf32()
    log_dir_lock, mirrors = prepare_log_dir(cfg, rank, log)
    raw_model, init = build_model(cfg, device, log)
    if batch.seq_len > raw_model.config.block_size:
        raise RunError(f"--seq_len {batch.seq_len} is longer than the model's block_size {raw_model.config.block_size}")
    on_every_rank(ensure_demo_shards, cfg, rank, log)
    train_loader, val_loader = build_loaders(cfg, rank, world_size, raw_model.config.vocab_size)
    cfg = settle_evaluation(cfg, val_loader, raw_model.config.vocab_size, log)
    hellaswag_examples = load_hellaswag(cfg, local_rank, raw_model.config, log)
    trainable = build_trainable(raw_model, device, step_config(cfg, device, world_size, log), init=init)
    if cfg.optimizer.name == "muon":
        log_muon(cfg.optimizer, trainable.optimizer, log)
    saving = cfg.checkpoints
    checkpointer = Checkpointer(cfg.log_dir, saving.checkpoint_interval, saving.keep_last, sharded=bool(cfg.scale.fsdp),
                                async_save=saving.async_checkpoint, log=log)
    start_step = checkpointer.restore(saving.resume, trainable, train_loader, cfg.schedule.max_steps)
    # Records past the starting step are of steps about to be trained again; an evaluation trains none.
    keep_before = None if start_step >= cfg.schedule.max_steps else start_step
    metrics = on_every_rank(MetricsLog, cfg.log_dir, keep_before, rank == 0, mirrors)
    peak = peak_flops(device)
    return Run(cfg, rank, world_size, device, log, trainable, train_loader, val_loader, hellaswag_examples, start_step,
               metrics, checkpointer, raw_model.flops_per_token(batch.seq_len) * batch.total_batch_size,
               peak * world_size if peak else None, log_dir_lock)


def step_config(cfg, device, world_size, log):
    """The run's StepConfig on device: its flags' dtype and compile settled for it."""
    device_type = device.split(":")[0]
    compile_mode = cfg.runtime.compile_mode if resolve_compile(cfg.runtime.compile, device_type, log) else None
    return StepConfig(pick_dtype(cfg.runtime.dtype, device_type), cfg.batch.grad_accum_steps(world_size),
                      cfg.optimizer, cfg.grad_clip, compile_mode, fsdp=bool(cfg.scale.fsdp),
                      chunked_loss=bool(cfg.scale.chunked_loss))


def log_muon(config, optimizer, log):
    matrices = [p for group in optimizer.muon.param_groups for p in group["params"]]
    log(f"optimizer: Muon (peak lr {config.muon_lr}, momentum {config.muon_momentum}, weight decay "
        f"{config.muon_weight_decay}) on {len(matrices)} matrices ({sum(p.numel() for p in matrices):,} parameters), "
        f"AdamW (peak lr {config.lr}) on the rest")


def print_on_rank_0(rank):
    def log(message):
        if rank == 0:
            print(message, flush=True)
    return log


def prepare_log_dir(cfg, rank, log):
    """Makes and claims log_dir, tidies it, and checks the flags that decide what goes in it;
    returns (the lock rank 0 holds, the log mirrors)."""
    on_every_rank(logdir.make_log_dir, cfg.log_dir)
    log_dir_lock = on_every_rank(logdir.claim_log_dir, cfg.log_dir, rank == 0)
    on_every_rank(logdir.tidy_log_dir, cfg.log_dir, cfg.checkpoints.resume, log, rank == 0)
    mirrors = on_every_rank(logdir.log_mirrors, cfg, rank == 0)
    if cfg.scale.fsdp and not dist.is_initialized():
        raise RunError("--fsdp 1 shards over the ranks of torchrun: torchrun --nproc_per_node=N train_gpt2.py ...")
    if cfg.checkpoints.async_checkpoint and not cfg.scale.fsdp:
        raise RunError("--async_checkpoint writes sharded checkpoints: it needs --fsdp 1")
    return log_dir_lock, mirrors


def resolve_compile(flag, device_type, log):
    if flag != "auto":
        return flag == "1"
    if device_type == "cuda" and sys.platform != "win32":
        return True
    if device_type == "mps" or sys.platform == "win32":
        log(f"note: --compile auto stays off on {'Windows' if sys.platform == 'win32' else 'MPS'}")
    return False


def check_fits(cfg, device, world_size):
    """Refuses, before allocating, a model the device cannot hold (memory.fit_problem)."""
    problem = memory.fit_problem(cfg.model, device, world_size, bool(cfg.scale.fsdp))
    if problem:
        raise RunError(f"{problem} (see --plan)")


def build_model(cfg, device, log):
    """(model, init): a GPT of the model flags, randomly initialised, or the weights of anything
    load_model takes (OpenAI's GPT-2, a Hugging Face directory, a checkpoint), whose architecture
    then wins, on device. Under FSDP a random one is built on the meta device instead, to be
    materialized one parameter at a time from init, its recorded initialisation (see sharding.py)."""
    options = model_options(cfg)
    if cfg.init_from == "scratch":
        if cfg.scale.fsdp:
            return sharding.build_on_meta(cfg.model, **options)
        return GPT(cfg.model, **options).to(device), None
    log(f"initialising from {cfg.init_from}")
    try:
        return load_model(cfg.init_from, **options).to(device), None
    except CheckpointError as e:
        raise RunError(f"--init_from: {e}") from None


def ensure_demo_shards(cfg, rank, log):
    """The demo trains on Tiny Shakespeare, sharded with fineweb.py's code into the preset's own
    data_dir on first use (and completed, should that first sharding have been interrupted). Any
    other --data_dir is the user's: a missing one is build_loaders' error, not a new folder."""
    if cfg.preset != "demo":
        return
    own = os.path.join(HERE, read_config(preset_path("demo"))["data_dir"])
    if os.path.realpath(cfg.data_dir) != os.path.realpath(own):
        return
    if rank == 0:
        import fineweb
        try:
            demo = fineweb.ShardingJob(cfg.data_dir, prefix="shakespeare", shard_size=32768, num_proc=1)
            summary = fineweb.shard_local_files([TINY_SHAKESPEARE], demo)
        except (fineweb.InputError, OSError) as e:  # OSError: a shard that cannot be written
            raise RunError(str(e)) from None
        if summary["status"] != "already complete":
            log(f"sharded {TINY_SHAKESPEARE} into {summary['shards']} shards in {cfg.data_dir}")


def build_loaders(cfg, rank, world_size, vocab_size):
    """(train, val) loaders of data_dir's shards, every shard checked; val is None without val shards."""
    train_paths, val_paths = list_shards(cfg.data_dir, "train"), list_shards(cfg.data_dir, "val")
    if not train_paths:
        raise RunError(f"no *_train_*.npy shards in {cfg.data_dir!r}: make them with "
                       f"`python fineweb.py --output_dir {cfg.data_dir}` (or --input your files)")
    B, T = cfg.batch.micro_batch_size, cfg.batch.seq_len
    train = ShardLoader(train_paths, B, T, rank, world_size, seed=cfg.runtime.seed, shuffle=bool(cfg.runtime.shuffle),
                        vocab_size=vocab_size)
    val = ShardLoader(val_paths, B, T, rank, world_size, shuffle=False, vocab_size=vocab_size) if val_paths else None
    for shard in train.shards + (val.shards if val else []):  # fail now, naming the shard, not hours in
        shard.check_ids(vocab_size, full=cfg.runtime.check_data == "full")
    return train, val


def settle_evaluation(cfg, val_loader, vocab_size, log):
    """cfg with what this run can evaluate: no more val steps than the val shards hold, and no
    samples from a vocabulary that cannot write GPT-2's token ids; each change noted."""
    evaluation = cfg.eval
    if val_loader is None:
        log(f"warning: no *_val_*.npy shards in {cfg.data_dir}: no val loss")
    elif val_loader.batches_per_epoch < evaluation.val_steps:
        log(f"warning: the val shards hold {val_loader.batches_per_epoch} micro-batches per rank, "
            f"fewer than --val_steps {evaluation.val_steps}: using {val_loader.batches_per_epoch}")
        evaluation = replace(evaluation, val_steps=val_loader.batches_per_epoch)
    if evaluation.sample_interval and gpt2_vocab_problem(vocab_size):
        log(f"note: no samples: {gpt2_vocab_problem(vocab_size)}")
        evaluation = replace(evaluation, sample_interval=0)
    return replace(cfg, eval=evaluation)


def load_hellaswag(cfg, local_rank, config, log):
    """The HellaSwag examples to score at each eval, or None with a one-line note. Each eval is
    a collective, so unless every rank loaded the same number of examples, no rank scores any."""
    if not cfg.eval.hellaswag or not cfg.eval.eval_interval:
        return None
    # One download per machine, not one per GPU: local rank 0 reads first, fetching the file
    # if it is not cached; the other ranks wait at the barrier, then read its copy.
    if dist.is_initialized() and local_rank != 0:
        dist.barrier()
    examples = read_hellaswag(cfg.eval, log)
    if dist.is_initialized() and local_rank == 0:
        dist.barrier()
    counts = every_rank(len(examples) if examples else 0)
    if len(set(counts)) > 1:
        log(f"note: skipping HellaSwag: not every rank could load it (examples per rank: {counts})")
        return None
    if examples:
        try:
            hellaswag.check_model(config, examples)
        except hellaswag.HellaSwagError as e:  # the same examples on every rank: all skip alike
            log(f"note: skipping HellaSwag: {e}")
            return None
    return examples


def read_hellaswag(evaluation, log):
    """The examples that evaluation (an EvalConfig) names, or None with a one-line note."""
    if evaluation.hellaswag_path is not None and not os.path.exists(evaluation.hellaswag_path):
        log(f"note: no HellaSwag file at {evaluation.hellaswag_path}: skipping HellaSwag "
            f"(`python hellaswag.py --download_only` fetches it to {hellaswag.cached_path('val')})")
        return None
    try:
        examples = hellaswag.load_examples(evaluation.hellaswag_path, local_flag="--hellaswag_path")
    except hellaswag.HellaSwagError as e:  # offline, or a damaged file: training goes on without it
        log(f"note: skipping HellaSwag: {e}")
        return None
    return examples[: evaluation.hellaswag_limit or None]


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def estimate_val_loss(trainable, loader, steps):
    """Mean loss over the first `steps` val micro-batches of every rank, averaged over ranks, through
    the training step's (compiled) model."""
    trainable.model.eval()
    loader.reset()
    total = torch.zeros((), device=trainable.device)
    for _ in range(steps):
        x, y = (to_device(b, trainable.device) for b in loader.next_batch())
        with trainable.forward_context():
            total += trainable.model(x, y, chunked_loss=trainable.config.chunked_loss)[1]
    if dist.is_initialized():
        dist.all_reduce(total)
    trainable.model.train()
    return total.item() / (steps * distributed.world_size())


@torch.no_grad()
def hellaswag_accuracy(trainable, examples, rank, world_size):
    """(acc, acc_norm, n) with the examples split across ranks and the counts summed. Through the
    plain module: its shapes change from batch to batch, which would recompile a compiled one."""
    trainable.raw_model.eval()
    fsdp = sharding.is_sharded(trainable.raw_model)
    with sharding.root_gathered(trainable.raw_model):
        scoring = hellaswag.ScoringConfig(trainable.device, dtype=trainable.config.dtype, progress=rank == 0)
        counts = hellaswag.count_correct(trainable.raw_model, examples, scoring, rank, world_size, equal_shares=fsdp)
    trainable.raw_model.train()
    total = torch.tensor([counts["n"], counts["correct"], counts["correct_norm"]], device=trainable.device, dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(total)
    n, correct, correct_norm = total.tolist()
    return correct / n, correct_norm / n, n


@torch.no_grad()
def sample_texts(trainable, seed, num_samples=4, max_new_tokens=32):
    """Samples of SAMPLE_PROMPT from the plain module (a preview: under the training autocast)."""
    enc = get_encoding()
    trainable.raw_model.eval()
    prompt = torch.tensor(enc.encode_ordinary(SAMPLE_PROMPT), device=trainable.device).repeat(num_samples, 1)
    generator = torch.Generator(device=trainable.device).manual_seed(seed)
    with trainable.forward_context(), sharding.root_gathered(trainable.raw_model):  # generation calls hidden_states, not forward
        out = trainable.raw_model.generate(prompt, max_new_tokens, top_k=50, generator=generator)
    trainable.raw_model.train()
    return [enc.decode(row) for row in out.tolist()]


# ----------------------------------------------------------------------------- bookkeeping

def print_plan(cfg):
    """--plan: the memory per device memory.plan estimates for this run's model and settings, on
    the device and in the dtype that the run would take (a GPU this machine lacks: bfloat16)."""
    world_size = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", 1))
    device_type = devices.auto_device_type() if cfg.runtime.device == "auto" else cfg.runtime.device.split(":")[0]
    if device_type == "cuda" and cfg.runtime.dtype == "auto" and not torch.cuda.is_available():
        dtype = torch.bfloat16  # a plan for a GPU this machine lacks: an Ampere or later
    else:
        dtype = pick_dtype(cfg.runtime.dtype, device_type)
    batch, scale = cfg.batch, cfg.scale
    try:
        check_config(cfg, world_size)
        estimate = memory.plan(cfg.model, batch.micro_batch_size, batch.seq_len, scale, world_size, dtype.itemsize,
                               cfg.optimizer.name)
    except (RunError, ValueError) as e:
        sys.exit(f"error: {e}")
    precision = "float32, no autocast" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} autocast"
    print(f"{memory.n_params(cfg.model):,} parameters; {world_size} x {device_type} under "
          f"{'FSDP' if scale.fsdp else 'DDP'}, recompute {scale.recompute} (every {scale.recompute_every}), {precision}, "
          f"micro-batch {batch.micro_batch_size}x{batch.seq_len}, chunked loss {scale.chunked_loss}, "
          f"optimizer {cfg.optimizer.name}; per {'GPU' if device_type == 'cuda' else 'device'}:")
    print(estimate.table())


def model_options(cfg):
    """How the GPT runs, GPT's keyword arguments: recompute, and the attention kernels it may use."""
    return dict(recompute=cfg.scale.recompute, recompute_every=cfg.scale.recompute_every,
                attention=ATTENTION_KERNELS[cfg.runtime.attention])


def main(argv=None):
    """Runs train() and returns its model; a run error is one line on stderr and exit code 1."""
    cfg = parse_args(argv)
    if cfg.plan:
        return print_plan(cfg)
    try:
        return train(cfg)
    except (RunError, CheckpointError, ShardError) as e:
        error, code = str(e), 1  # only the text: the exception's traceback would keep train()'s DDP wrapper alive
    except KeyboardInterrupt:  # a second Ctrl-C, while the first one's checkpoint was coming
        error, code = "interrupted again: stopped without a checkpoint; `--resume auto` continues from the newest", 130
    finally:
        distributed.leave()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
