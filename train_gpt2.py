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
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import devices
import distributed
import fineweb
import hellaswag
import logdir
import memory
import sharding
from atomic import remove_if_unused
from checkpoint import CheckpointError, Checkpointer, list_checkpoints, training_parts
from cli import Parser, preset_path
from data import ShardError, ShardLoader, list_shards
from devices import autocast, peak_flops, pick_dtype, synchronize
from distributed import RunError, agree, every_rank, on_every_rank
from faults import Faults
from loading import check_run_sources, load_model, replaced_settings
from logdir import MetricsLog
from loss import pick_loss
from model import GPT
from optimizers import OptimizerConfig, build_optimizer, current_muon_lr, describe, set_lr
from tokenizer import get_encoding, gpt2_vocab_problem
from train_config import ScaleConfig, TrainConfig, add_flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY_PATHS = ("data_dir", "hellaswag_path")  # in a preset, relative to the repository: its bundled files
SAMPLE_PROMPT = "Hello, I'm a language model,"
ATTENTION_KERNELS = {"auto": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}


def build_parser(add_help=True):
    """The trainer's flags: one per setting of train_config.TrainConfig."""
    parser = Parser(description=__doc__, add_help=add_help)
    add_flags(parser)
    return parser


def parse_args(argv=None):
    """The run's TrainConfig: TrainConfig()'s defaults, under the preset's values, under --config's,
    under the flags."""
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
    try:
        return TrainConfig.from_flags(vars(parser.parse_args(argv)))
    except ValueError as e:  # a part's own check
        parser.error(str(e))


# ----------------------------------------------------------------------------- setup

@dataclass
class Run:
    """What setup builds for the loop."""
    cfg: TrainConfig  # with what this run can evaluate settled: val steps, samples
    rank: int
    world_size: int
    log: object  # print on rank 0, nothing elsewhere
    trainable: "Trainable"
    train_loader: ShardLoader
    val_loader: ShardLoader  # None without val shards
    hellaswag_examples: list  # None when not scored
    start_step: int
    metrics: MetricsLog
    checkpointer: Checkpointer
    log_dir_lock: object  # on rank 0, the open file whose lock keeps other runs out of log_dir


