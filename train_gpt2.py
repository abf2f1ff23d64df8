"""Train GPT-2 on token shards, on one process or many.

    python train_gpt2.py --preset demo                        # a small GPT on Tiny Shakespeare, CPU is fine
    python train_gpt2.py                                      # GPT-2 (124M) on FineWeb-Edu 10B, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py    # the same on 8 GPUs

The defaults are the GPT-2 (124M) reproduction: 524,288-token batches, AdamW at 6e-4
with 715 warmup steps and cosine decay to 10% at step 19,073 (one pass over 10B tokens).
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import core_eval
import fineweb
import hellaswag
from gpt2repro.common import devices, distributed
from gpt2repro.common.atomic import remove_if_unused
from gpt2repro.common.cli import INTERRUPTED, print_error, tell_torchrun
from gpt2repro.common.devices import peak_flops
from gpt2repro.common.distributed import RunError, Stopped, agree, never_stop, on_every_rank
from gpt2repro.common.inputs import first_line
from gpt2repro.lm import generate
from gpt2repro.lm.data import ShardError, ShardLoader, list_shards
from gpt2repro.lm.loss import pick_loss
from gpt2repro.lm.tokenizer import gpt2_vocab_problem
from gpt2repro.runs import logdir
from gpt2repro.runs.checkpoint import CheckpointError, Checkpointer, training_parts
from gpt2repro.runs.checkpoint_files import list_checkpoints
from gpt2repro.runs.loading import check_run_sources, load_model, replaced_settings
from gpt2repro.runs.model_weights import overflow_cause
from gpt2repro.runs.logdir import LogDirLost, MetricsLog
from gpt2repro.training import fsdp, memory, train_config
from gpt2repro.training.faults import Faults
from gpt2repro.training.optimizers import current_muon_lr, describe
from gpt2repro.training.step import (StepConfig, StepOutOfMemory, Trainable, build_trainable, to_device,
                                     train_step_fitting)
from gpt2repro.training.train_config import TrainConfig, seq_len_problem
from model import ATTENTION_KERNELS, GPT, n_params

SAMPLE_PROMPT = "Hello, I'm a language model,"
# Parameters from which a model takes seconds to build on a host (minutes for GPT-2 XL's 1.5B): said
# in a line first, so that a start-up is never silent that long. GPT-2 (124M) and up.
SLOW_TO_BUILD = 100_000_000


def parse_args(argv=None):
    """The run's TrainConfig, from the command line (train_config.parse_args), --help showing this file's usage."""
    return train_config.parse_args(argv, description=__doc__)


# ----------------------------------------------------------------------------- setup

@dataclass(frozen=True)
class Evaluation:
    """What the run evaluates, as its data and model allow (settle_evaluation)."""
    val_steps: int  # --val_steps, or the fewer micro-batches the val shards hold
    sample_interval: int  # --sample_interval, or 0 where the model's vocabulary is not GPT-2's


@dataclass
class Run:
    """What setup builds for the loop."""
    cfg: TrainConfig  # as asked, and so recorded in checkpoints; what it settles to here is below
    rank: int
    world_size: int
    log: object  # print on rank 0, nothing elsewhere
    trainable: Trainable  # its step_config: --loss, --dtype and --compile as settled on the device
    train_loader: ShardLoader  # its micro-batch, B, the run's: -B N's, or -B auto's pick, halved if a step runs out
    val_loader: ShardLoader  # None without val shards
    evaluation: Evaluation
    hellaswag_examples: list  # None when not scored
    core_tasks: list  # core_eval's LoadedTasks; None when not scored
    start_step: int
    metrics: MetricsLog
    checkpointer: Checkpointer
    log_dir_lock: object  # on rank 0, the LogDirClaim whose lock keeps other runs out of log_dir


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
    Every check that can fail runs on every rank, and stops them all alike. cfg stays as asked; what
    it settles to on this machine is settled here, each once: how the step runs (settle_step),
    the micro-batch (memory.resolve_micro_batch: the train loader's) and what it evaluates."""
    procs = start_processes(cfg)
    step_config = settle_step(cfg, procs.device, procs.log)  # a loss that cannot run here: before log_dir
    on_every_rank(logdir.make_log_dir, cfg.log_dir)  # claimed against a second run, tidied and checked
    log_dir_lock = on_every_rank(logdir.claim_log_dir, cfg.log_dir, procs.rank == 0)
    on_every_rank(logdir.tidy_log_dir, cfg.log_dir, cfg.checkpoints.resume, procs.log, procs.rank == 0)
    on_every_rank(logdir.check_log_dir, cfg.log_dir, cfg.checkpoints.resume, cfg.init_from, procs.log, procs.rank == 0)
    mirrors = on_every_rank(logdir.log_mirrors, cfg, procs.rank == 0)
    raw_model, init = build_model(cfg, procs.device, procs.log)
    micro_batch = memory.resolve_micro_batch(cfg, memory.Compute.of(step_config), raw_model.config, procs.device,
                                             procs.world_size, procs.log)
    train_loader, val_loader = load_data(cfg, raw_model.config, micro_batch, procs)
    evaluation = settle_evaluation(cfg, raw_model.config, val_loader, procs.log)
    hellaswag_examples = hellaswag.load_for_run(cfg.eval, procs.local_rank, raw_model.config, procs.log)
    core_tasks = core_eval.load_for_run(cfg.eval, raw_model.config, procs.log)
    trainable = build_trainable(raw_model, procs.device, step_config, init=init)
    torch.manual_seed(cfg.runtime.seed + procs.rank)  # the init was every rank's alike; dropout's masks are each rank's own
    if cfg.optimizer.name == "muon":
        procs.log(describe(trainable.optimizer, cfg.optimizer))
    checkpointer, start_step = restore_state(cfg, trainable, train_loader, procs.log, log_dir_lock)
    # Records past the starting step are of steps about to be trained again; an evaluation trains none.
    keep_before = None if start_step >= cfg.schedule.max_steps else start_step
    metrics = on_every_rank(MetricsLog, cfg.log_dir, keep_before, procs.rank == 0, mirrors, log_dir_lock)
    return Run(cfg, procs.rank, procs.world_size, procs.log, trainable, train_loader, val_loader, evaluation,
               hellaswag_examples, core_tasks, start_step, metrics, checkpointer, log_dir_lock)


