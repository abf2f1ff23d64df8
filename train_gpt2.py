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
from tqdm import tqdm

import devices
import distributed
import fineweb
import generate
import hellaswag
import logdir
import memory
import sharding
import train_config
from atomic import remove_if_unused
from checkpoint import CheckpointError, Checkpointer, training_parts
from checkpoint_files import list_checkpoints
from cli import print_error, tell_torchrun
from data import ShardError, ShardLoader, list_shards
from devices import peak_flops, pick_dtype, synchronize
from distributed import RunError, agree, on_every_rank
from faults import Faults
from inputs import first_line
from loading import check_run_sources, load_model, replaced_settings
from logdir import MetricsLog
from model import ATTENTION_KERNELS, GPT, n_params
from optimizers import current_muon_lr, describe, set_lr
from tokenizer import gpt2_vocab_problem
from train_config import TrainConfig, micro_steps, seq_len_problem
from trainable import StepConfig, Trainable, build_trainable, to_device

SAMPLE_PROMPT = "Hello, I'm a language model,"
# Parameters from which a model takes seconds to build on a host (minutes for GPT-2 XL's 1.5B): said
# in a line first, so that a start-up is never silent that long. GPT-2 (124M) and up.
SLOW_TO_BUILD = 100_000_000


def parse_args(argv=None):
    """The run's TrainConfig, from the command line (train_config.parse_args), --help showing this file's usage."""
    return train_config.parse_args(argv, description=__doc__)


# ----------------------------------------------------------------------------- setup

@dataclass
class Run:
    """What setup builds for the loop."""
    cfg: TrainConfig  # with what this run settles: its loss, what it can evaluate (val steps, samples)
    rank: int
    world_size: int
    log: object  # print on rank 0, nothing elsewhere
    trainable: Trainable
    train_loader: ShardLoader  # its micro-batch, B, the run's: -B N's, or -B auto's pick, halved if a step runs out
    val_loader: ShardLoader  # None without val shards
    hellaswag_examples: list  # None when not scored
    start_step: int
    metrics: MetricsLog
    checkpointer: Checkpointer
    log_dir_lock: object  # on rank 0, the open file whose lock keeps other runs out of log_dir


@dataclass
class Processes:
    """This process's place in the run: torchrun's ranks, or one process."""
    rank: int
    local_rank: int
    world_size: int
    device: str
    log: object  # print on rank 0, nothing elsewhere


def setup(cfg):
    """Processes, log_dir, model, data, optimizer and the state to resume from, in that order.
    Every check that can fail runs on every rank, and stops them all alike."""
    cfg, procs = start_processes(cfg)
    on_every_rank(logdir.make_log_dir, cfg.log_dir)  # claimed against a second run, tidied and checked
    log_dir_lock = on_every_rank(logdir.claim_log_dir, cfg.log_dir, procs.rank == 0)
    on_every_rank(logdir.tidy_log_dir, cfg.log_dir, cfg.checkpoints.resume, procs.log, procs.rank == 0)
    on_every_rank(logdir.check_log_dir, cfg.log_dir, cfg.checkpoints.resume, cfg.init_from, procs.log, procs.rank == 0)
    mirrors = on_every_rank(logdir.log_mirrors, cfg, procs.rank == 0)
    raw_model, init = build_model(cfg, procs.device, procs.log)
    step_config, micro_batch = plan_step(cfg, raw_model, procs)
    train_loader, val_loader, cfg = load_data(cfg, raw_model.config, micro_batch, procs)
    hellaswag_examples = hellaswag.load_for_run(cfg.eval, procs.local_rank, raw_model.config, procs.log)
    trainable = build_trainable(raw_model, procs.device, step_config, init=init)
    torch.manual_seed(cfg.runtime.seed + procs.rank)  # the init was every rank's alike; dropout's masks are each rank's own
    if cfg.optimizer.name == "muon":
        procs.log(describe(trainable.optimizer, cfg.optimizer))
    checkpointer, start_step = restore_state(cfg, trainable, train_loader, procs.log)
    # Records past the starting step are of steps about to be trained again; an evaluation trains none.
    keep_before = None if start_step >= cfg.schedule.max_steps else start_step
    metrics = on_every_rank(MetricsLog, cfg.log_dir, keep_before, procs.rank == 0, mirrors)
    return Run(cfg, procs.rank, procs.world_size, procs.log, trainable, train_loader, val_loader, hellaswag_examples,
               start_step, metrics, checkpointer, log_dir_lock)


