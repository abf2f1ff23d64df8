"""Benchmarks: training, tokenizing, the data loader, HellaSwag and CORE scoring and generation,
each measured beside a plain baseline in the same run, so every number is also a ratio, and the
device's dense matmul rate, the ceiling the FLOP rates are read against. It asserts nothing.

    python bench.py                                   # GPT-2 (124M) sizes on a GPU, small ones on a CPU
    python bench.py --quick                           # every part, tiny: a smoke run (minutes on a busy 2-core CPU)
    python bench.py --json bench/results/NAME.json    # also write the results as JSON
    python bench.py --parts train --levers            # also the project with each lever switched off or on
    python bench.py --parts train --levers recompute_full,chunked_loss   # only those levers
    python bench.py --parts train -B 32,64,128        # several batch sizes (out of memory is recorded)
    python bench.py --parts train --profile --json X.json   # also where a step's time goes; trace X.trace.json.gz
    python bench.py --parts train --total_batch_size 1048576   # train's tokens per optimizer step (accumulation)
    python bench.py --parts peers --llmc DIR --build_nanogpt DIR   # beside llm.c and build-nanogpt (CUDA)

MFU counts training FLOPs per token as 6N + 12·L·H·Q·T (PaLM, appendix B; N without the
position embedding) against the device's dense bf16 peak.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import argparse
import datetime
import functools
import gc
import itertools
import json
import math
import multiprocessing
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch._inductor.config
from torch.nn import functional as F

import core_eval
import fineweb
import hellaswag
from gpt2repro.benchmark import peers, step_profile
from gpt2repro.common import devices
from gpt2repro.common.atomic import atomic_open
from gpt2repro.common.cli import Parser
from gpt2repro.common.devices import autocast, device_memory, peak_flops, pick_device, pick_dtype, synchronize
from gpt2repro.common.distributed import RunError
from gpt2repro.evals import core_bundle
from gpt2repro.evals.continuations import branch_scores
from gpt2repro.lm import generate
from gpt2repro.lm.data import TINY_SHAKESPEARE, ShardLoader, shard_name, text_tokens, write_shard
from gpt2repro.lm.loss import LOSSES, has_triton, pick_loss
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, PADDED_VOCAB, get_encoding
from gpt2repro.training import memory
from gpt2repro.training.optimizers import OptimizerConfig
from gpt2repro.training.step import StepConfig, StepOutOfMemory, build_trainable, train_step, train_step_fitting
from gpt2repro.training.train_config import TrainConfig, split_problem
from model import ATTENTION_KERNELS, GPT, PRETRAINED, RECOMPUTE, GPTConfig

PARTS = ("matmul", "train", "tokenize", "loader", "hellaswag", "core", "generate")
PEERS = "peers"  # a part that runs only when named: other projects' trainers beside this one (peers.py)
# What the trainer's step (step.py) does beyond the plain loop, that --levers switches off one at a
# time: torch.compile; AdamW's fused CUDA kernel; the vocabulary padded from 50257 to 50304
# rows; SDPA's fused attention kernel (off: its math fallback). The baseline has none of them.
LEVERS = ("compile", "fused_adamw", "padded_vocab", "flash_attention")
# What the trainer does not do by default, that --levers switches on one at a time on CUDA where
# it compiles (each stays off unless it measures faster): --attention cudnn, --compile_mode
# max-autotune-no-cudagraphs, CUDA graphs (torch.compile's reduce-overhead mode) and Inductor's
# coordinate-descent tuning of its kernels' launch parameters.
OPT_IN_LEVERS = ("cudnn_attention", "max_autotune", "cuda_graphs", "coordinate_descent")
# Memory levers, switched on one at a time on any device: each --loss other than the project's own
# here (fused: CUDA's) and each --recompute mode, what they cost in time (and, on CUDA, save in peak memory).
LOSS_LEVERS = tuple(f"{kind}_loss" for kind in LOSSES)
MEMORY_LEVERS = LOSS_LEVERS + tuple(f"recompute_{mode}" for mode in RECOMPUTE[1:])
ALL_LEVERS = LEVERS + MEMORY_LEVERS + OPT_IN_LEVERS
# train times the trainer's optimizer step: total_batch_size / (B*T) micro-steps. The GPU size's
# total is the trainer's default (its config owns the number); on a CPU and with --quick, where
# that would take minutes a step, it is SMALL_ACCUM micro-batches of each -B.
TRAINER_TOTAL_BATCH = TrainConfig().batch.total_batch_size
SMALL_ACCUM = 2


def build_parser():
    p = Parser(prog="bench.py", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every part")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)}, and {PEERS} (only when named: needs CUDA, "
                        "--llmc and --build_nanogpt)")
    p.add_argument("--llmc", metavar="DIR", default=None, help="peers: a checkout of llm.c")
    p.add_argument("--build_nanogpt", metavar="DIR", default=None, help="peers: a checkout of build-nanogpt")
    p.add_argument("--peer_timeout", type=fineweb.positive_int, default=300,
                   help="peers: seconds each program may run, its start and compilation included (llm.c: its "
                        "build, waited for after the others ran, then its run)")
    p.add_argument("--json", default=None, help="write the results to this JSON file, rewritten after each result")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="auto: cuda, else mps, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="autocast dtype of train; auto: as train_gpt2.py picks it")
    p.add_argument("--compile", default="auto", choices=["auto", "1", "0"], help="torch.compile train's model; auto: on CUDA")
    p.add_argument("--baseline", type=int, default=1, choices=[0, 1], help="also time the baseline variants")
    p.add_argument("--levers", nargs="?", const=ALL_LEVERS, default=(), type=lever_names,
                   help="train: also time the project with each lever switched off or on in turn: all of them, "
                        f"or those named ({', '.join(ALL_LEVERS)})")
    p.add_argument("--n_layer", type=fineweb.positive_int, default=None, help="model size for train (default: by device)")
    p.add_argument("--n_head", type=fineweb.positive_int, default=None, help="attention heads for train (default: by device)")
    p.add_argument("--n_embd", type=fineweb.positive_int, default=None, help="model width for train (default: by device)")
    p.add_argument("-B", "--micro_batch_size", type=batch_sizes, default=None,
                   help="sequences per micro-step (forward-backward pass) for train; a comma-separated list "
                        "times each (e.g. 32,64,128)")
    p.add_argument("-T", "--seq_len", type=fineweb.positive_int, default=None,
                   help="tokens per sequence for train (default: by device)")
    p.add_argument("--total_batch_size", type=fineweb.positive_int, default=None,
                   help="train: tokens per optimizer step, as the trainer's flag: total/(B*T) micro-steps of "
                        f"gradient accumulation (default: the trainer's {TRAINER_TOTAL_BATCH:,} at the GPU size; "
                        f"{SMALL_ACCUM} micro-batches on a CPU and with --quick)")
    p.add_argument("--steps", type=fineweb.positive_int, default=None, help="timed optimizer steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (compilation, caches)")
    p.add_argument("--isolate", default="auto", choices=["auto", "1", "0"],
                   help="train: each timed run (and the profile) in a fresh process of its own, so that one that "
                        "crashes or breaks the device (a CUDA error spoils the whole process) is its own failed row "
                        "and the next starts clean; auto: on CUDA")
    p.add_argument("--profile", action="store_true",
                   help="train: also profile the project's step (at the first -B) with torch.profiler: a table of "
                        "its time by category, and the Chrome trace, gzipped, beside --json (X.json: "
                        "X.trace.json.gz; without --json: bench.trace.json.gz)")
    return p


def parse_args(argv=None):
    """The flags, every one checked before anything is timed: a mistake must not cost a GPU's benchmark run."""
    p = build_parser()
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - set(PARTS) - {PEERS}:
        p.error(f"unknown part(s) {', '.join(sorted(unknown))}")
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(f"--device: {e}")
    device_type = args.device.split(":")[0]
    args.isolate = args.isolate == "1" or (args.isolate == "auto" and device_type == "cuda")
    sizes = train_sizes(args, device_type)
    if sizes["n_embd"] % sizes["n_head"]:
        p.error(f"--n_embd {sizes['n_embd']} is not divisible by --n_head {sizes['n_head']}")
    idle = set(args.levers) - set(levers_that_apply(compiles(args, device_type), device_type))
    if idle and args.levers != ALL_LEVERS:  # named, not just all of them
        p.error(f"--levers: {', '.join(sorted(idle))}: not a lever of the project on {device_type} "
                f"(compile: where it compiles; fused_adamw, fused_loss, cudnn_attention, max_autotune: CUDA; "
                f"a loss: where it is not the project's own)")
    if sizes["warmup"] < 0:
        p.error(f"--warmup must be 0 or more, not {sizes['warmup']}")
    if "train" in args.parts:
        for B in sizes["micro_batch_size"]:
            if problem := split_problem(total_batch(sizes, B), B, sizes["seq_len"]):  # as the trainer refuses it
                p.error(problem)
        check_train_fits(p, sizes, args.device)
    if PEERS in args.parts:
        check_peers(p, args)
    if args.json:
        p.check_output("--json", args.json)
    args.trace = None
    if args.profile:
        if "train" not in args.parts:
            p.error("--profile profiles train's step: --parts must include train")
        args.trace = trace_path(args.json)
        p.check_output("--profile's trace", args.trace)
    return args