def setup(cfg):
    """Processes, log_dir, data, model and optimizer, and the state to resume from, in that order.
    Every check that can fail runs on every rank, and stops them all alike."""
    # Processes: one per GPU under torchrun. What the device cannot hold is refused before it is allocated.
    rank, local_rank, world_size, device = distributed.init(cfg.runtime.device)
    log = partial(print, flush=True) if rank == 0 else lambda message: None
    if cfg.world_size_problem(world_size):
        raise RunError(cfg.world_size_problem(world_size))
    if cfg.scale.fsdp and not dist.is_initialized():
        raise RunError("--fsdp 1 shards over the ranks of torchrun: torchrun --nproc_per_node=N train_gpt2.py ...")
    check_run_sources(cfg.init_from, cfg.checkpoints.resume)  # the same on every rank: all stop alike
    try:
        cfg = replace(cfg, scale=replace(cfg.scale, loss=pick_loss(cfg.scale.loss, device.split(":")[0])))
    except ValueError as e:
        raise RunError(str(e)) from None
    if cfg.init_from == "scratch":  # a loaded model is as big as it is
        unfit = memory.fit_problem(cfg.model, device, world_size, bool(cfg.scale.fsdp))
        agree(f"{unfit} (see --plan)" if unfit else None)

    # log_dir: made, claimed against a second run, and tidied.
    on_every_rank(logdir.make_log_dir, cfg.log_dir)
    log_dir_lock = on_every_rank(logdir.claim_log_dir, cfg.log_dir, rank == 0)
    on_every_rank(logdir.tidy_log_dir, cfg.log_dir, cfg.checkpoints.resume, log, rank == 0)
    mirrors = on_every_rank(logdir.log_mirrors, cfg, rank == 0)

    # The model: random, or the weights of anything load_model takes, whose architecture (not
    # dropout) then wins. Under FSDP a random one is built on the meta device, to be materialized
    # one parameter at a time from init, its recorded initialisation (see sharding.py).
    torch.manual_seed(cfg.runtime.seed)
    devices.allow_tf32()
    options = dict(recompute=cfg.scale.recompute, recompute_every=cfg.scale.recompute_every,
                   attention=ATTENTION_KERNELS[cfg.runtime.attention])
    init = None
    if cfg.init_from != "scratch":
        log(f"initialising from {cfg.init_from}")
        try:
            raw_model = load_model(cfg.init_from, dropout=cfg.model.dropout, **options).to(device)
        except CheckpointError as e:
            raise RunError(f"--init_from: {e}") from None
        if note := replaced_settings(cfg, raw_model.config):
            log(note)
    elif cfg.scale.fsdp:
        raw_model, init = sharding.build_on_meta(cfg.model, **options)
    else:
        raw_model = GPT(cfg.model, **options).to(device)
    model = raw_model.config
    if cfg.batch.seq_len > model.block_size:
        raise RunError(f"--seq_len {cfg.batch.seq_len} is longer than the model's block_size {model.block_size}")
    device_type = device.split(":")[0]
    compile_mode = cfg.runtime.compile_mode if devices.resolve_compile(cfg.runtime.compile, device_type, log) else None
    dtype = pick_dtype(cfg.runtime.dtype, device_type, log)
    cfg = memory.resolve_micro_batch(cfg, model, device, world_size, dtype, compile_mode is not None, log)
    batch = cfg.batch
    log(f"world size {world_size}, device {device}, {batch.grad_accum_steps(world_size)} micro-steps of "
        f"{batch.micro_batch_size}x{batch.seq_len} tokens per step of {batch.total_batch_size}")
    if device_type == "cpu" and (note := devices.cpu_forecast(raw_model.flops_per_token(batch.seq_len) *
                                                              batch.total_batch_size, cfg.schedule.max_steps)):
        log(note)

    # Data: every shard checked now, naming the shard, not hours in; and what the run can evaluate.
    on_every_rank(shard_demo_corpus, cfg.data_dir, log, rank == 0)
    train_paths, val_paths = list_shards(cfg.data_dir, "train"), list_shards(cfg.data_dir, "val")
    if not train_paths:
        raise RunError(fineweb.no_train_shards(cfg.data_dir, val_paths))
    train_loader = ShardLoader(train_paths, batch.micro_batch_size, batch.seq_len, rank, world_size,
                               seed=cfg.runtime.seed, shuffle=bool(cfg.runtime.shuffle), vocab_size=model.vocab_size)
    val_loader = ShardLoader(val_paths, batch.micro_batch_size, batch.seq_len, rank, world_size, shuffle=False,
                             vocab_size=model.vocab_size) if val_paths else None
    for shard in train_loader.shards + (val_loader.shards if val_loader else []):
        shard.check_ids(model.vocab_size, full=cfg.runtime.check_data == "full")
    evaluation = cfg.eval
    if val_loader is None:
        log(f"warning: no *_val_*.npy shards in {cfg.data_dir}: no val loss")
    elif val_loader.batches_per_epoch < evaluation.val_steps:
        log(f"warning: the val shards hold {val_loader.batches_per_epoch} micro-batches per rank, "
            f"fewer than --val_steps {evaluation.val_steps}: using {val_loader.batches_per_epoch}")
        evaluation = replace(evaluation, val_steps=val_loader.batches_per_epoch)
    if evaluation.sample_interval and gpt2_vocab_problem(model.vocab_size):
        log(f"note: no samples: {gpt2_vocab_problem(model.vocab_size)}")
        evaluation = replace(evaluation, sample_interval=0)
    cfg = replace(cfg, eval=evaluation)
    hellaswag_examples = load_hellaswag(cfg, local_rank, model, log)

    # The optimizer, then the state to resume from, if any.
    step_config = StepConfig(dtype, batch.total_batch_size, cfg.optimizer, cfg.scale, compile_mode)
    trainable = build_trainable(raw_model, device, step_config, init=init)
    torch.manual_seed(cfg.runtime.seed + rank)  # the init was every rank's alike; dropout's masks are each rank's own
    if cfg.optimizer.name == "muon":
        log(describe(trainable.optimizer, cfg.optimizer))
    saving = cfg.checkpoints
    checkpointer = Checkpointer(cfg.log_dir, training_parts(trainable, train_loader), saving.checkpoint_interval,
                                saving.keep_last, sharded=bool(cfg.scale.fsdp), async_save=saving.async_checkpoint,
                                log=log)
    start_step = checkpointer.restore(saving.resume, cfg.schedule.max_steps, cfg.flags())
    # Records past the starting step are of steps about to be trained again; an evaluation trains none.
    keep_before = None if start_step >= cfg.schedule.max_steps else start_step
    metrics = on_every_rank(MetricsLog, cfg.log_dir, keep_before, rank == 0, mirrors)
    return Run(cfg, rank, world_size, log, trainable, train_loader, val_loader, hellaswag_examples, start_step,
               metrics, checkpointer, log_dir_lock)