def start_processes(cfg):
    """(cfg with its loss settled for the device, Processes): one process per GPU under torchrun.
    What cannot run here is refused before anything is written or allocated."""
    rank, local_rank, world_size, device = distributed.init(cfg.runtime.device)
    log = partial(print, flush=True) if rank == 0 else lambda message: None
    if cfg.world_size_problem(world_size):
        raise RunError(cfg.world_size_problem(world_size))
    if cfg.scale.fsdp and not dist.is_initialized():
        raise RunError("--fsdp 1 shards over the ranks of torchrun: torchrun --nproc_per_node=N train_gpt2.py ...")
    check_run_sources(cfg.init_from, cfg.checkpoints.resume)  # the same on every rank: all stop alike
    try:
        cfg = replace(cfg, scale=cfg.scale.settled(device.split(":")[0]))
    except ValueError as e:
        raise RunError(str(e)) from None
    if cfg.init_from == "scratch":  # a loaded model is as big as it is
        unfit = memory.fit_problem(cfg.model, device, world_size, bool(cfg.scale.fsdp))
        agree(f"{unfit} (see --plan)" if unfit else None)
    return cfg, Processes(rank, local_rank, world_size, device, log)


def build_model(cfg, device, log):
    """(the GPT, init): random, or the weights of anything load_model takes, whose architecture (not
    dropout) then wins. Under FSDP a random one is built on the meta device, to be materialized one
    parameter at a time from init, its recorded initialisation (see sharding.py); init is None else."""
    torch.manual_seed(cfg.runtime.seed)
    devices.allow_tf32()
    options = dict(recompute=cfg.scale.recompute, recompute_every=cfg.scale.recompute_every,
                   attention=ATTENTION_KERNELS[cfg.runtime.attention])
    init = None
    if cfg.init_from == "scratch" and n_params(cfg.model) >= SLOW_TO_BUILD:
        log(f"building a GPT of {n_params(cfg.model):,} parameters")
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
    if problem := seq_len_problem(cfg.batch.seq_len, raw_model.config.block_size, "the model's block_size"):
        raise RunError(problem)
    return raw_model, init


def plan_step(cfg, raw_model, procs):
    """(StepConfig, micro-batch) of the run on procs' device: compiled or not, the autocast dtype,
    and -B N's micro-batch or -B auto's pick (memory.resolve_micro_batch); logged, with a forecast
    of the run's length on a CPU."""
    device_type, log = procs.device.split(":")[0], procs.log
    compile_mode = cfg.runtime.compile_mode if devices.resolve_compile(cfg.runtime.compile, device_type, log) else None
    dtype = pick_dtype(cfg.runtime.dtype, device_type, log)
    batch = cfg.batch
    micro_batch = memory.resolve_micro_batch(cfg, raw_model.config, procs.device, procs.world_size, dtype,
                                             compile_mode is not None, log)
    log(f"world size {procs.world_size}, device {procs.device}, "
        f"{micro_steps(batch.total_batch_size, micro_batch, batch.seq_len, procs.world_size)} micro-steps of "
        f"{micro_batch}x{batch.seq_len} tokens per step of {batch.total_batch_size}")
    if device_type == "cpu" and (note := devices.cpu_forecast(raw_model.flops_per_token(batch.seq_len) *
                                                              batch.total_batch_size, cfg.schedule.max_steps)):
        log(note)
    return StepConfig(dtype, batch.total_batch_size, cfg.optimizer, cfg.scale, compile_mode), micro_batch


