"""Train GPT-2 on token shards, on one process or many.

    python train_gpt2.py --preset demo                        # a small GPT on Tiny Shakespeare, CPU is fine
    python train_gpt2.py                                      # GPT-2 (124M) on FineWeb-Edu 10B, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py    # the same on 8 GPUs

The defaults are the GPT-2 (124M) reproduction: 524,288-token batches, AdamW at 6e-4
with 715 warmup steps and cosine decay to 10% at step 19,073 (one pass over 10B tokens).
"""
import argparse
import gc
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hellaswag
from atomic import atomic_open
from checkpoint import (CheckpointError, checkpoint_path, checkpoint_step, latest_checkpoint, list_checkpoints,
                        load_checkpoint, load_model, prune_checkpoints, save_checkpoint)
from cli import Parser, gpt2_vocab_problem
from data import TINY_SHAKESPEARE, ShardError, ShardLoader, list_shards
from devices import autocast, peak_flops, pick_device, pick_dtype
from model import GPT, GPTConfig
from tokenizer import get_encoding

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = {
    "gpt2": {},  # the defaults below: GPT-2 (124M)
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, max_lr=3e-4, micro_batch_size=32),
    # A few minutes on 2 CPU cores: Tiny Shakespeare, sharded on first use, and a 4-layer GPT.
    "demo": dict(
        data_dir=os.path.join(HERE, "data", "shakespeare"), log_dir="log_demo", n_layer=4, n_head=4, n_embd=128,
        block_size=128, total_batch_size=1024, micro_batch_size=8, seq_len=128, max_steps=150, warmup_steps=15,
        max_lr=2e-3, eval_interval=50, val_steps=8, sample_interval=50, checkpoint_interval=0,
        hellaswag_path=os.path.join(hellaswag.CACHE_DIR, "hellaswag_val.jsonl"), hellaswag_limit=500, resume="none",
    ),
}
SAMPLE_PROMPT = "Hello, I'm a language model,"


class RunError(Exception):
    """A bad argument or state that stops the run with one line and exit code 1."""