def shard_demo_corpus(data_dir, log, enabled):
    """On rank 0 (enabled), the bundled Tiny Shakespeare sharded into data_dir if it is the demo's
    own (fineweb.shard_demo_corpus), as a RunError where it cannot be."""
    try:
        message = fineweb.shard_demo_corpus(data_dir) if enabled else None
    except (fineweb.InputError, OSError) as e:  # OSError: a shard that cannot be written
        raise RunError(str(e)) from None
    if message:
        log(message)


# ----------------------------------------------------------------------------- the loop

def train(cfg):
    t_start = time.perf_counter()
    auto_batch = cfg.batch.micro_batch_size == "auto"
    run = setup(cfg)
    cfg, trainable, log = run.cfg, run.trainable, run.log
    faults = Faults(cfg.runtime.fault, run.rank, trainable.raw_model, range(run.start_step, cfg.schedule.max_steps))
    bad_steps = 0  # non-finite steps in a row
    val, stopped = None, False  # val: (step, loss) of the newest val loss
    with distributed.StopSignal() as stop:
        step = run.start_step
        while True:
            last_step = step >= cfg.schedule.max_steps
            if run.checkpointer.due(step, run.start_step, last_step):
                run.checkpointer.save(step, run.cfg.flags())
            if cfg.eval.eval_interval and (step % cfg.eval.eval_interval == 0 or last_step):
                val_loss = evaluate(run, step)
                val = val if val_loss is None else (step, val_loss)
            if cfg.eval.sample_interval and (step % cfg.eval.sample_interval == 0 or last_step) and step > 0:
                write_samples(run, step)
            if last_step:
                break

            faults.before_step(step)
            t0 = time.perf_counter()
            lr = cfg.schedule.lr(step, cfg.optimizer.max_lr)
            result = train_step_fitting(run, step, lr, stop.requested, auto_batch)
            if result is None:
                run.checkpointer.save(step, run.cfg.flags())
                log(f"stopping on a signal at step {step}, its partial work dropped; `--resume auto` continues here")
                stopped = True
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
    trained = (f"{'stopped' if stopped else 'done'}: step {step} of {cfg.schedule.max_steps}"
               if run.start_step < cfg.schedule.max_steps else f"done: evaluated step {step}, no steps trained")
    wall = tqdm.format_interval(time.perf_counter() - t_start)
    log(f"{trained}, {step * cfg.batch.total_batch_size:,} tokens, {wall} wall time, "
        f"{'no val loss' if val is None else f'val loss {val[1]:.4f} at step {val[0]}'}, last checkpoint "
        f"{newest[0] if newest else 'none'}")
    return trainable.raw_model