def trace_path(json_path):
    """Where --profile writes its Chrome trace, gzipped (a GPU's may pass 16 MiB): beside the JSON
    (X.json: X.trace.json.gz), or bench.trace.json.gz without one."""
    return (os.path.splitext(json_path)[0] if json_path else "bench") + ".trace.json.gz"


def check_peers(p, args):
    """One line, before anything runs, where the peers cannot run: no checkout of each, or no GPU."""
    for flag, path, files, name in (("--llmc", args.llmc, peers.LLMC_FILES, "llm.c"),
                                    ("--build_nanogpt", args.build_nanogpt, peers.BUILD_NANOGPT_FILES, "build-nanogpt")):
        if path is None:
            p.error(f"--parts {PEERS} needs {flag} DIR, a checkout of {name}")
        try:
            peers.check_checkout(path, files, name)
        except peers.PeerError as e:
            p.fail(f"{flag}: {e}")
    if not args.device.startswith("cuda"):
        p.fail(f"--parts {PEERS}: the peers train on a CUDA GPU, and this run's device is {args.device}")


def peers_config(args):
    """The peers' sizes: train's at GPT-2 (124M) on a GPU, the first -B; llm.c built for this GPU."""
    sizes = train_sizes(args, "cuda")
    major, minor = torch.cuda.get_device_capability(args.device)
    return peers.PeersConfig(args.llmc, args.build_nanogpt, sizes["micro_batch_size"][0], sizes["seq_len"],
                             sizes["total_batch_size"] or TRAINER_TOTAL_BATCH, sizes["steps"], sizes["warmup"],
                             gpu_arch=f"{major}{minor}", timeout=args.peer_timeout)


def check_train_fits(p, sizes, device):
    """A one-line exit, before anything is allocated, where train's sizes cannot be held: its largest
    model on the device (memory.fit_problem, as the trainer checks), or its shard of random tokens in
    the host's memory. A batch too large for its activations is not refused: that is an answer."""
    problem = memory.fit_problem(train_model_config(sizes, PADDED_VOCAB), device)
    if problem:
        p.fail(problem)
    have = device_memory("cpu")
    if SHARD_BYTES_PER_TOKEN * shard_tokens(sizes) > have:  # named by its flags: the product may have thousands of digits
        per_step = (f"--total_batch_size {sizes['total_batch_size']}" if sizes["total_batch_size"] else
                    f"{SMALL_ACCUM} micro-steps x -B {max(sizes['micro_batch_size'])} x -T {sizes['seq_len']}")
        p.fail(f"train's random tokens, (--steps {sizes['steps']} + --warmup {sizes['warmup']} + 1) x {per_step}, "
               f"do not fit in the host's {have / memory.GiB:,.0f} GiB of memory")


def lever_names(text):
    names = [name for name in text.split(",") if name]
    if unknown := [name for name in names if name not in ALL_LEVERS]:
        raise argparse.ArgumentTypeError(f"unknown lever(s) {', '.join(unknown)}")
    return names


def batch_sizes(text):
    return [fineweb.positive_int(b) for b in text.split(",")]


def train_sizes(args, device_type):
    """GPT-2 (124M) at B=64, T=1024 and the trainer's total batch on a GPU; a small GPT on a CPU; a
    tiny one with --quick. total_batch_size None: SMALL_ACCUM micro-batches of each -B (total_batch).
    On a CPU the step is SMALL_ACCUM micro-steps, so fewer steps: (3 + 1) x 2 micro-steps, about
    the (5 + 2) x 1 timed before the step accumulated."""
    if args.quick:
        size = dict(n_layer=2, n_head=2, n_embd=64, micro_batch_size=[2], seq_len=64, steps=2, warmup=1,
                    total_batch_size=None)
    elif device_type == "cuda":
        size = dict(n_layer=12, n_head=12, n_embd=768, micro_batch_size=[64], seq_len=1024, steps=20, warmup=5,
                    total_batch_size=TRAINER_TOTAL_BATCH)
    else:
        size = dict(n_layer=4, n_head=4, n_embd=256, micro_batch_size=[8], seq_len=256, steps=3, warmup=1,
                    total_batch_size=None)
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in size.items()}