def load_data(cfg, gpt_config, micro_batch, procs):
    """(train loader, val loader or None, cfg with what it can evaluate settled): every shard
    checked now, naming the shard, not hours in. The demo's own shards are made on first use."""
    note = on_every_rank(fineweb.shard_demo_corpus, cfg.data_dir, procs.rank == 0, errors=(fineweb.InputError, OSError))
    if note:
        procs.log(note)
    train_paths, val_paths = list_shards(cfg.data_dir, "train"), list_shards(cfg.data_dir, "val")
    if not train_paths:
        raise RunError(fineweb.no_train_shards(cfg.data_dir, val_paths))
    loader = partial(ShardLoader, B=micro_batch, T=cfg.batch.seq_len, rank=procs.rank, world_size=procs.world_size,
                     vocab_size=gpt_config.vocab_size)
    if cfg.runtime.check_data == "full":
        procs.log(f"reading every token id of {len(train_paths) + len(val_paths)} shards (--check_data full)")

    def checked_loaders():
        train_loader = loader(train_paths, seed=cfg.runtime.seed, shuffle=bool(cfg.runtime.shuffle))
        val_loader = loader(val_paths, shuffle=False) if val_paths else None
        for shard in train_loader.shards + (val_loader.shards if val_loader else []):
            shard.check_ids(gpt_config.vocab_size, full=cfg.runtime.check_data == "full")
        return train_loader, val_loader
    # Agreed: a node whose copy of the shards differs stops every rank, not only its own.
    train_loader, val_loader = on_every_rank(checked_loaders, errors=(ShardError,))
    evaluation = cfg.eval
    if val_loader is None:
        procs.log(f"warning: no *_val_*.npy shards in {cfg.data_dir}: no val loss")
    elif val_loader.batches_per_epoch < evaluation.val_steps:
        procs.log(f"warning: the val shards hold {val_loader.batches_per_epoch} micro-batches per rank, "
                  f"fewer than --val_steps {evaluation.val_steps}: using {val_loader.batches_per_epoch}")
        evaluation = replace(evaluation, val_steps=val_loader.batches_per_epoch)
    if evaluation.sample_interval and gpt2_vocab_problem(gpt_config.vocab_size):
        procs.log(f"note: no samples: {gpt2_vocab_problem(gpt_config.vocab_size)}")
        evaluation = replace(evaluation, sample_interval=0)
    return train_loader, val_loader, replace(cfg, eval=evaluation)


def restore_state(cfg, trainable, train_loader, log):
    """(the run's Checkpointer, handed the parts it saves and restores, and the step to start from):
    that of the checkpoint --resume names, restored into trainable and the loader, or 0."""
    saving = cfg.checkpoints
    if saving.resume == "auto" and list_checkpoints(cfg.log_dir):
        log(f"restoring the newest checkpoint in {cfg.log_dir}")
    elif saving.resume not in ("auto", "none"):
        log(f"restoring {saving.resume}")
    checkpointer = Checkpointer(cfg.log_dir, training_parts(trainable, train_loader), saving.checkpoint_interval,
                                saving.keep_last, sharded=bool(cfg.scale.fsdp), async_save=saving.async_checkpoint,
                                log=log)
    return checkpointer, checkpointer.restore(saving.resume, cfg.schedule.max_steps, cfg.flags())


# ----------------------------------------------------------------------------- the loop

def train(requested):
    """Trains the run that requested (a TrainConfig) describes, from its start or the checkpoint it
    resumes, and returns its GPT."""
    t_start = time.perf_counter()
    # Listening before start-up's slow work (building, loading, restoring, compiling): a stop asked
    # for meanwhile is acted on before the first step, not lost.
    with distributed.StopSignal() as stop:
        run = setup(requested)
        cfg, trainable, log = run.cfg, run.trainable, run.log
        faults = Faults(cfg.runtime.fault, run.rank, trainable.raw_model, range(run.start_step, cfg.schedule.max_steps))
        bad_steps = 0  # non-finite steps in a row
        val = None  # (step, loss) of the newest val loss
        step, stopped = run.start_step, stop.requested()[0]
        if trainable.step_config.compile_mode and not stopped:
            log(f"compiling the model (torch.compile, mode {trainable.step_config.compile_mode}): "
                f"its first forward passes take longer")
        while not stopped:
            last_step = step >= cfg.schedule.max_steps
            if run.checkpointer.due(step, run.start_step, last_step):
                run.checkpointer.save(step, cfg.flags())
            if cfg.eval.eval_interval and (step % cfg.eval.eval_interval == 0 or last_step):
                val_loss = evaluate(run, step)
                val = val if val_loss is None else (step, val_loss)
            if cfg.eval.sample_interval and (step % cfg.eval.sample_interval == 0 or last_step) and step > 0:
                write_samples(run, step)
            if last_step:
                break

            faults.before_step(step)
            t0 = time.perf_counter()
            result = fitted_step(run, step, cfg.schedule.lr(step, cfg.optimizer.max_lr), stop.requested)
            stopped = result is None
            if stopped:
                break
            bad_steps = bad_steps + 1 if result.skipped else 0
            log_step(run, step, result, time.perf_counter() - t0, bad_steps)
            if bad_steps >= cfg.runtime.max_bad_steps:
                raise RunError(f"{bad_steps} steps in a row had a non-finite loss or gradient (last: step {step}); "
                               f"the newest checkpoint in {cfg.log_dir} predates them: lower --max_lr or check the data")
            step += 1
        if stopped:
            stop_on_signal(run, step)
    finish(run, step, stopped, val, time.perf_counter() - t_start)
    return trainable.raw_model