def log_step(run, step, result, seconds, bad_steps):
    tokens = step * run.cfg.batch.total_batch_size
    if result.skipped:
        run.log(f"step {step:5d} | skipped: non-finite loss {result.loss} or grad norm {result.grad_norm} "
                f"({bad_steps} in a row)")
        run.metrics.write(step=step, tokens=tokens, skipped_step=True, bad_steps=bad_steps)
        return
    batch, device = run.cfg.batch, run.trainable.device
    tokens_per_sec = batch.total_batch_size / seconds
    peak = peak_flops(device)
    flops = run.trainable.raw_model.flops_per_token(batch.seq_len) * batch.total_batch_size
    mfu = f" | mfu {100 * flops / seconds / (peak * run.world_size):.1f}%" if peak else ""
    mem = f" | mem {torch.cuda.max_memory_allocated(device) / 2**30:.1f}GiB" if device.startswith("cuda") else ""
    muon_lr = current_muon_lr(run.trainable.optimizer)
    muon = {} if muon_lr is None else {"lr_muon": muon_lr}  # beside "lr", as --muon_lr's peak is beside --max_lr's
    run.log(f"step {step:5d} | loss {result.loss:.6f} | lr {result.lr:.4e}"
            + "".join(f" | muon lr {lr:.4e}" for lr in muon.values())
            + f" | norm {result.grad_norm:.4f} | dt {1000 * seconds:.2f}ms | tok/s {tokens_per_sec:.0f}{mfu}{mem}")
    run.metrics.write(step=step, tokens=tokens, train_loss=result.loss, lr=result.lr, **muon,
                      grad_norm=result.grad_norm, dt_ms=1000 * seconds, tokens_per_sec=tokens_per_sec)


# ----------------------------------------------------------------------------- the step

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
    model: torch.nn.Module  # what the forward runs through: the GPT, DDP-wrapped and/or compiled
    raw_model: GPT  # the plain GPT underneath, sharing the weights: checkpoints, HellaSwag, samples
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a no-op in other dtypes
    device: str
    config: StepConfig  # what it was built with: the dtype, step size, clipping and loss its steps use

    def loss_options(self):
        """The training forward's keywords that pick how the loss is computed (ScaleConfig.loss)."""
        return dict(loss_kind=self.config.scale.loss)

    def ddp(self):
        """The DDP wrapper the forward runs through (under torch.compile's), or None."""
        model = getattr(self.model, "_orig_mod", self.model)
        return model if isinstance(model, DDP) else None

    def forward_context(self):
        """Autocast, for one forward pass (and the backward it records)."""
        return autocast(self.device.split(":")[0], self.config.dtype)


@dataclass
class StepResult:
    loss: float  # the mean over micro-steps and ranks
    grad_norm: float  # before clipping
    lr: float  # the schedule's; each param group steps at a multiple of it
    skipped: bool  # a non-finite loss or gradient: the weights did not change


class StepOutOfMemory(Exception):
    """A training step that ran out of memory on some rank: every rank dropped its partial work."""