# ----------------------------------------------------------------------------- matmul

def ceiling_sizes(device, quick):
    """(n, the side of the matmul's n x n matrices, and the bytes of the copy) that device_ceilings times:
    the copy larger than the caches."""
    on_cuda = device.startswith("cuda")
    return (256 if quick else 8192 if on_cuda else 2048), (2**30 if on_cuda else 2**26 if quick else 2**28)


@functools.cache
def device_ceilings(device, dtype, quick):
    """{FLOPS: the device's dense matmul rate in dtype, BYTES: its copy bandwidth}, per second, measured
    once a run (on a CPU no datasheet gives either): a product of random n x n matrices, and a copy
    within the device's memory, whose bytes read and written both count (ceiling_sizes), each timed by
    its fastest call (fastest_call)."""
    n, copy_bytes = ceiling_sizes(device, quick)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul = fastest_call(lambda: a @ b, 3, 20, device)
    source = torch.empty(copy_bytes // 4, device=device)
    target = torch.empty_like(source)
    copy = fastest_call(lambda: target.copy_(source), 2, 5 if quick else 20, device)
    a = b = source = target = None
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the timed runs start with the device's memory free
    return {step_profile.FLOPS: 2 * n**3 / matmul, step_profile.BYTES: 2 * copy_bytes / copy}


def fastest_call(step, n_warmup, n_steps, device):
    """The seconds of step()'s fastest call of n_steps after n_warmup untimed ones: a ceiling is the
    device's best, the call that other processes slowed least. On a CPU, also of as many on one thread:
    where other processes keep the cores busy, a call on all of them waits for the busiest, at every
    call (a busy 2-core CPU's median matmul read 0.001 TFLOP/s), while one thread's waits on no other."""
    fastest = time_steps(step, n_warmup, n_steps, device, summary=min)
    if device != "cpu":
        return fastest
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(fastest, time_steps(step, n_warmup, n_steps, device, summary=min))
    finally:
        torch.set_num_threads(threads)


def bench_matmul(args, device, record):
    """The device's two ceilings (device_ceilings): the rates that the other parts' FLOP rates and the
    profile's floors are read against."""
    dtype = pick_dtype(args.dtype, device.split(":")[0])
    ceilings = device_ceilings(device, dtype, args.quick)
    n, copy_bytes = ceiling_sizes(device, args.quick)
    record(dict(name="matmul", variant="ceiling", config=f"{n}x{n} @ {n}x{n} {str(dtype).split('.')[1]}",
                flops_per_sec=ceilings[step_profile.FLOPS]))
    record(dict(name="copy", variant="ceiling", config=f"{copy_bytes // 2**20:,} MiB float32, read + written",
                bytes_per_sec=ceilings[step_profile.BYTES]))


# ----------------------------------------------------------------------------- train

SHARD_BYTES_PER_TOKEN = 10  # drawn as int64, then copied to uint16 to be written


def total_batch(sizes, B):
    """Tokens per optimizer step at micro-batch B: --total_batch_size (or the size's default), or
    SMALL_ACCUM micro-batches where the size has none."""
    return sizes["total_batch_size"] or SMALL_ACCUM * B * sizes["seq_len"]


def shard_tokens(sizes):
    """Tokens of the shard bench_train writes: the largest step's tokens for every step, warm-up
    included, read once, and one token more for the last batch's targets."""
    return (sizes["steps"] + sizes["warmup"] + 1) * max(total_batch(sizes, B) for B in sizes["micro_batch_size"]) + 1


def train_model_config(sizes, vocab_size):
    return GPTConfig(block_size=sizes["seq_len"], vocab_size=vocab_size, n_layer=sizes["n_layer"], n_head=sizes["n_head"],
                     n_embd=sizes["n_embd"])


SPEEDS = ("tokens_per_sec", "ms_per_step", "mfu")  # a timed run's figures that only a run that trains may report
# The judge's bounds, wide enough for bf16's noise and a first step's spike, far too narrow for a run that diverges:
FRESH_LOSS = math.log(N_VOCAB)  # a fresh GPT-2's first loss, every token about as likely: 10.82
FRESH_SPREAD = 1.0   # its first loss within this of FRESH_LOSS: GPT-2's init spreads the logits (10.94 at 124M)
LOSS_RISE = 0.1      # no loss above the lowest before it by more than this fraction of the first
NORM_GROWTH = 100    # no gradient norm above this many times the first step's
NORM_CEILING = 1e4   # nor above this: a fresh GPT-2's is tens (27 at 124M's first step, 2.5 at --quick's size)
MIN_FALL = 0.002     # every run falls at least this fraction of its first loss (--quick's 2 steps: 0.005)


def training_problem(losses, grad_norms, reference=None, follow=False):
    """Why a timed run did not train, or None, from every step's loss and gradient norm: what any run
    must show (norms_problem, losses_problem). reference, the losses of the project's run in the same
    invocation, counts only where they show it themselves (losses_problem): then the run must also fall
    at least half as far over the same steps and, with follow (the train part's runs share the seed,
    the init and the data), stay within a quarter of that fall of reference's loss at every step:
    bf16's noise passes that, a run that trains nothing does not. Against any other reference (a NaN
    in it, a fall of 1e-6) the run is judged alone."""
    problem = norms_problem(grad_norms) or losses_problem(losses)
    if problem or reference is None or losses_problem(reference):
        return problem
    fall, expected = losses[0] - losses[-1], reference[0] - reference[-1]
    if fall < expected / 2:
        return f"its loss fell {fall:.4f} over {len(losses)} steps, the project's {expected:.4f}"
    apart = max(abs(a - b) for a, b in zip(losses, reference))
    if follow and apart > expected / 4:
        return f"its losses strayed {apart:.4f} from the project's, more than a quarter of its fall ({expected:.4f})"
    return None


def norms_problem(grad_norms):
    """Why gradient norms are not a run's that trains, or None: one not finite or not above 0, more
    than NORM_GROWTH times the first step's, or above NORM_CEILING (grown from a first step's norm no
    fresh GPT-2 has)."""
    bad = next((i for i, v in enumerate(grad_norms) if not (math.isfinite(v) and v > 0)), None)
    if bad is not None:
        return f"its gradient norm at step {bad} is {grad_norms[bad]}"
    if (i := next((i for i, v in enumerate(grad_norms) if v > NORM_GROWTH * grad_norms[0]), None)) is not None:
        return f"its gradient norm at step {i} is {grad_norms[i]:.4g}, over {NORM_GROWTH}x the first step's"
    if (i := next((i for i, v in enumerate(grad_norms) if v > NORM_CEILING), None)) is not None:
        return f"its gradient norm at step {i} is {grad_norms[i]:.4g}, over {NORM_CEILING:g}: a fresh GPT-2's is tens"
    return None


def losses_problem(losses):
    """Why losses are not a fresh GPT-2's that trains, or None: a loss not finite or not above 0 (no
    cross-entropy is); a first loss more than FRESH_SPREAD from FRESH_LOSS; a loss more than LOSS_RISE
    of the first above the lowest before it (a run that diverged, or swings); a fall, first to last,
    of less than MIN_FALL of the first."""
    bad = next((i for i, v in enumerate(losses) if not (math.isfinite(v) and v > 0)), None)
    if bad is not None:
        return f"its loss at step {bad} is {losses[bad]}"
    if abs(losses[0] - FRESH_LOSS) > FRESH_SPREAD:
        return (f"its first loss is {losses[0]:.4g}, not a fresh model's: ln({N_VOCAB}) = {FRESH_LOSS:.2f}, "
                f"give or take {FRESH_SPREAD:g}")
    lowest = list(itertools.accumulate(losses, min))
    rise = LOSS_RISE * losses[0]
    if (i := next((i for i in range(1, len(losses)) if losses[i] > lowest[i - 1] + rise), None)) is not None:
        return f"its loss rose to {losses[i]:.4f} at step {i}, from {lowest[i - 1]:.4f}"
    fall, least = losses[0] - losses[-1], MIN_FALL * losses[0]
    if fall < least:
        return (f"its loss fell {fall:.4g} over {len(losses)} steps ({losses[0]:.4f} to {losses[-1]:.4f}), "
                f"less than {least:.4f}")
    return None


def judged(result, reference=None, follow=False):
    """result, a timed run's figures with its losses and grad_norms, as it is reported: where the
    run did not train (training_problem against reference, the project's run of the same
    invocation, where result is not itself that), "wrong" says why and no speed is left in it."""
    problem = training_problem(result["losses"], result["grad_norms"],
                               reference["losses"] if reference and "losses" in reference else None, follow)
    if problem is None:
        return result
    return {**{k: v for k, v in result.items() if k not in SPEEDS}, "wrong": problem}


def time_steps(step, n_warmup, n_steps, device, summary=statistics.median):
    """The seconds per call of step() over n_steps calls after n_warmup untimed ones: their median, or
    summary of them."""
    times = []
    for i in range(n_warmup + n_steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        if i >= n_warmup:
            times.append(time.perf_counter() - t0)
    return summary(times)


def train_runs(args, compile_model, device_type, with_levers=True):
    """(variant, lever) for each timed run, in order: the project and the baseline, then, with_levers,
    the project with each lever that --levers names and that applies here switched off (-name) or
    on (+name)."""
    runs = [("project", None)] + [("baseline", None)] * args.baseline
    if not with_levers:
        return runs
    applies = levers_that_apply(compile_model, device_type)
    for names, sign in ((LEVERS, "-"), (MEMORY_LEVERS, "+"), (OPT_IN_LEVERS, "+")):
        runs += [("project", sign + lever) for lever in names if lever in args.levers and lever in applies]
    return runs


def levers_that_apply(compile_model, device_type):
    """Compile is only switched off where the project compiles, fused AdamW where it is used (CUDA);
    a loss where it is not the project's own (--loss auto's pick), the fused one on CUDA with Triton;
    the opt-in levers are CUDA's, and all but cuDNN attention are compile's."""
    on_cuda = device_type == "cuda"
    own_loss = pick_loss("auto", device_type)
    applies = {"compile": compile_model, "fused_adamw": on_cuda, "cudnn_attention": on_cuda,
               **{f"{kind}_loss": kind != own_loss and (kind != "fused" or on_cuda and has_triton()) for kind in LOSSES},
               **{lever: on_cuda and compile_model for lever in ("max_autotune", "cuda_graphs", "coordinate_descent")}}
    return [lever for lever in ALL_LEVERS if applies.get(lever, True)]


def compiles(args, device_type):
    return args.compile == "1" or (args.compile == "auto" and device_type == "cuda")


def bench_train(args, device, workdir, record):
    device_type = device.split(":")[0]
    sizes = train_sizes(args, device_type)
    dtype = pick_dtype(args.dtype, device_type)
    compile_model = compiles(args, device_type)
    shard = os.path.join(workdir, shard_name("bench", "train", 1))
    write_shard(shard, text_tokens(shard_tokens(sizes)))
    for i, B in enumerate(sizes["micro_batch_size"]):
        project = None  # the project's run at B: every other run there must train as it does
        for variant, lever in train_runs(args, compile_model, device_type, with_levers=i == 0):
            levers = train_levers(variant, lever, compile_model)
            result = dict(name="train", variant=variant, **({"lever": lever} if lever else {}))
            result.update(run_isolated(args.isolate, time_train_run, sizes, B, levers, variant == "baseline", shard,
                                       device, dtype))
            result.update(total_batch_size=total_batch(sizes, B),
                          config=run_config(sizes, B, result, dtype, levers["compile"] is not None))
            if "losses" in result:
                result = judged(result, project, follow=True)
                project = project or result
            record(result)
    if args.profile:
        bench_profile(args, sizes, shard, device, dtype, record)


def run_config(sizes, B, result, dtype, compiled):
    """The config column of a run at micro-batch B: the model, the micro-batch its steps ran at (the
    train loader's, smaller where the run halved it to fit), their gradient accumulation (where the
    run got as far as its loader), the dtype and whether it compiled."""
    micro = result.get("micro_batch_size", B)
    halved = f" (halved from {B})" if micro != B else ""
    accum = f" accum={result['grad_accum_steps']}" if "grad_accum_steps" in result else ""
    return (f"L{sizes['n_layer']} C{sizes['n_embd']} B{micro}{halved} T{sizes['seq_len']}{accum} "
            f"{str(dtype).split('.')[1]} compile={int(compiled)}")


def train_levers(variant, lever, compile_model):
    """The build_trainable arguments and vocabulary of one run: the project's levers, all off for
    the baseline, or one switched off (-name) or on (+name)."""
    if variant == "baseline":
        return dict(compile=None, fused_adamw=False, vocab_size=N_VOCAB, attention="math", loss="masked",
                    recompute="none", inductor={})
    levers = dict(compile="default" if compile_model else None, fused_adamw=None, vocab_size=PADDED_VOCAB,
                  attention="auto", loss="auto", recompute="none", inductor={})
    off = {"-compile": dict(compile=None), "-fused_adamw": dict(fused_adamw=False), "-padded_vocab": dict(vocab_size=N_VOCAB),
           "-flash_attention": dict(attention="math"), **{f"+{kind}_loss": dict(loss=kind) for kind in LOSSES},
           "+cudnn_attention": dict(attention="cudnn"), "+max_autotune": dict(compile="max-autotune-no-cudagraphs"),
           "+cuda_graphs": dict(compile="reduce-overhead"),
           "+coordinate_descent": dict(inductor={"coordinate_descent_tuning": True}),
           **{f"+recompute_{mode}": dict(recompute=mode) for mode in RECOMPUTE[1:]}}
    return {**levers, **off.get(lever, {})}


def time_train_run(sizes, B, levers, shrink_to_fit, shard, device, dtype):
    """The figures of step.train_step, total_batch(sizes, B) tokens per optimizer step in
    micro-steps of B, timed on a fresh model, with the micro-batch it ran at, or {"out_of_memory": True},
    or {"error": why}. With shrink_to_fit, a step that runs out of memory runs again at half the
    micro-batch, as the trainer's under -B auto (train_step_fitting): the same tokens per step, at what fits."""
    total, T = total_batch(sizes, B), sizes["seq_len"]
    device_type = device.split(":")[0]

    def measure(model, trainable, loader):
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        steps = []  # each step's result, the warm-up's too: whether the run trained is judged on them (judged)
        seconds = time_steps(lambda: steps.append(train_step_fitting(trainable, loader, 6e-4, halve=shrink_to_fit)),
                             sizes["warmup"], sizes["steps"], device)
        peak = peak_flops(device)
        return dict(tokens_per_sec=total / seconds, ms_per_step=1000 * seconds,
                    mfu=model.flops_per_token(T) * total / seconds / peak if peak else None,
                    peak_mem_bytes=torch.cuda.max_memory_allocated(device) if device_type == "cuda" else None,
                    losses=[step.loss for step in steps], grad_norms=[step.grad_norm for step in steps])
    return train_run(sizes, B, total, levers, shard, device, dtype, measure)


def run_isolated(isolate, run, *args):
    """run(*args), a timed run that returns its figures: here, or where isolate, in a fresh process
    (spawned: CUDA cannot be forked), so that a run that crashes its process, or whose CUDA error
    leaves the process's CUDA context unusable, costs its own row only, {"error": why}, and the next
    run starts on a clean device."""
    if not isolate:
        return run(*args)
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=send_run, args=(sender, run, args))
    process.start()
    sender.close()  # the child's copy is the only one left: its death ends the wait below
    try:
        result = receiver.recv()
    except EOFError:
        result = None
    process.join()
    if result is None:
        code = process.exitcode
        error = f"its process died ({f'signal {signal.Signals(-code).name}' if code < 0 else f'exit code {code}'})"
        print(f"warning: {run.__name__}: {error}", file=sys.stderr)
        return {"error": error}
    return result


def send_run(sender, run, args):
    """The child's side of run_isolated: the settings main makes for every run, then run's figures."""
    devices.allow_tf32()
    sender.send(run(*args))


def train_run(sizes, micro_batch_size, tokens_per_step, levers, shard, device, dtype, measure):
    """measure(model, trainable, loader) of a fresh model's Trainable, whose steps take tokens_per_step
    tokens, and a loader of micro_batch_size: its dict, or {"out_of_memory": True}, or {"error": why};
    with the loader's micro-batch at the end (halved where a step ran out of memory and the run
    halves) and its micro-steps a step."""
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    torch.compiler.reset()  # a fresh trace: no recompiling, as for a new shape, after the last run
    model = GPT(train_model_config(sizes, levers["vocab_size"]), recompute=levers["recompute"],
                attention=ATTENTION_KERNELS[levers["attention"]]).to(device)
    loader = ShardLoader([shard], micro_batch_size, sizes["seq_len"])
    trainable = None
    # Inductor reads its settings when it compiles, on the first step: set for the whole run.
    with torch._inductor.config.patch(levers["inductor"]):
        try:
            step = StepConfig(dtype, tokens_per_step, OptimizerConfig(fused_adamw=levers["fused_adamw"]),
                              loss_kind=pick_loss(levers["loss"], device_type), compile_mode=levers["compile"])
            trainable = build_trainable(model, device, step)
            figures = measure(model, trainable, loader)
        except (torch.cuda.OutOfMemoryError, StepOutOfMemory):  # an answer too: this size does not train here
            figures = {"out_of_memory": True}
        except RunError as e:  # train_step's refusal of a step without gradient: a run that trains nothing
            figures = {"wrong": str(e)}
        except Exception as e:  # a lever that breaks (a compile error, say) must not cost the other runs
            first_line = next(iter(str(e).strip().splitlines()), "")
            error = f"{type(e).__name__}: {first_line}"
            print(f"warning: train B{micro_batch_size}: {levers}: {error}", file=sys.stderr)
            figures = {"error": error}
        finally:  # the next run starts with the device's memory free
            model = trainable = None
            gc.collect()
            if device_type == "cuda":
                try:
                    torch.cuda.empty_cache()
                except RuntimeError:  # the device failed (an illegal memory access, say): recorded above, and after
                    pass
    return dict(figures, micro_batch_size=loader.B, grad_accum_steps=loader.micro_steps(tokens_per_step))


# ----------------------------------------------------------------------------- profile

def bench_profile(args, sizes, shard, device, dtype, record):
    """The project's step at the first -B profiled (profile_train_steps), each category's time beside
    its floor at the device's ceilings (step_profile.floors), recorded as a result named profile."""
    B = sizes["micro_batch_size"][0]
    tokens = total_batch(sizes, B)
    compile_model = compiles(args, device.split(":")[0])
    levers = train_levers("project", None, compile_model)
    ceilings = device_ceilings(device, dtype, args.quick)
    result = dict(name="profile", variant="project")
    result.update(run_isolated(args.isolate, profile_train_steps, sizes, B, tokens, levers, shard, device, dtype,
                               args.trace))
    result["config"] = run_config(sizes, B, result, dtype, compile_model)
    if "rows" in result:
        work = step_profile.step_work(train_model_config(sizes, levers["vocab_size"]), tokens, dtype.itemsize)
        result.update(step_profile.floors(result, work, ceilings))
    record(result)


def profile_steps(sizes):
    return min(sizes["steps"], 3)


def profile_train_steps(sizes, micro_batch_size, tokens_per_step, levers, shard, device, dtype, trace):
    """train_step profiled for profile_steps(sizes) steps after max(1, --warmup) untimed ones (each
    tokens_per_step tokens in micro-batches of micro_batch_size); the Chrome trace written to trace.
    Returns the figures of step_profile.profile_table, with the number of steps and where the trace is, or
    {"out_of_memory": True} or {"error": why}."""
    device_type = device.split(":")[0]
    n_steps = profile_steps(sizes)

    def measure(model, trainable, loader):
        for _ in range(max(1, sizes["warmup"])):
            train_step(trainable, loader, 6e-4)  # it waits for the device: the profile starts on an idle one
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(n_steps):
                train_step(trainable, loader, 6e-4)
            seconds = time.perf_counter() - t0
        problem = step_profile.export_trace(prof, trace)
        if problem:
            print(f"warning: could not write the trace {trace}: {problem}", file=sys.stderr)
        return dict(step_profile.profile_table(prof.events(), seconds, n_steps, device_type), steps=n_steps,
                    trace=None if problem else trace)
    return train_run(sizes, micro_batch_size, tokens_per_step, levers, shard, device, dtype, measure)


# ----------------------------------------------------------------------------- loader

def resident_bytes():
    """This process's resident memory, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def read_batches(variant, shard, B, T, n_batches):
    """(seconds, resident bytes added) to read n_batches, in a fresh process so that memory
    freed by earlier work cannot hide what this variant holds."""
    before = resident_bytes()
    t0 = time.perf_counter()
    if variant == "project":
        loader = ShardLoader([shard], B, T)
        batches = [loader.next_batch() for _ in range(n_batches)]
    else:  # build-nanogpt's loader: the whole shard as one int64 tensor
        tokens = torch.tensor(np.load(shard).astype(np.int64))
        batches = [(tokens[i * B * T: (i + 1) * B * T], tokens[i * B * T + 1: (i + 1) * B * T + 1]) for i in range(n_batches)]
    seconds = time.perf_counter() - t0
    assert len(batches) == n_batches
    return seconds, resident_bytes() - before if before is not None else None


def bench_loader(args, workdir, record):
    """Batches per second and the memory one rank's loader adds, for two shard sizes: the
    project's positioned reads against loading the whole shard as int64."""
    B, T = (4, 256) if args.quick else (16, 1024)
    n_batches = 20 if args.quick else 200
    sizes = (100_000, 1_000_000) if args.quick else (10_000_000, 100_000_000)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "bench"])  # imported once, not again for each fresh process
    with context.Pool(1, maxtasksperchild=1) as pool:
        for n_tokens in sizes:
            shard = os.path.join(workdir, shard_name(f"loader{n_tokens}", "train", 1))
            write_shard(shard, np.random.default_rng(0).integers(0, N_VOCAB, n_tokens))
            for variant in ("project", "baseline") if args.baseline else ("project",):
                seconds, rss = pool.apply(read_batches, (variant, shard, B, T, n_batches))
                record(dict(name="loader", variant=variant, config=f"shard {n_tokens:,} tokens, B{B} T{T}",
                            batches_per_sec=n_batches / seconds, rss_bytes=rss))
            os.remove(shard)