def start_processes(cfg):
    """This process's place in the run (Processes): one process per GPU under torchrun. What cannot
    run here is refused before anything is written or allocated."""
    rank, local_rank, world_size, device = distributed.init(cfg.runtime.device)
    log = partial(print, flush=True) if rank == 0 else lambda message: None
    if cfg.world_size_problem(world_size):
        raise RunError(cfg.world_size_problem(world_size))
    if cfg.scale.fsdp and not dist.is_initialized():
        raise RunError("--fsdp 1 shards over the ranks of torchrun: torchrun --nproc_per_node=N train_gpt2.py ...")
    check_run_sources(cfg.init_from, cfg.checkpoints.resume)  # the same on every rank: all stop alike
    if cfg.init_from == "scratch":  # a loaded model is as big as it is
        unfit = memory.fit_problem(cfg.model, device, world_size, bool(cfg.scale.fsdp))
        agree(f"{unfit} (see --plan)" if unfit else None)
    return Processes(rank, local_rank, world_size, device, log)


def build_model(cfg, device, log):
    """(the GPT, init): random, or the weights of anything load_model takes, whose architecture (not
    dropout) then wins. Under FSDP a random one is built on the meta device, to be materialized one
    parameter at a time from init, its recorded initialisation (see fsdp.py); init is None else.
    On a CPU, with a forecast of the run's length."""
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
        raw_model, init = fsdp.build_on_meta(cfg.model, **options)
    else:
        raw_model = GPT(cfg.model, **options).to(device)
    if problem := seq_len_problem(cfg.batch.seq_len, raw_model.config.block_size, "the model's block_size"):
        raise RunError(problem)
    step_flops = raw_model.flops_per_token(cfg.batch.seq_len) * cfg.batch.total_batch_size
    if device == "cpu" and (note := devices.cpu_forecast(step_flops, cfg.schedule.max_steps)):
        log(note)
    return raw_model, init