def train_step(trainable, loader, lr, stop_requested=lambda *flags: distributed.any_rank(False, *flags)):
    """One optimizer step of trainable.config.tokens_per_step tokens: a forward-backward pass per
    micro-batch of the loader's, all-reduced (under DDP) only on the last; then the ranks agree on
    the loss, the gradients are unscaled and clipped, and the optimizer steps at lr, unless the loss
    or gradient is not finite. Returns once the device has finished, so the caller's clock times
    the whole step. After each forward pass the ranks agree (stop_requested(out_of_memory) ->
    [stop, out_of_memory], each true if on any rank): a stop returns None, an out-of-memory error
    raises StepOutOfMemory, the weights and optimizer untouched and the loader back at the step's
    start. A stop never waits for a long step (torchrun SIGKILLs). A gradient of norm exactly 0 at a
    finite loss, which no working configuration gives, is a RunError on every rank before the step."""
    ddp = trainable.ddp() is not None
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay
    # so. Set to None, each step would allocate a second set and copy it into the buckets.
    trainable.optimizer.zero_grad(set_to_none=not ddp)
    loss_sum = torch.zeros((), device=trainable.device)
    start = loader.state_dict()
    out_of_memory = False  # on this rank, in this micro-step's forward pass or an earlier backward pass
    grad_accum_steps = trainable.config.tokens_per_step // (loader.B * loader.T * distributed.world_size())
    for micro_step in range(grad_accum_steps):
        x, y = (to_device(b, trainable.device) for b in loader.next_batch())
        last = micro_step == grad_accum_steps - 1
        try:
            with trainable.model.no_sync() if ddp and not last else nullcontext(), trainable.forward_context():
                loss = trainable.model(x, y, **trainable.loss_options())[1]  # [1]: no logits kept
        except torch.OutOfMemoryError:
            out_of_memory = True
        # Agreed before the backward pass, whose all-reduce (under DDP, the last's) a rank out of memory would miss.
        stop, out_of_memory = stop_requested(out_of_memory)
        if stop or out_of_memory:
            loader.load_state_dict(start)
            if out_of_memory:
                raise StepOutOfMemory
            return None
        loss = loss / grad_accum_steps  # a sum of micro-batch means would be grad_accum_steps too big
        loss_sum += loss.detach()
        try:
            trainable.scaler.scale(loss).backward()
        except torch.OutOfMemoryError:
            out_of_memory = True
    if distributed.any_rank(out_of_memory)[0]:  # in the last backward pass
        loader.load_state_dict(start)
        raise StepOutOfMemory
    # One all-reduce and one wait for the device: every rank gets the same loss (non-finite if any
    # rank's was) and norm (of gradients already all-reduced), so all decide alike.
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    trainable.scaler.unscale_(trainable.optimizer)
    norm = clip_grad_norm(trainable.raw_model.parameters(), trainable.config.optimizer.grad_clip)
    loss_sum, norm = torch.stack([loss_sum, norm]).tolist()
    loss = loss_sum / distributed.world_size()
    if norm == 0 and math.isfinite(loss):  # no correct configuration gives an exact 0: refused before it steps
        raise RunError(f"no parameter received a gradient (the gradient norm is exactly 0 at loss {loss:.4f}) under "
                       f"--loss {trainable.config.scale.loss}: this configuration trains nothing")
    # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that step itself.
    skipped = not (math.isfinite(loss) and (math.isfinite(norm) or trainable.scaler.is_enabled()))
    if not skipped:
        set_lr(trainable.optimizer, lr)
        trainable.scaler.step(trainable.optimizer)
    trainable.scaler.update()  # after every unscale_, or the next step's unscale_ raises
    synchronize(trainable.device)
    return StepResult(loss, norm, lr, skipped)