# ----------------------------------------------------------------------------- tokenize

def shakespeare_documents(mb, doc_chars=3300):
    """Tiny Shakespeare cut at speech boundaries into documents of about doc_chars characters
    (about a thousand tokens, near FineWeb-Edu's average), repeated to about mb megabytes."""
    with open(TINY_SHAKESPEARE, encoding="utf-8") as f:
        speeches = f.read().split("\n\n")
    docs, current = [], []
    for speech in speeches:
        current.append(speech)
        if sum(map(len, current)) >= doc_chars:
            docs.append("\n\n".join(current))
            current = []
    docs.append("\n\n".join(current))
    return docs * max(1, round(mb * 1e6 / sum(map(len, docs))))


def encode_one(text):
    """The baseline's task: one document, as build-nanogpt's fineweb.py encodes it."""
    return np.array([EOT] + get_encoding().encode_ordinary(text), dtype=np.uint16)


def baseline_tokenize(texts, num_proc):
    """One document per Pool.imap task: the arrays of texts, in order."""
    with multiprocessing.Pool(num_proc) as pool:
        yield from pool.imap(encode_one, texts)


def bench_tokenize(args, record):
    """fineweb.py's chunked process pool against one document per Pool.imap task, on the same
    documents with the same number of processes; runs alternate, so load from elsewhere on
    the machine falls on both alike, and the median of three is kept."""
    texts = shakespeare_documents(0.5 if args.quick else 22)
    num_proc = os.cpu_count() or 1
    get_encoding()  # forked workers inherit it
    runs = {"project": (fineweb.tokenize_documents, []), "baseline": (baseline_tokenize, [])}
    for _ in range(1 if args.quick else 3):
        for variant, (tokenize, rates) in runs.items():
            if variant == "project" or args.baseline:
                t0 = time.perf_counter()
                tokens = sum(len(array) for array in tokenize(texts, num_proc))
                rates.append(tokens / (time.perf_counter() - t0))
    for variant, (_, rates) in runs.items():
        if rates:
            record(dict(name="tokenize", variant=variant, tokens_per_sec=statistics.median(rates),
                        config=f"{sum(map(len, texts)) / 1e6:.0f} MB, {len(texts):,} docs, {num_proc} processes"))