def stop_on_signal(run, step):
    """A stop at step, the step in flight dropped: a checkpoint of the steps this run trained, and
    none where it trained none (a stop during start-up or the first step), the checkpoint it
    resumed from, if any, left as it is."""
    if step == run.start_step:
        run.log(f"stopping on a signal at step {step}, before this run trained a step: nothing to save; "
                f"the same command starts here again")
        return
    run.checkpointer.save(step, run.cfg.flags())
    run.log(f"stopping on a signal at step {step}, its partial work dropped; `--resume auto` continues here")


def fitted_step(run, step, lr, stop_requested):
    """The run's step at lr (train_step_fitting: under -B auto, at half the micro-batch each time it
    runs out of memory); RunError, one line, where nothing fits."""
    auto = run.cfg.batch.micro_batch_size == "auto"
    try:
        return train_step_fitting(run.trainable, run.train_loader, lr, stop_requested, halve=auto,
                                  log=lambda line: run.log(f"out of memory at step {step}: {line}"))
    except StepOutOfMemory:
        if not auto:
            raise RunError(f"out of memory at step {step} at -B {run.train_loader.B}: try -B auto, or a smaller -B"
                           ) from None
        raise RunError(f"out of memory at step {step} at micro-batch 1: "
                       f"{memory.out_of_memory_advice(run.cfg, run.world_size, run.trainable)}") from None


def finish(run, step, stopped, val, seconds):
    """The ranks leave together, once rank 0 has written the last checkpoint (no rank reports the
    run finished while the checkpoint it would resume from is still being written), and rank 0
    sums the run up in one line: its steps, tokens, wall time, newest val loss and last checkpoint."""
    run.checkpointer.wait()
    if dist.is_initialized():
        dist.barrier()
    if run.log_dir_lock:
        run.log_dir_lock.close()
    cfg = run.cfg
    newest = list_checkpoints(cfg.log_dir)[-1:] if run.rank == 0 else []
    evaluated_only = not stopped and run.start_step >= cfg.schedule.max_steps
    trained = (f"done: evaluated step {step}, no steps trained" if evaluated_only else
               f"{'stopped' if stopped else 'done'}: step {step} of {cfg.schedule.max_steps}")
    run.log(f"{trained}, {step * cfg.batch.total_batch_size:,} tokens, {tqdm.format_interval(seconds)} wall time, "
            f"{'no val loss' if val is None else f'val loss {val[1]:.4f} at step {val[0]}'}, last checkpoint "
            f"{newest[0] if newest else 'none'}")


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

@dataclass
class StepResult:
    loss: float  # the mean over micro-steps and ranks
    grad_norm: float  # before clipping
    lr: float  # the schedule's; each param group steps at a multiple of it
    skipped: bool  # a non-finite loss or gradient: the weights did not change


class StepOutOfMemory(Exception):
    """A training step that ran out of memory on some rank: every rank dropped its partial work."""