def train_step_fitting(run, step, lr, stop_requested, auto):
    """train_step's result. Under -B auto, each time the step runs out of memory it runs again at
    half the micro-batch and twice the micro-steps: the same tokens (ShardLoader.resize), the same
    optimizer step. RunError where it cannot: under -B N, or below one sequence."""
    while True:
        try:
            return train_step(run.trainable, run.train_loader, lr, stop_requested)
        except StepOutOfMemory:
            pass
        trainable, batch = run.trainable, run.train_loader.B
        if not auto:
            raise RunError(f"out of memory at step {step} at -B {batch}: try -B auto, or a smaller -B")
        if batch == 1:
            raise RunError(f"out of memory at step {step} at micro-batch 1: "
                           f"{memory.out_of_memory_advice(run.cfg, run.world_size, trainable)}")
        ddp = trainable.ddp()
        if ddp is not None:  # its last forward readied an all-reduce no backward will start
            ddp.reducer._reset_state()
        run.train_loader.resize(batch // 2)
        run.cfg = replace(run.cfg, batch=replace(run.cfg.batch, micro_batch_size=batch // 2))  # checkpoints record it
        if trainable.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the failed step's blocks, cached: a smaller batch needs other sizes
        run.log(f"out of memory at step {step}: micro-batch {batch} -> {batch // 2}, "
                f"{run.cfg.batch.grad_accum_steps(run.world_size)} micro-steps per step")


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
    the rest. Or, with config.scale.fsdp, sharded over the ranks (see sharding.py), and built on the meta
    device when init is its recorded initialisation. Then config.optimizer over the parameters or
    their FSDP slices (optimizers.build_optimizer). How the model runs (recompute, attention) is its
    own: see setup. The loss is config's, auto resolved for device (loss.pick_loss)."""
    config = replace(config, scale=replace(config.scale, loss=pick_loss(config.scale.loss, device.split(":")[0])))
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


# ----------------------------------------------------------------------------- evaluation

def evaluate(run, step):
    """Val loss and HellaSwag, on every rank, logged by rank 0; returns the val loss, None without val shards."""
    tokens = step * run.cfg.batch.total_batch_size
    val_loss = None
    if run.val_loader is not None:
        val_loss = estimate_val_loss(run.trainable, run.val_loader, run.cfg.eval.val_steps)
        if not math.isfinite(val_loss):  # never a result: the weights or the val shards are broken
            raise RunError(f"the val loss at step {step} is {val_loss}: check the val shards "
                           f"({', '.join(shard.path for shard in run.val_loader.shards)})")
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


def load_hellaswag(cfg, local_rank, config, log):
    """The HellaSwag examples to score at each eval, or None with a one-line note (offline, or a
    damaged file: training goes on without them). Each eval is a collective, so unless every rank
    loaded the same number of examples, no rank scores any."""
    if not cfg.eval.hellaswag or not cfg.eval.eval_interval:
        return None
    # One download per machine, not one per GPU: local rank 0 reads first, fetching the file
    # if it is not cached; the other ranks wait at the barrier, then read its copy.
    if dist.is_initialized() and local_rank != 0:
        dist.barrier()
    examples, path = None, cfg.eval.hellaswag_path
    if path is not None and not os.path.exists(path):
        log(f"note: no HellaSwag file at {path}: skipping HellaSwag "
            f"(`python hellaswag.py --download_only` fetches it to {hellaswag.cached_path('val')})")
    else:
        try:
            examples = hellaswag.load_examples(path, local_flag="--hellaswag_path")[: cfg.eval.hellaswag_limit or None]
        except hellaswag.HellaSwagError as e:
            log(f"note: skipping HellaSwag: {e}")
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
            total += trainable.model(x, y, **trainable.loss_options())[1]
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


def main(argv=None):
    """Runs train() and returns its model; a run error is one line on stderr and exit code 1."""
    cfg = parse_args(argv)
    if cfg.plan:
        return memory.print_plan(cfg)
    rank = int(os.environ.get("RANK", 0))
    # Looked at before the ranks meet, so before any of them makes it: a start that fails leaves no
    # log_dir it made holding only its .lock.
    new_log_dir = rank == 0 and not os.path.lexists(cfg.log_dir)
    try:
        return train(cfg)
    except (RunError, CheckpointError, ShardError) as e:
        error, code = str(e), 1  # only the text: the exception's traceback would keep train()'s DDP wrapper alive
    except KeyboardInterrupt:  # a second Ctrl-C, while the first one's checkpoint was coming
        error, code = "interrupted again: stopped without a checkpoint; `--resume auto` continues from the newest", 130
    finally:
        distributed.leave()
    if new_log_dir:
        remove_if_unused(cfg.log_dir)
    if rank == 0:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