# ----------------------------------------------------------------------------- hellaswag

def synthetic_examples(n, seed=0, context=(20, 80), ending=(8, 40)):
    """n examples shaped like HellaSwag's (contexts of 20-80 words, endings of 8-40, by default), cut
    from Tiny Shakespeare at random places: for timing, not for accuracy."""
    with open(TINY_SHAKESPEARE, encoding="utf-8") as f:
        words = f.read().split()
    rng = random.Random(seed)

    def passage(lo, hi):
        k = rng.randint(lo, hi)
        start = rng.randrange(len(words) - k)
        return " ".join(words[start: start + k])

    return [{"ctx": passage(*context), "endings": [passage(*ending) for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(n)]


def score_unbatched_full_logits(model, examples, device, dtype):
    """The plain way (build-nanogpt's): one example, 4 rows, per forward, with the logits of
    every position. Returns the number of examples whose lowest mean ending loss is the label."""
    correct = 0
    for example in examples:
        inputs, targets = hellaswag.make_batch(hellaswag.example_rows(example, model.config.block_size), device)
        with autocast(torch.device(device).type, dtype):
            logits, _ = model(inputs)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="none")
        mean = losses.view(targets.shape).sum(1) / (targets != -1).sum(1)
        correct += int(mean.argmin().item() == example["label"])
    return correct


def scoring_flops(model, examples):
    """Forward FLOPs that scoring examples takes, padding excluded: per row, PaLM's count of
    2N + 4·L·C·T per token read (N the blocks' parameters, T the row's length), plus the head's
    2·C·V at each ending position (the only ones whose logits are computed)."""
    sizes = model.config
    n_blocks = sum(p.numel() for p in model.transformer.h.parameters())
    flops = 0
    for example in examples:
        for tokens, start in hellaswag.example_rows(example, sizes.block_size):
            read = len(tokens) - 1
            flops += (2 * n_blocks + 4 * sizes.n_layer * sizes.n_embd * read) * read
            flops += 2 * sizes.n_embd * sizes.vocab_size * (len(tokens) - start)
    return flops


def bench_hellaswag(args, device, record):
    """Examples per second: the project's scoring batched, the same code at 4 rows (one
    example's worth) per forward, and the plain way. The variants take turns on chunks of
    examples, so changing load on the machine slows them alike, and each chunk starts with
    the next variant in turn: the one run after the baseline's large allocations is not
    always the same."""
    device_type = device.split(":")[0]
    if args.quick:
        size, n, batch_size = dict(n_layer=2, n_head=2, n_embd=64), 16, 8
    elif device_type == "cuda":
        size, n, batch_size = dict(n_layer=12, n_head=12, n_embd=768), 1536, 64
    else:
        size, n, batch_size = dict(n_layer=4, n_head=4, n_embd=256), 384, 16
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=PADDED_VOCAB, **size)).to(device).eval()
    dtype = pick_dtype(args.dtype, device_type)
    examples = synthetic_examples(n)
    variants = {
        "batched": lambda chunk: hellaswag.count_correct(model, chunk, hellaswag.ScoringConfig(device, batch_size, dtype)),
        "unbatched": lambda chunk: hellaswag.count_correct(model, chunk, hellaswag.ScoringConfig(device, 1, dtype)),
        "baseline": lambda chunk: score_unbatched_full_logits(model, chunk, device, dtype),
    }
    if not args.baseline:
        del variants["baseline"]
    seconds = dict.fromkeys(variants, 0.0)
    variants["batched"](examples[:batch_size])  # warm-up: allocations, kernel choice
    names = list(variants)
    chunk = 4 * batch_size
    for k, c in enumerate(range(0, n, chunk)):
        for variant in names[k % len(names):] + names[: k % len(names)]:
            t0 = time.perf_counter()
            variants[variant](examples[c: c + chunk])  # each reads its results back, waiting for the device
            seconds[variant] += time.perf_counter() - t0
    config = f"L{size['n_layer']} C{size['n_embd']}, {n} examples, " + "batch {}"
    flops = scoring_flops(model, examples)
    for variant, s in seconds.items():
        record(dict(name="hellaswag", variant=variant, examples_per_sec=n / s, flops_per_sec=flops / s,
                    config=config.format(batch_size if variant == "batched" else 1)))