def no_stop(*flags):
    """train_step's stop_requested where no signal stops a step: [False, then whether each of flags
    is true on any rank]."""
    return distributed.any_rank(False, *flags)


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
    grad_accum_steps = micro_steps(trainable.step_config.tokens_per_step, loader.B, loader.T, distributed.world_size())
    for micro_step in range(grad_accum_steps):
        x, y = (to_device(b, trainable.device) for b in loader.next_batch())
        last = micro_step == grad_accum_steps - 1
        try:
            with trainable.step_model.no_sync() if ddp and not last else nullcontext(), trainable.forward_context():
                loss = trainable.step_model(x, y, **trainable.loss_options())[1]  # [1]: no logits kept
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
    norm = sharding.clip_grad_norm(trainable.raw_model.parameters(), trainable.step_config.optimizer.grad_clip)
    loss_sum, norm = torch.stack([loss_sum, norm]).tolist()
    loss = loss_sum / distributed.world_size()
    if norm == 0 and math.isfinite(loss):  # no correct configuration gives an exact 0: refused before it steps
        raise RunError(f"no parameter received a gradient (the gradient norm is exactly 0 at loss {loss:.4f}) under "
                       f"--loss {trainable.step_config.scale.loss}: this configuration trains nothing")
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
        batch = loader.B
        loader.resize(batch // 2)
        if trainable.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the failed step's blocks, cached: a smaller batch needs other sizes
        steps = micro_steps(trainable.step_config.tokens_per_step, loader.B, loader.T, distributed.world_size())
        log(f"micro-batch {batch} -> {loader.B}, {steps} micro-steps per step")


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


def hellaswag_accuracy(trainable, examples, rank, world_size):
    """(acc, acc_norm, n) over every rank's share of the examples, through the plain module in
    evaluation mode: its shapes change from batch to batch, which would recompile a compiled one."""
    model = trainable.raw_model
    scoring = hellaswag.ScoringConfig(trainable.device, dtype=trainable.step_config.dtype, progress=rank == 0)
    with devices.evaluating(model), sharding.root_gathered(model):
        return hellaswag.accuracy_over_ranks(model, examples, scoring, rank, world_size)


def sample_texts(trainable, seed):
    """Samples of SAMPLE_PROMPT from the plain module in evaluation mode (a preview: under the
    training autocast). Generation calls hidden_states, not forward: FSDP's root is gathered by hand."""
    model = trainable.raw_model
    with devices.evaluating(model), trainable.forward_context(), sharding.root_gathered(model):
        return generate.preview(model, SAMPLE_PROMPT, seed, trainable.device)


@torch.no_grad()
def estimate_val_loss(trainable, loader, steps):
    """Mean loss over the first `steps` val micro-batches of every rank, averaged over ranks, through
    the training step's (compiled) model."""
    loader.reset()
    total = torch.zeros((), device=trainable.device)
    with devices.evaluating(trainable.step_model):
        for _ in range(steps):
            x, y = (to_device(b, trainable.device) for b in loader.next_batch())
            with trainable.forward_context():
                total += trainable.step_model(x, y, **trainable.loss_options())[1]
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item() / (steps * distributed.world_size())


def main(argv=None):
    """Runs train() and returns its model; a run error is one line on stderr (and in torchrun's
    summary) and exit code 1. Under torchrun rank 0 says an error that every rank meets alike; one
    that a rank meets alone (a window of the data only it reads) that rank says, naming itself, and
    the others, whose next collective fails once it has left, stop with it, without a traceback."""
    cfg = parse_args(argv)
    if cfg.plan:
        return memory.print_plan(cfg)
    rank = int(os.environ.get("RANK", 0))
    # Looked at before the ranks meet, so before any of them makes it: a start that fails leaves no
    # log_dir it made holding only its .lock.
    new_log_dir = rank == 0 and not os.path.lexists(cfg.log_dir)
    error = None  # only the text: the exception's traceback would keep train()'s DDP wrapper alive
    try:
        return train(cfg)
    except (RunError, CheckpointError) as e:  # met by every rank alike (agree, on_every_rank)
        error, code = str(e) if rank == 0 else None, 1
    except ShardError as e:  # setup agrees on every shard: this is a window only this rank reads
        error, code = distributed.fail_alone(str(e)), 1
    except KeyboardInterrupt:  # a second Ctrl-C, while the first one's checkpoint was coming
        interrupted = "interrupted again: stopped without a checkpoint; `--resume auto` continues from the newest"
        error, code = interrupted if rank == 0 else None, 130
    except Exception as e:
        # A collective that failed because another rank failed alone and left, or an error of this
        # rank's own: its traceback follows, and the others learn of it.
        error = distributed.peer_failure() if isinstance(e, RuntimeError) else None
        if error is None:
            tell_torchrun(distributed.fail_alone(f"{type(e).__name__}: {first_line(e)}"))
            raise
        code = 1
    finally:
        if error:  # before leaving: torchrun stops the other ranks as soon as one has exited
            print_error(f"error: {error}")
        distributed.leave()
    if new_log_dir:
        remove_if_unused(cfg.log_dir)
    sys.exit(code)


if __name__ == "__main__":
    main()