def load_data(cfg, gpt_config, micro_batch, procs):
    """(train loader, val loader or None), of micro_batch sequences: every shard checked now, naming
    the shard, not hours in, and a line of how the train loader cuts a step. The demo's own shards
    are made on first use."""
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
    tokens = cfg.batch.total_batch_size
    procs.log(f"world size {procs.world_size}, device {procs.device}, {train_loader.micro_steps(tokens)} micro-steps "
              f"of {train_loader.B}x{cfg.batch.seq_len} tokens per step of {tokens}")
    return train_loader, val_loader


def settle_step(cfg, device, log):
    """The StepConfig of the run of cfg on device, its autos settled there: the loss's kind
    (loss.pick_loss; a RunError for one that cannot run there), the autocast dtype and whether it
    compiles (their notes to log)."""
    device_type, runtime = device.split(":")[0], cfg.runtime
    try:
        loss_kind = pick_loss(runtime.loss_kind, device_type)
    except ValueError as e:
        raise RunError(str(e)) from None
    compile_mode = runtime.compile_mode if devices.resolve_compile(runtime.compile, device_type, log) else None
    return StepConfig(devices.pick_dtype(runtime.dtype, device_type, log), cfg.batch.total_batch_size, cfg.optimizer,
                      bool(cfg.scale.fsdp), loss_kind, compile_mode)


def settle_evaluation(cfg, gpt_config, val_loader, log):
    """What the run of cfg evaluates (Evaluation), as a GPT of gpt_config and val_loader (None
    without val shards) allow, each shortfall said in a line."""
    val_steps, sample_interval = cfg.eval.val_steps, cfg.eval.sample_interval
    if val_loader is None:
        log(f"warning: no *_val_*.npy shards in {cfg.data_dir}: no val loss")
    elif val_loader.batches_per_epoch < val_steps:
        log(f"warning: the val shards hold {val_loader.batches_per_epoch} micro-batches per rank, "
            f"fewer than --val_steps {val_steps}: using {val_loader.batches_per_epoch}")
        val_steps = val_loader.batches_per_epoch
    if sample_interval and gpt2_vocab_problem(gpt_config.vocab_size):
        log(f"note: no samples: {gpt2_vocab_problem(gpt_config.vocab_size)}")
        sample_interval = 0
    return Evaluation(val_steps, sample_interval)


def restore_state(cfg, trainable, train_loader, log, claim):
    """(the run's Checkpointer, handed the parts it saves and restores and rank 0's claim on log_dir,
    and the step to start from): that of the checkpoint --resume names, restored into trainable and
    the loader, or 0."""
    saving = cfg.checkpoints
    if saving.resume == "auto" and list_checkpoints(cfg.log_dir):
        log(f"restoring the newest checkpoint in {cfg.log_dir}")
    elif saving.resume not in ("auto", "none"):
        log(f"restoring {saving.resume}")
    checkpointer = Checkpointer(cfg.log_dir, training_parts(trainable, train_loader), saving.checkpoint_interval,
                                saving.keep_last, sharded=bool(cfg.scale.fsdp), async_save=saving.async_checkpoint,
                                log=log, claim=claim)
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
        # What a stop cut short (None: no stop), and whether step's checkpoint is written.
        step, stopped, saved = run.start_step, "its start-up cut short" if stop.requested()[0] else None, False
        if trainable.step_config.compile_mode and not stopped:
            log(f"compiling the model (torch.compile, mode {trainable.step_config.compile_mode}): "
                f"its first forward passes take longer")
        while not stopped:
            last_step = step >= cfg.schedule.max_steps
            saved = run.checkpointer.due(step, run.start_step, last_step)
            if saved:
                run.checkpointer.save(step, cfg.flags())
            try:
                val_loss = evaluate_at(run, step, last_step, stop.heard)
            except Stopped:
                stopped = "its evaluation cut short"
                break
            val = val if val_loss is None else (step, val_loss)
            if last_step:
                break

            faults.before_step(step)
            t0 = time.perf_counter()
            result = fitted_step(run, step, cfg.schedule.lr(step, cfg.optimizer.max_lr), stop.requested)
            if result is None:
                stopped = "its partial work dropped"
                break
            bad_steps = bad_steps + 1 if result.skipped else 0
            log_step(run, step, result, time.perf_counter() - t0, bad_steps)
            if bad_steps >= cfg.runtime.max_bad_steps:
                raise RunError(f"{bad_steps} steps in a row had a non-finite loss or gradient (last: step {step}); "
                               f"the newest checkpoint in {cfg.log_dir} predates them: lower --max_lr or check the data")
            step += 1
        if stopped:
            stop_on_signal(run, step, stopped, saved)
    finish(run, step, stopped, val, time.perf_counter() - t_start)
    return trainable.raw_model