# ----------------------------------------------------------------------------- core

# Words of context and of each ending of core's 10-shot examples: prompts that fit GPT-2's 1,024 tokens
# (as ARC's, PIQA's, most of HellaSwag's), whose rows share their start; and HellaSwag's longest, cut
# from the left by as many tokens as each answer adds, so that no two rows share.
CORE_SHAPES = {"fits": ((15, 45), (5, 20)), "cut": ((20, 80), (8, 40))}


def bench_core(args, device, record):
    """Examples per second of 10-shot multiple choice (4 choices, Tiny Shakespeare's words) of each
    CORE_SHAPES: core_eval.py's scoring batched, the same at one example a forward pass (an example's
    shared start computed once either way), and the plain way, nanochat's: one example's rows a
    forward pass, each row whole, every position's logits. Turns on chunks, as in bench_hellaswag."""
    device_type = device.split(":")[0]
    if args.quick:
        size, n, batch_size = dict(n_layer=2, n_head=2, n_embd=64), 4, 2
    elif device_type == "cuda":
        size, n, batch_size = PRETRAINED["gpt2"], 512, 16
    else:  # GPT-2 (124M) on a CPU: the plain way takes seconds an example
        size, n, batch_size = PRETRAINED["gpt2"], 8, 4
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=PADDED_VOCAB, **size)).to(device).eval()
    dtype = pick_dtype(args.dtype, device_type)
    task = core_bundle.Task("synthetic", "", "multiple_choice", 10, " ", 25.0)
    for shape, (context, ending) in CORE_SHAPES.items():
        pool = [{"query": e["ctx"], "choices": e["endings"], "gold": e["label"]}
                for e in synthetic_examples(max(n, 64), context=context, ending=ending)]
        loaded = core_eval.prepare(task, list(enumerate(pool, 1)), model.config.block_size)
        rows = [core_eval.example_rows(task, pool[i], [pool[j] for j in core_eval.shots_of(i, len(pool), 10)])
                for i in range(n)]
        seconds = time_core_variants(model, loaded, rows, batch_size, device, dtype, args.baseline)
        length = statistics.mean(len(tokens) for example in rows for tokens, _ in example)
        shared = sum(u.example < n for u in loaded.units) / n
        for variant, s in seconds.items():
            record(dict(name="core", variant=variant, examples_per_sec=n / s,
                        config=f"L{size['n_layer']} C{size['n_embd']}, {n} examples, 10-shot, rows of {length:.0f} "
                               f"tokens ({shape}: {shared:.2f} prefixes an example), "
                               f"batch {batch_size if variant == 'batched' else 1}"))