def build_parser(add_help=True):
    p = Parser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter, add_help=add_help)
    a = p.add_argument
    a("--preset", default="gpt2", choices=PRESETS, help="a named recipe whose values become the defaults")
    a("--data_dir", default="edu_fineweb10B", help="directory of *_train_*.npy and *_val_*.npy shards")
    a("--log_dir", default="log", help="log.jsonl and checkpoints go here")
    a("--init_from", default="scratch", choices=["scratch", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"],
      help="random init, or OpenAI's weights (their architecture overrides the model flags)")
    a("--n_layer", type=int, default=12, help="transformer blocks")
    a("--n_head", type=int, default=12, help="attention heads per block")
    a("--n_embd", type=int, default=768, help="width of the residual stream")
    a("--block_size", type=int, default=1024, help="context length of the model")
    a("--vocab_size", type=int, default=50304, help="embedding rows: GPT-2's 50257 padded to a multiple of 128")
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
    a("--grad_clip", type=float, default=1.0, help="max global grad norm (0: no clipping)")
    a("--eval_interval", type=int, default=250, help="val loss and HellaSwag every N steps and at the end (0: never)")
    a("--val_steps", type=int, default=20, help="micro-batches per val loss")
    a("--hellaswag", type=int, default=1, choices=[0, 1], help="HellaSwag acc_norm at every eval")
    a("--hellaswag_path", default=None, help="local HellaSwag jsonl (default: download the val split once)")
    a("--hellaswag_limit", type=int, default=0, help="score only the first N examples (0: all)")
    a("--sample_interval", type=int, default=250, help="print samples every N steps and at the end (0: never)")
    a("--checkpoint_interval", type=int, default=5000, help="checkpoint every N steps and at the end (0: only at the end)")
    a("--keep_last", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    a("--resume", default="auto", help="auto: newest checkpoint in log_dir, if any; none: start over; or a checkpoint path")
    a("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="auto: cuda, else mps, else cpu")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
      help="autocast dtype; auto: bfloat16 on CUDA from Ampere on, float16 with loss scaling before, else float32")
    a("--compile", default="auto", choices=["auto", "1", "0"], help="torch.compile the model; auto: on for CUDA")
    a("--seed", type=int, default=1337, help="seeds the init, the data order and the samples")
    a("--shuffle", type=int, default=1, choices=[0, 1],
      help="from the second epoch on, permute the shards and the windows within them (the first is in file order)")
    a("--check_data", default="quick", choices=["quick", "full"],
      help="before training, check every shard's header and token ids: quick samples the ids, full reads them all")
    a("--max_bad_steps", type=int, default=5, help="stop after this many non-finite steps in a row")
    a("--wandb", action="store_true", help="also log to Weights & Biases (needs wandb)")
    a("--wandb_project", default="gpt2-reproduction", help="the wandb project of --wandb")
    a("--tensorboard", action="store_true", help="also log to TensorBoard, in log_dir/tensorboard (needs tensorboard)")
    a("--fault", action="append", type=parse_fault, default=None, metavar="KIND@STEP[:RANK]",
      help="for testing recovery: nan (poison the loss), sigterm or sigkill (signal itself) at STEP, on RANK or all")
    return p


def parse_fault(spec):
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    if kind not in Faults.KINDS or not step.isdigit() or (rank and not rank.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r} is not KIND@STEP[:RANK] with KIND one of {', '.join(Faults.KINDS)}")
    return kind, int(step), int(rank) if rank else None


def parse_args(argv=None):
    # A preset's values become defaults, so flags given on the command line still win, and
    # --help shows them. The preset is read first, by a parser that leaves --help for later.
    preset = build_parser(add_help=False).parse_known_args(argv)[0].preset
    parser = build_parser()
    parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    if args.decay_steps is None:
        args.decay_steps = args.max_steps
    return args


def check_args(args, world_size):
    """Raises RunError for any combination that cannot train, before anything is built."""
    def need(ok, message):
        if not ok:
            raise RunError(message)
    for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "micro_batch_size", "seq_len",
                 "total_batch_size", "val_steps", "max_bad_steps"):
        need(getattr(args, name) > 0, f"--{name} must be positive, not {getattr(args, name)}")
    for name in ("max_steps", "warmup_steps", "eval_interval", "sample_interval", "checkpoint_interval", "keep_last",
                 "hellaswag_limit", "grad_clip", "weight_decay"):
        need(getattr(args, name) >= 0, f"--{name} must not be negative, not {getattr(args, name)}")
    need(args.max_steps or args.eval_interval, "--max_steps 0 only evaluates: it needs --eval_interval above 0")
    need(args.max_lr > 0 and 0 <= args.min_lr_ratio <= 1, "--max_lr must be positive and --min_lr_ratio in [0, 1]")
    need(args.n_embd % args.n_head == 0, f"--n_embd {args.n_embd} is not divisible by --n_head {args.n_head}")
    need(args.seq_len <= args.block_size, f"--seq_len {args.seq_len} is longer than --block_size {args.block_size}")
    tokens_per_pass = args.micro_batch_size * args.seq_len * world_size
    if args.total_batch_size % tokens_per_pass:
        suggestion = max(1, round(args.total_batch_size / tokens_per_pass)) * tokens_per_pass
        raise RunError(f"--total_batch_size {args.total_batch_size} is not a multiple of B*T*world_size = "
                       f"{args.micro_batch_size}*{args.seq_len}*{world_size} = {tokens_per_pass}; "
                       f"try --total_batch_size {suggestion} or another -B")


def get_lr(step, args):
    """Linear warmup to max_lr, cosine decay to min_lr at decay_steps, then flat."""
    max_lr, min_lr = args.max_lr, args.max_lr * args.min_lr_ratio
    if step < args.warmup_steps:
        return max_lr * (step + 1) / args.warmup_steps
    if step >= args.decay_steps:
        return min_lr
    progress = (step - args.warmup_steps) / (args.decay_steps - args.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


# ----------------------------------------------------------------------------- setup

def setup_distributed(device_arg):
    """(rank, local_rank, world_size, device): from torchrun's environment, or one process.
    NCCL joins CUDA processes, gloo CPU ones, so data parallelism runs (and is tested) on CPU."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    try:
        device = pick_device(device_arg, local_rank)
    except ValueError as e:
        raise RunError(f"--device {device_arg}: {e}") from None
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        # Imported before the group exists: on first import this module binds the default group
        # as a default argument (DDP imports it, through torch._dynamo) and would hold it, and
        # gloo's worker threads, past leave_process_group.
        import torch.distributed.nn  # noqa: F401
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=restart_safe_store(world_size), rank=rank, world_size=world_size)
    return rank, local_rank, world_size, device


def every_rank(value):
    """[rank 0's value, rank 1's, ...]: what each rank found, for decisions all ranks must share."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def restart_safe_store(world_size):
    """The key-value store the ranks meet in. torchrun's agent keeps one store alive across
    --max-restarts, and workers of a new attempt could read the addresses their killed
    predecessors left there (connection refused, or a hang). Prefixing the keys with the
    attempt number keeps each attempt's keys its own. None: let init_process_group decide."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def leave_process_group():
    """Destroys the group once nothing holds it, so that gloo's worker threads are joined here
    rather than left running as the interpreter exits (where one can abort a finished run). The
    DDP wrapper holds the group and sits in a reference cycle: only the garbage collector frees it."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def resolve_compile(flag, device_type, log):
    if flag != "auto":
        return flag == "1"
    if device_type == "cuda" and sys.platform != "win32":
        return True
    if device_type == "mps" or sys.platform == "win32":
        log(f"note: --compile auto stays off on {'Windows' if sys.platform == 'win32' else 'MPS'}")
    return False


def build_model(args, log):
    if args.init_from == "scratch":
        return GPT(GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size,
                             n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    log(f"initialising from OpenAI's {args.init_from}")
    return load_model(args.init_from)


def ensure_demo_shards(args, rank, log):
    """The demo trains on Tiny Shakespeare, sharded with fineweb.py's code on first use (and
    completed, should that first sharding have been interrupted)."""
    if args.preset != "demo":
        return
    if rank == 0:
        import fineweb
        try:
            summary = fineweb.shard_local_files([TINY_SHAKESPEARE], args.data_dir, prefix="shakespeare",
                                                shard_size=32768, num_proc=1)
        except (fineweb.InputError, OSError) as e:  # OSError: a shard that cannot be written
            raise RunError(str(e)) from None
        if summary["status"] != "already complete":
            log(f"sharded {TINY_SHAKESPEARE} into {summary['shards']} shards in {args.data_dir}")
    if dist.is_initialized():
        dist.barrier()


def build_loaders(args, rank, world_size, log):
    train_paths, val_paths = list_shards(args.data_dir, "train"), list_shards(args.data_dir, "val")
    if not train_paths:
        raise RunError(f"no *_train_*.npy shards in {args.data_dir!r}: make them with "
                       f"`python fineweb.py --output_dir {args.data_dir}` (or --input your files)")
    B, T = args.micro_batch_size, args.seq_len
    train = ShardLoader(train_paths, B, T, rank, world_size, seed=args.seed, shuffle=bool(args.shuffle),
                        vocab_size=args.vocab_size)
    val = None
    if not val_paths:
        log(f"warning: no *_val_*.npy shards in {args.data_dir}: no val loss")
    else:
        val = ShardLoader(val_paths, B, T, rank, world_size, shuffle=False, vocab_size=args.vocab_size)
        if val.batches_per_epoch < args.val_steps:
            log(f"warning: the val shards hold {val.batches_per_epoch} micro-batches per rank, "
                f"fewer than --val_steps {args.val_steps}: using {val.batches_per_epoch}")
            args.val_steps = val.batches_per_epoch
    for shard in train.shards + (val.shards if val else []):  # fail now, naming the shard, not hours in
        shard.check_ids(args.vocab_size, full=args.check_data == "full")
    return train, val


def load_hellaswag(args, local_rank, log):
    """The HellaSwag examples to score at each eval, or None with a one-line note. Each eval is
    a collective, so unless every rank loaded the same number of examples, no rank scores any."""
    if not args.hellaswag or not args.eval_interval:
        return None
    # One download per machine, not one per GPU: local rank 0 reads first, fetching the file
    # if it is not cached; the other ranks wait at the barrier, then read its copy.
    if dist.is_initialized() and local_rank != 0:
        dist.barrier()
    examples = read_hellaswag(args, log)
    if dist.is_initialized() and local_rank == 0:
        dist.barrier()
    counts = every_rank(len(examples) if examples else 0)
    if len(set(counts)) > 1:
        log(f"note: skipping HellaSwag: not every rank could load it (examples per rank: {counts})")
        return None
    return examples


def read_hellaswag(args, log):
    if args.hellaswag_path is not None and not os.path.exists(args.hellaswag_path):
        log(f"note: no HellaSwag file at {args.hellaswag_path}: skipping HellaSwag (python hellaswag.py downloads it)")
        return None
    try:
        examples = hellaswag.load_examples(args.hellaswag_path)
    except hellaswag.HellaSwagError as e:  # offline, or a damaged file: training goes on without it
        log(f"note: skipping HellaSwag: {e}")
        return None
    return examples[: args.hellaswag_limit or None]


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def estimate_val_loss(model, loader, steps, mixed_precision, device):
    """Mean loss over the first `steps` val micro-batches of every rank, averaged over ranks."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = (to_device(t, device) for t in loader.next_batch())
        with mixed_precision:
            total += model(x, y)[1]
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return total.item() / (steps * (dist.get_world_size() if dist.is_initialized() else 1))


@torch.no_grad()
def hellaswag_accuracy(model, examples, device, dtype, rank, world_size):
    """(acc, acc_norm, n) with the examples split across ranks and the counts summed."""
    model.eval()
    counts = hellaswag.evaluate(model, examples, device, dtype=dtype, rank=rank, world_size=world_size)
    model.train()
    total = torch.tensor([counts["n"], counts["correct"], counts["correct_norm"]], device=device, dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(total)
    n, correct, correct_norm = total.tolist()
    return correct / n, correct_norm / n, n


@torch.no_grad()
def sample_texts(model, device, mixed_precision, seed, num_samples=4, max_new_tokens=32):
    enc = get_encoding()
    model.eval()
    prompt = torch.tensor(enc.encode_ordinary(SAMPLE_PROMPT), device=device).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    with mixed_precision:
        out = model.generate(prompt, max_new_tokens, top_k=50, generator=generator)
    model.train()
    return [enc.decode(row) for row in out.tolist()]


# ----------------------------------------------------------------------------- bookkeeping

class RunLog:
    """log.jsonl: one JSON object per event, all with `step` and `tokens`. A run that trains from
    step s keeps the records of steps before s: those of later steps, written after that
    checkpoint by a run that then died, are dropped, so no step is counted twice (keep_before=s;
    None keeps every record). Each record also goes to the mirrors (wandb, TensorBoard)."""

    def __init__(self, log_dir, keep_before, enabled, mirrors=()):
        self.path = os.path.join(log_dir, "log.jsonl")
        self.enabled = enabled
        self.mirrors = mirrors
        if enabled:  # rewritten even when every record is kept: a half-written last line goes
            kept = self._records_before(keep_before)
            try:
                with atomic_open(self.path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
            except OSError as e:  # a full disk: the file stays as it was, and training goes on
                print(f"warning: could not rewrite {self.path}: {e}", file=sys.stderr)

    def _records_before(self, step):
        if not os.path.exists(self.path):
            return []
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed mid-write
                    continue
                if step is None or record.get("step", step) < step:
                    kept.append(record)
        return kept

    def write(self, **record):
        if self.enabled:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # a full disk: a record lost costs less than the run
                print(f"warning: could not append to {self.path}: {e}", file=sys.stderr)
            for mirror in self.mirrors:
                mirror(record)


def log_mirrors(args):
    """Callables that copy each log record to wandb and/or TensorBoard, imported only when asked for."""
    mirrors = []
    if args.wandb:
        try:
            import wandb
        except ImportError:
            raise RunError("--wandb needs the wandb package: pip install wandb") from None
        run = wandb.init(project=args.wandb_project, name=os.path.basename(os.path.abspath(args.log_dir)),
                         dir=args.log_dir, config=vars(args))
        mirrors.append(lambda r: run.log({k: v for k, v in r.items() if k != "step"}, step=r["step"]))
    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RunError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        writer = SummaryWriter(os.path.join(args.log_dir, "tensorboard"))

        def to_tensorboard(record):
            for key, value in record.items():
                if key == "samples":
                    writer.add_text(key, "\n\n".join(value), record["step"])
                elif key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, record["step"])
            writer.flush()
        mirrors.append(to_tensorboard)
    return mirrors


class StopSignal:
    """SIGTERM and SIGINT (what SLURM, Kubernetes and spot instances send) ask the run to
    finish its step, checkpoint and exit; a second SIGINT interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.received = None
        self.previous = [signal.signal(sig, self._handle) for sig in self.SIGNALS]
        return self

    def __exit__(self, *exc):
        for sig, handler in zip(self.SIGNALS, self.previous):
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum


class Faults:
    """Faults injected on purpose (--fault), to test that runs survive them."""

    KINDS = ("nan", "sigterm", "sigkill")

    def __init__(self, specs, rank):
        self.at_step = {}
        self.nan_now = False
        for kind, step, only_rank in specs or []:
            if only_rank is None or only_rank == rank:
                self.at_step.setdefault(step, set()).add(kind)

    def before_step(self, step):
        kinds = self.at_step.get(step, ())
        self.nan_now = "nan" in kinds
        if "sigterm" in kinds:
            os.kill(os.getpid(), signal.SIGTERM)
        # Only in torchrun's first attempt, so that a restarted worker gets past this step.
        if "sigkill" in kinds and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    def poison(self, loss):
        return loss * float("nan") if self.nan_now else loss


def training_state(raw_model, optimizer, scaler, step, train_loader, args):
    """Everything an exact resume needs, as tensors and plain Python values."""
    return {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "train_loader": train_loader.state_dict(),
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "config": asdict(raw_model.config),
        "args": vars(args),
    }


def find_resume_state(args):
    """(path, state) to resume from, or None to start fresh. Every rank reads the checkpoint
    itself, so all must find the same one: on several nodes, log_dir must be shared storage."""
    if args.resume == "none":
        return None
    resume = latest_checkpoint(args.log_dir) if args.resume == "auto" else (args.resume, load_checkpoint(args.resume))
    steps = every_rank(resume[1].get("step") if resume else None)  # a model-only one has none: restore says so
    if len(set(steps)) > 1:
        raise RunError(f"the ranks found different checkpoints to resume from (step per rank: {steps}): "
                       f"on several nodes, --log_dir must be a directory they all share")
    return resume


def check_no_later_checkpoints(log_dir, step):
    """Training on from an older checkpoint, named by path, into a log_dir that holds checkpoints
    of later steps would interleave two runs there, and --resume auto or --keep_last would later
    take the wrong run's files."""
    later = [p for p in list_checkpoints(log_dir) if checkpoint_step(p) > step]
    if later:
        raise RunError(f"{log_dir} holds checkpoints past step {step} ({os.path.basename(later[-1])}, ...): training "
                       f"from step {step} there would mix two runs; choose another --log_dir, or delete them to branch off")


def restore(state, path, raw_model, optimizer, scaler, train_loader):
    missing = [key for key in ("optimizer", "scaler", "train_loader", "rng", "step") if key not in state]
    if missing:
        raise RunError(f"{path} holds no {missing[0]}: a model to score or sample, not a run to resume")
    if state["config"] != asdict(raw_model.config):
        diff = ", ".join(f"{k} {v} (this run: {asdict(raw_model.config).get(k)})"
                         for k, v in state["config"].items() if asdict(raw_model.config).get(k) != v)
        raise RunError(f"{path} holds a model of another architecture: {diff}")
    raw_model.load_state_dict(state["model"])
    # The saved param groups also hold the saving machine's AdamW kernel (fused, foreach): this
    # machine's own choice stays, so a run saved on a CPU resumes fused on a GPU, and back.
    kernels = [{k: group[k] for k in ("fused", "foreach")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)
    if state["scaler"]:  # empty when saved without fp16 loss scaling: a switch to fp16 starts a fresh scale
        scaler.load_state_dict(state["scaler"])
    train_loader.load_state_dict(state["train_loader"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        # One state per GPU the saving process saw: a run resumed on fewer GPUs takes as many.
        torch.cuda.set_rng_state_all(state["rng"]["cuda"][: torch.cuda.device_count()])
    return state["step"]


# ----------------------------------------------------------------------------- training

def train(args):
    rank, local_rank, world_size, device = setup_distributed(args.device)
    device_type = device.split(":")[0]
    master = rank == 0

    def log(message):
        if master:
            print(message, flush=True)

    check_args(args, world_size)
    grad_accum_steps = args.total_batch_size // (args.micro_batch_size * args.seq_len * world_size)
    log(f"world size {world_size}, device {device}, {grad_accum_steps} micro-steps of "
        f"{args.micro_batch_size}x{args.seq_len} tokens per step of {args.total_batch_size}")
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    try:  # on every rank, so that all stop alike if it cannot be made
        os.makedirs(args.log_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"--log_dir {args.log_dir}: cannot make it ({e.strerror})") from None

    ensure_demo_shards(args, rank, log)
    train_loader, val_loader = build_loaders(args, rank, world_size, log)
    hellaswag_examples = load_hellaswag(args, local_rank, log)

    raw_model = build_model(args, log).to(device)
    if args.seq_len > raw_model.config.block_size:
        raise RunError(f"--seq_len {args.seq_len} is longer than the model's block_size {raw_model.config.block_size}")
    dtype = pick_dtype(args.dtype, device_type)
    mixed_precision = autocast(device_type, dtype)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, device_type)

    start_step = 0
    resume = find_resume_state(args)
    if resume is not None:
        start_step = restore(resume[1], resume[0], raw_model, optimizer, scaler, train_loader)
        log(f"resuming from {resume[0]} at step {start_step}")
    evaluate_only = start_step >= args.max_steps
    if args.resume not in ("auto", "none") and not evaluate_only:
        check_no_later_checkpoints(args.log_dir, start_step)
    # Records past the starting step are of steps about to be trained again; an evaluation trains none.
    run_log = RunLog(args.log_dir, None if evaluate_only else start_step, enabled=master,
                     mirrors=log_mirrors(args) if master else ())

    # HellaSwag and sampling use the plain module (same weights): their shapes change from call to
    # call, which would recompile. Val loss has the training shapes and runs compiled.
    model = torch.compile(raw_model) if resolve_compile(args.compile, device_type, log) else raw_model
    if world_size > 1:
        # Gradients as views into DDP's all-reduce buckets (kept, see forward_backward): no second
        # gradient-sized buffer, no copy.
        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None, gradient_as_bucket_view=True)
    if hellaswag_examples:
        try:
            hellaswag.check_model(raw_model.config, hellaswag_examples)
        except hellaswag.HellaSwagError as e:  # the same examples on every rank: all skip alike
            log(f"note: skipping HellaSwag: {e}")
            hellaswag_examples = None
    if args.sample_interval and gpt2_vocab_problem(raw_model.config.vocab_size):
        log(f"note: no samples: {gpt2_vocab_problem(raw_model.config.vocab_size)}")
        args.sample_interval = 0
    flops_per_step = raw_model.flops_per_token(args.seq_len) * args.total_batch_size
    peak = peak_flops(device)

    faults = Faults(args.fault, rank)
    bad_steps = 0  # non-finite steps in a row
    with StopSignal() as stop:
        step = start_step
        while True:
            last_step = step >= args.max_steps
            tokens = step * args.total_batch_size

            if master and step > start_step and (last_step or (args.checkpoint_interval and step % args.checkpoint_interval == 0)):
                write_checkpoint(args, raw_model, optimizer, scaler, step, train_loader, log)
            if args.eval_interval and (step % args.eval_interval == 0 or last_step):
                if val_loader is not None:
                    val_loss = estimate_val_loss(model.module if world_size > 1 else model, val_loader, args.val_steps, mixed_precision, device)
                    log(f"step {step:5d} | val loss {val_loss:.4f}")
                    run_log.write(step=step, tokens=tokens, val_loss=val_loss)
                if hellaswag_examples:
                    acc, acc_norm, n = hellaswag_accuracy(raw_model, hellaswag_examples, device, dtype, rank, world_size)
                    log(f"step {step:5d} | hellaswag acc_norm {acc_norm:.4f} ({n} examples)")
                    run_log.write(step=step, tokens=tokens, hellaswag_acc_norm=acc_norm, hellaswag_acc=acc, hellaswag_n=n)
            if master and args.sample_interval and (step % args.sample_interval == 0 or last_step) and step > 0:
                texts = sample_texts(raw_model, device, mixed_precision, seed=args.seed + step)
                log("\n".join(f"sample {i}: {t}" for i, t in enumerate(texts)))
                run_log.write(step=step, tokens=tokens, samples=texts)
            if last_step:
                break

            t0 = time.time()
            faults.before_step(step)
            loss_accum = forward_backward(model, optimizer, train_loader, device, grad_accum_steps, mixed_precision,
                                          scaler, faults.poison)
            loss, norm, stop_requested = agree_on_step(loss_accum, stop.received is not None, raw_model, optimizer,
                                                       scaler, args.grad_clip)
            lr = get_lr(step, args)
            # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that step itself.
            if math.isfinite(loss) and (math.isfinite(norm) or scaler.is_enabled()):
                bad_steps = 0
                for group in optimizer.param_groups:
                    group["lr"] = lr
                scaler.step(optimizer)
                scaler.update()
                dt = time.time() - t0
                mfu = f" | mfu {100 * flops_per_step / dt / (peak * world_size):.1f}%" if peak else ""
                mem = f" | mem {torch.cuda.max_memory_allocated(device) / 2**30:.1f}GiB" if device_type == "cuda" else ""
                log(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
                    f"dt {1000 * dt:.2f}ms | tok/s {args.total_batch_size / dt:.0f}{mfu}{mem}")
                run_log.write(step=step, tokens=tokens, train_loss=loss, lr=lr, grad_norm=norm,
                              dt_ms=1000 * dt, tokens_per_sec=args.total_batch_size / dt)
            else:
                bad_steps += 1
                scaler.update()  # unscale_ ran this step: without an update the next step's unscale_ raises
                log(f"step {step:5d} | skipped: non-finite loss {loss} or grad norm {norm} ({bad_steps} in a row)")
                run_log.write(step=step, tokens=tokens, skipped_step=True, bad_steps=bad_steps)
                if bad_steps >= args.max_bad_steps:
                    raise RunError(f"{bad_steps} steps in a row had a non-finite loss or gradient (last: step {step}); "
                                   f"the newest checkpoint in {args.log_dir} predates them: lower --max_lr or check the data")
            step += 1
            if stop_requested:
                if master:
                    write_checkpoint(args, raw_model, optimizer, scaler, step, train_loader, log)
                log(f"stopping on a signal after step {step}; `--resume auto` continues from here")
                break
    if world_size > 1:
        # The ranks leave together, once rank 0 has written the last checkpoint: no rank reports
        # the run finished while the checkpoint it would resume from is still being written.
        dist.barrier()
    return raw_model


def to_device(t, device):
    # From pinned host memory the copy runs asynchronously, overlapping the GPU's work.
    return t.pin_memory().to(device, non_blocking=True) if device.startswith("cuda") else t.to(device)


def forward_backward(model, optimizer, loader, device, grad_accum_steps, mixed_precision, scaler, poison=None):
    """Gradients of the mean loss over grad_accum_steps micro-batches, all-reduced (under DDP) only
    on the last one: no_sync() covers the forward and backward of the others. Returns the mean
    loss as a device tensor, without waiting for the device."""
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay
    # so. Set to None, each step would allocate a second set and copy it into the buckets.
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = (to_device(t, device) for t in loader.next_batch())
        last = micro_step == grad_accum_steps - 1
        with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
            with mixed_precision:
                _, loss = model(x, y)
            if poison is not None:
                loss = poison(loss)
            loss = loss / grad_accum_steps  # a sum of micro-batch means would be grad_accum_steps too big
            loss_accum += loss.detach()
            scaler.scale(loss).backward()
    return loss_accum


def agree_on_step(loss_accum, stop_requested, raw_model, optimizer, scaler, grad_clip):
    """(mean loss over ranks, gradient norm before clipping to grad_clip, whether any rank was asked
    to stop), with one all-reduce and one wait for the device. Every rank gets the same three: the
    mean is non-finite everywhere if any rank's loss was, and the norm comes from gradients DDP
    already all-reduced. So the decisions taken on them (skip the step, stop) agree across ranks."""
    status = torch.stack([loss_accum, torch.tensor(float(stop_requested), device=loss_accum.device)])
    if dist.is_initialized():
        dist.all_reduce(status)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)
    loss_sum, stop_votes, norm = torch.cat([status, norm.reshape(1)]).tolist()
    return loss_sum / (dist.get_world_size() if dist.is_initialized() else 1), norm, stop_votes > 0


def write_checkpoint(args, raw_model, optimizer, scaler, step, train_loader, log):
    if not torch.stack([p.isfinite().all() for p in raw_model.parameters()]).all():
        raise RunError(f"the weights at step {step} are not finite: not checkpointing them")
    path = checkpoint_path(args.log_dir, step)
    if save_checkpoint(path, training_state(raw_model, optimizer, scaler, step, train_loader, args)):
        prune_checkpoints(args.log_dir, args.keep_last)
        log(f"saved {path}")


def main(argv=None):
    """Runs train() and returns its model; a run error is one line on stderr and exit code 1."""
    args = parse_args(argv)
    try:
        return train(args)
    except (RunError, CheckpointError, ShardError) as e:
        error = str(e)  # only the text: the exception's traceback would keep train()'s DDP wrapper alive
    finally:
        leave_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