def stop_on_signal(run, step, cut, saved):
    """A stop at step, what was in flight (cut: step's partial work dropped, or its evaluation cut
    short) given up: a checkpoint of the steps this run trained, unless saved (written at step
    already), and none where it trained none (a stop during start-up, the first evaluation or the
    first step), the checkpoint it resumed from, if any, left as it is."""
    if step == run.start_step:
        run.log(f"stopping on a signal at step {step}, before this run trained a step: nothing to save; "
                f"the same command starts here again")
        return
    if not saved:
        run.checkpointer.save(step, run.cfg.flags())
    run.log(f"stopping on a signal at step {step}, {cut}; `--resume auto` continues here")


def fitted_step(run, step, lr, stop_requested):
    """The run's step at lr (train_step_fitting: under -B auto, at half the micro-batch each time it
    runs out of memory); RunError, one line, where nothing fits."""
    auto = run.cfg.batch.micro_batch_size == "auto"
    try:
        return train_step_fitting(run.trainable, run.train_loader, lr, stop_requested, halve=auto,
                                  log=lambda line: run.log(f"out of memory at step {step}: {line}"))
    except StepOutOfMemory:
        where = (f"at micro-batch 1: {memory.out_of_memory_advice(run.cfg, run.world_size, run.trainable)}" if auto
                 else f"at -B {run.train_loader.B}: try -B auto, or a smaller -B")
        raise RunError(f"out of memory at step {step} {where}") from None


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


# ----------------------------------------------------------------------------- evaluation

def evaluate_at(run, step, last_step, stop_requested):
    """The evaluations due at step: the val loss and HellaSwag every --eval_interval steps, CORE
    every --core_interval (not at step 0), the samples every --sample_interval, each at the last
    step too. Returns the val loss, None where none was taken. Each asks stop_requested before its
    every batch, on every rank: Stopped."""
    val_loss = None
    if run.cfg.eval.eval_interval and (step % run.cfg.eval.eval_interval == 0 or last_step):
        val_loss = evaluate(run, step, stop_requested)
    if run.core_tasks and ((step > 0 and step % run.cfg.eval.core_interval == 0) or last_step):
        evaluate_core(run, step, stop_requested)
    samples = run.evaluation.sample_interval
    if samples and (step % samples == 0 or last_step) and step > 0:
        write_samples(run, step, stop_requested)
    return val_loss


def evaluate(run, step, stop_requested):
    """Val loss and HellaSwag, on every rank, logged by rank 0; returns the val loss, None without val shards."""
    tokens = step * run.cfg.batch.total_batch_size
    val_loss = None
    if run.val_loader is not None:
        val_loss = estimate_val_loss(run.trainable, run.val_loader, run.evaluation.val_steps, stop_requested)
        if not math.isfinite(val_loss):  # the val loader checked every id it read: the weights overflow
            raise RunError(f"the val loss at step {step} is {val_loss} on val tokens whose ids were each checked: "
                           f"the model's forward pass overflows ({overflow_cause(run.trainable.raw_model)})")
        run.log(f"step {step:5d} | val loss {val_loss:.4f}")
        run.metrics.write(step=step, tokens=tokens, val_loss=val_loss)
    if run.hellaswag_examples:
        acc, acc_norm, n = hellaswag_accuracy(run.trainable, run.hellaswag_examples, run.rank, run.world_size,
                                              stop_requested)
        run.log(f"step {step:5d} | hellaswag acc_norm {acc_norm:.4f} ({n} examples)")
        run.metrics.write(step=step, tokens=tokens, hellaswag_acc_norm=acc_norm, hellaswag_acc=acc, hellaswag_n=n)
    return val_loss