def time_core_variants(model, loaded, rows, batch_size, device, dtype, baseline):
    """{variant: seconds} to score the examples of rows (whose units loaded holds) each way."""
    def shared(chunk, per_pass):
        units = [u for u in loaded.units if u.example in chunk]
        for b in range(0, len(units), per_pass):
            branch_scores(model, units[b: b + per_pass], device, dtype)  # back on the host: no work left pending
    variants = {"batched": lambda chunk: shared(chunk, batch_size), "unbatched": lambda chunk: shared(chunk, 1),
                "baseline": lambda chunk: [score_rows_whole(model, rows[i], device, dtype) for i in chunk]}
    if not baseline:
        del variants["baseline"]
    seconds = dict.fromkeys(variants, 0.0)
    shared(range(batch_size), batch_size)  # warm-up: allocations, kernel choice
    names = list(variants)
    for k, c in enumerate(range(0, len(rows), batch_size)):
        for variant in names[k % len(names):] + names[: k % len(names)]:
            t0 = time.perf_counter()
            variants[variant](range(c, min(len(rows), c + batch_size)))
            seconds[variant] += time.perf_counter() - t0
    return seconds


def score_rows_whole(model, rows, device, dtype):
    """The plain way: an example's rows [(tokens, start)] cut to the model's context, right-padded
    into one forward pass, every position's logits; returns the row of the lowest mean loss."""
    cut = [(tokens[-model.config.block_size:], start - max(0, len(tokens) - model.config.block_size))
           for tokens, start in rows]
    inputs = torch.zeros((len(cut), max(len(t) for t, _ in cut)), dtype=torch.long)
    for r, (tokens, _) in enumerate(cut):
        inputs[r, : len(tokens)] = torch.tensor(tokens)
    inputs = inputs.to(device)
    with autocast(device.split(":")[0], dtype):
        logits, _ = model(inputs)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), inputs[:, 1:].flatten(), reduction="none")
    losses = losses.view(len(cut), -1)
    means = [losses[r, start - 1: len(tokens) - 1].mean().item() for r, (tokens, start) in enumerate(cut)]
    return means.index(min(means))


# ----------------------------------------------------------------------------- generate

def bench_generate(args, device, record):
    """New tokens per second of greedy generation for 16 prompts of 8 to 40 tokens: as one
    left-padded batch and one prompt after another, each with the KV cache and without it
    (every step recomputes every position). Every prompt gets max_new_tokens new tokens: no
    end-of-text stops one early, so all four do the same work."""
    device_type = device.split(":")[0]
    size, max_new_tokens = (dict(n_layer=2, n_head=2, n_embd=64), 4) if args.quick else (PRETRAINED["gpt2"], 32)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**size)).to(device).eval()
    dtype = pick_dtype(args.dtype, device_type)
    rng = random.Random(0)
    prompts = [[rng.randrange(N_VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(16)]
    batch = generate.left_pad(prompts, EOT, device)
    alone = [torch.tensor([prompt], device=device) for prompt in prompts]

    def run(batched, use_cache):  # the ids come back to the host: no pending device work
        config = generate.GenerationConfig(decode="greedy", max_new_tokens=max_new_tokens, use_cache=use_cache)
        with autocast(device_type, dtype):
            for idx, n_pad in [batch] if batched else [(idx, None) for idx in alone]:
                generate.generate(model, idx, config, n_pad)
    run(True, True)  # warm-up: allocations, kernel choice
    config = f"L{size['n_layer']} C{size['n_embd']}, 16 prompts of 8-40 tokens, {max_new_tokens} new tokens each"
    for use_cache in (True, False):
        for batched in (True, False):
            if args.baseline or (batched and use_cache):
                t0 = time.perf_counter()
                run(batched, use_cache)
                record(dict(name="generate", variant="batched" if batched else "unbatched",
                            **({} if use_cache else {"lever": "-kv_cache"}), config=config,
                            tokens_per_sec=16 * max_new_tokens / (time.perf_counter() - t0)))


# ----------------------------------------------------------------------------- report

def fmt(value, unit=""):
    if value is None:
        return "-"
    if unit == "B":
        return f"{value / 2**20:,.0f} MiB"
    if unit in ("T", "G"):
        return f"{value / {'T': 1e12, 'G': 1e9}[unit]:.3g}"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def print_table(results):
    columns = [("part", "name", ""), ("variant", "variant", ""), ("config", "config", ""),
               ("tok/s", "tokens_per_sec", ""), ("ms/step", "ms_per_step", ""), ("MFU", "mfu", "%"),
               ("peak mem", "peak_mem_bytes", "B"), ("batches/s", "batches_per_sec", ""),
               ("RSS added", "rss_bytes", "B"), ("examples/s", "examples_per_sec", ""),
               ("TFLOP/s", "flops_per_sec", "T"), ("GB/s", "bytes_per_sec", "G")]

    def label(r, key):
        if key == "variant" and "lever" in r:
            return f"{r['variant']} {r['lever']}"
        if key == "config" and r.get("out_of_memory"):
            return f"{r['config']}: out of memory"
        if key == "config" and "error" in r:
            return f"{r['config']}: failed, {r['error']}"
        if key == "config" and "wrong" in r:
            return f"{r['config']}: wrong, {r['wrong']}"
        if key == "config" and "cudnn" in r:
            return f"{r['config']}, cuDNN {r['cudnn'].split()[0]}"
        return r[key]
    rows = [[label(r, key) if key in ("name", "variant", "config") else fmt(r.get(key), unit) for _, key, unit in columns]
            for r in results if r["name"] != "profile"]
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, (title, _, _) in enumerate(columns)]
    print("  ".join(title.ljust(w) for (title, _, _), w in zip(columns, widths)))
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


def load_warning(load, cores):
    """A warning where the load average (None where the system keeps none) is above the machine's
    cores: other processes share them, and rates measured now read low. Else None."""
    if load is None or load <= cores:
        return None
    return (f"warning: the load average ({load:.1f}) is above this machine's {cores} cores: other processes share "
            f"them, and the rates measured now read low (the CPU's most: its matmul ceiling among them)")


def load_average():
    """The system's load average over the last minute (os.getloadavg: Unix), or None."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def device_name(device):
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores)" if device == "cpu" else device


def cpu_model():
    """The processor's model name, from /proc/cpuinfo on Linux; the architecture elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    devices.allow_tf32()
    report = {"device": device_name(device), "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable), "bench.py", *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "load_average": load_average(),
              "results": []}
    print(f"{report['device']} | torch {report['torch']} | {report['date']} | {report['command']}")
    if warning := load_warning(report["load_average"], os.cpu_count() or 1):
        print(warning, file=sys.stderr)

    def record(result):  # the JSON is rewritten after each result: a run cut short keeps what it measured
        report["results"].append(result)
        if args.json:
            try:
                with atomic_open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
            except OSError as e:  # a full disk: the benchmark goes on, and the table at the end has it all
                print(f"warning: could not write {args.json}: {e}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as workdir:
        if "matmul" in args.parts:
            bench_matmul(args, device, record)
        if "train" in args.parts:
            bench_train(args, device, workdir, record)
        if "tokenize" in args.parts:
            bench_tokenize(args, record)
        if "loader" in args.parts:
            bench_loader(args, workdir, record)
        if "hellaswag" in args.parts:
            bench_hellaswag(args, device, record)
        if "core" in args.parts:
            bench_core(args, device, record)
        if "generate" in args.parts:
            bench_generate(args, device, record)
        if PEERS in args.parts:
            peers.bench_peers(peers_config(args), workdir, record, judged)
    print_table(report["results"])
    for result in report["results"]:
        if result["name"] == "profile":
            step_profile.print_profile(result)


if __name__ == "__main__":
    main()