def evaluate_core(run, step, stop_requested):
    """CORE on every rank, each scoring its share of each task's examples through the plain module in
    evaluation mode, logged by rank 0 with each task's accuracy; Stopped where stop_requested says so."""
    model = run.trainable.raw_model
    scoring = hellaswag.ScoringConfig(run.trainable.device, dtype=run.trainable.step_config.dtype,
                                      progress=run.rank == 0)
    with devices.evaluating(model), fsdp.root_gathered(model):
        result = core_eval.evaluate(model, run.core_tasks, scoring, run.rank, run.world_size, stop_requested)
    n = sum(task["n"] for task in result["tasks"].values())
    run.log(f"step {step:5d} | CORE {result['core']:.4f} ({len(result['tasks'])} tasks, {n:,} examples)")
    run.metrics.write(step=step, tokens=step * run.cfg.batch.total_batch_size, core=result["core"], core_n=n,
                      core_accuracy={label: task["accuracy"] for label, task in result["tasks"].items()})


def write_samples(run, step, stop_requested):
    """Samples, logged by rank 0. Every rank samples alike (the same seed), so that all ask
    stop_requested at the same points; under FSDP every forward gathers weights from every rank
    too. Under DDP the other ranks would only wait for rank 0 at the next step."""
    texts = sample_texts(run.trainable, run.cfg.runtime.seed + step, stop_requested)
    run.log("\n".join(f"sample {i}: {text}" for i, text in enumerate(texts)))
    run.metrics.write(step=step, tokens=step * run.cfg.batch.total_batch_size, samples=texts)


def hellaswag_accuracy(trainable, examples, rank, world_size, stop_requested=never_stop):
    """(acc, acc_norm, n) over every rank's share of the examples, through the plain module in
    evaluation mode: its shapes change from batch to batch, which would recompile a compiled one."""
    model = trainable.raw_model
    scoring = hellaswag.ScoringConfig(trainable.device, dtype=trainable.step_config.dtype, progress=rank == 0)
    with devices.evaluating(model), fsdp.root_gathered(model):
        return hellaswag.accuracy_over_ranks(model, examples, scoring, rank, world_size, stop_requested)


def sample_texts(trainable, seed, stop_requested=never_stop):
    """Samples of SAMPLE_PROMPT from the plain module in evaluation mode (a preview: under the
    training autocast). Generation calls hidden_states, not forward: FSDP's root is gathered by hand."""
    model = trainable.raw_model
    with devices.evaluating(model), trainable.forward_context(), fsdp.root_gathered(model):
        return generate.preview(model, SAMPLE_PROMPT, seed, trainable.device, stop_requested)


@torch.no_grad()
def estimate_val_loss(trainable, loader, steps, stop_requested=never_stop):
    """Mean loss over the first `steps` val micro-batches of every rank, averaged over ranks, through
    the training step's (compiled) model; Stopped where stop_requested() is true before a batch."""
    loader.reset()
    total = torch.zeros((), device=trainable.device)
    with devices.evaluating(trainable.step_model):
        for _ in range(steps):
            if stop_requested():
                raise Stopped
            x, y = (to_device(b, trainable.device) for b in loader.next_batch())
            with trainable.forward_context():
                total += trainable.step_model(x, y, loss_kind=trainable.step_config.loss_kind)[1]
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
    except (ShardError, LogDirLost) as e:  # met by this rank alone: a window only it reads (setup agrees on every
        # shard), or rank 0's log_dir removed under it
        error, code = distributed.fail_alone(str(e)), 1
    except KeyboardInterrupt:  # a second Ctrl-C, while the first one's checkpoint was coming
        interrupted = "interrupted again: stopped without a checkpoint; `--resume auto` continues from the newest"
        error, code = interrupted if rank == 0 else None, INTERRUPTED
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
