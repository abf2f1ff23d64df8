"""The trainer's settings, each declared once: a field of a typed config below, with its default,
its help and, in its class's __post_init__, its check. TrainConfig() is the GPT-2 (124M) recipe.

train_gpt2.py's command line is made from these fields (add_flags): a field with help is the flag
--NAME (metadata "flag" names another, "short" adds one such as -B), of its annotated type, in a
group of its section. A preset, a --config file and the flags override the defaults, in that order.
To add a setting, add a field here (or to GPTConfig or OptimizerConfig, which own theirs) with
setting(default, help), and check it in __post_init__: the flag, --help, config files, the
checkpoint's record of the run (flags()) and from_flags follow."""
import argparse
import math
import os
import types
from dataclasses import dataclass, field, fields, is_dataclass
from fractions import Fraction

from gpt2repro import REPO
from gpt2repro.common.cli import Parser, Renamed, Retired, preset_names, preset_path
from gpt2repro.common.inputs import brief
from gpt2repro.common.settings import check_not_negative, check_positive, setting
from gpt2repro.lm.loss import LOSSES
from gpt2repro.lm.tokenizer import PADDED_VOCAB
from gpt2repro.training.faults import fault_problem, parse_fault
from gpt2repro.training.optimizers import OptimizerConfig
from model import RECOMPUTE, GPTConfig

PRESETS = preset_names()
REPOSITORY_PATHS = ("data_dir", "hellaswag_path", "core_path")  # in a preset, relative to the repository: its bundled files
AUTO_MAX_MICRO_BATCH = 64  # -B auto's ceiling: the 124M recipe's micro-batch (past it a GPU gains little)


def parse_micro_batch(text):
    """-B's type: a number of sequences, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{brief(text)} is neither a number of sequences nor auto") from None


@dataclass(frozen=True)
class BatchConfig:
    """The tokens of an optimizer step, and how each rank cuts them into micro-batches."""
    total_batch_size: int = setting(524288, "tokens per optimizer step, over all ranks")
    micro_batch_size: int | str = setting("auto", f"sequences per forward pass per rank; auto: the largest power of "
                                                  f"two up to {AUTO_MAX_MICRO_BATCH} that divides the step and whose "
                                                  f"memory plan fits a GPU's free memory or, on a CPU, the host's "
                                                  f"available memory (halved again if a step runs out of memory); "
                                                  f"on MPS the largest that divides the step", short="-B",
                                          type=parse_micro_batch,
                                          metavar="N|auto")
    seq_len: int = setting(1024, "tokens per sequence", short="-T")

    def __post_init__(self):
        check_positive(self, "total_batch_size", "seq_len", *([] if self.micro_batch_size == "auto" else
                                                              ["micro_batch_size"]))

    def auto_micro_batches(self, world_size):
        """-B auto's candidates, largest first: the powers of two up to AUTO_MAX_MICRO_BATCH that
        divide the sequences a rank takes per optimizer step (none if T*world_size does not divide it)."""
        sequences, rest = divmod(self.total_batch_size, self.seq_len * world_size)
        return [] if rest else [2**k for k in reversed(range(AUTO_MAX_MICRO_BATCH.bit_length()))
                                if 2**k <= AUTO_MAX_MICRO_BATCH and sequences % 2**k == 0]


def split_problem(tokens_per_step, micro_batch, seq_len, world_size=1):
    """Why tokens_per_step tokens cannot be cut into micro-steps of micro_batch sequences (auto: any
    number) of seq_len on each of world_size ranks, or None; the message suggests a total that can."""
    auto = micro_batch == "auto"
    tokens_per_pass = seq_len * world_size * (1 if auto else micro_batch)
    if tokens_per_step % tokens_per_pass == 0:
        return None
    # Rounded as a fraction, not a float: a float overflows at absurd sizes.
    suggestion = max(1, round(Fraction(tokens_per_step, tokens_per_pass))) * tokens_per_pass
    if auto:
        return (f"-B auto: --total_batch_size {tokens_per_step} is not a multiple of T*world_size = "
                f"{seq_len}*{world_size} = {tokens_per_pass}, so no micro-batch divides it; "
                f"try --total_batch_size {suggestion}")
    return (f"--total_batch_size {tokens_per_step} is not a multiple of B*T*world_size = "
            f"{micro_batch}*{seq_len}*{world_size} = {tokens_per_pass}; try --total_batch_size {suggestion} or another -B")


def seq_len_problem(seq_len, block_size, whose="--block_size"):
    """Why sequences of seq_len tokens cannot run through a model of block_size positions, or None."""
    return f"--seq_len {seq_len} is longer than {whose} {block_size}" if seq_len > block_size else None


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning rate's linear warmup and cosine decay, from the optimizer's peak lr (--max_lr)."""
    max_steps: int = setting(19073, "optimizer steps in the run (0: train nothing, evaluate the starting point and exit)")
    warmup_steps: int = setting(715, "steps of linear lr warmup")
    decay_steps: int | None = setting(None, "step at which the cosine reaches min lr (default: max_steps)")
    min_lr_ratio: float = setting(0.1, "min lr as a fraction of max lr")

    def __post_init__(self):
        if self.decay_steps is None:  # the flag's default: the decay spans the run
            object.__setattr__(self, "decay_steps", self.max_steps)
        check_not_negative(self, "max_steps", "warmup_steps", "decay_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")

    def lr(self, step, max_lr):
        """Linear warmup to max_lr, cosine decay to max_lr * min_lr_ratio at decay_steps, then flat."""
        min_lr = max_lr * self.min_lr_ratio
        if step < self.warmup_steps:
            return max_lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@dataclass(frozen=True)
class EvalConfig:
    """Val loss, HellaSwag, CORE and samples during the run."""
    eval_interval: int = setting(250, "val loss and HellaSwag every N steps and at the end (0: never)")
    val_steps: int = setting(20, "micro-batches per val loss")
    hellaswag: int = setting(1, "HellaSwag acc_norm at every eval", choices=[0, 1])
    hellaswag_path: str | None = setting(None, "local HellaSwag jsonl (default: download the val split once)")
    hellaswag_limit: int = setting(0, "score only the first N examples (0: all)")
    core_interval: int = setting(2000, "CORE (core_eval.py) every N steps and at the end (0: never); skipped with a "
                                       "note where its bundle is missing")
    core_path: str | None = setting(None, "the CORE eval bundle (default: eval_bundle/ beside core_eval.py, which "
                                          "`python core_eval.py --download_only` fills)")
    core_limit: int = setting(500, "CORE examples per task, the first of each task's shuffled order (nanochat's 500 "
                                   "while training; 0: all)")
    sample_interval: int = setting(250, "print samples every N steps and at the end (0: never)")

    def __post_init__(self):
        check_positive(self, "val_steps")
        check_not_negative(self, "eval_interval", "hellaswag_limit", "core_interval", "core_limit", "sample_interval")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, and where a run resumes."""
    checkpoint_interval: int = setting(5000, "checkpoint every N steps and at the end (0: only at the end; -1: "
                                             "never, not even on a stop signal: a benchmark's run)")
    keep_last: int = setting(0, "keep only the newest N checkpoints (0: keep all)")
    async_checkpoint: bool = setting(False, "with --fsdp 1, write checkpoints in the background while training goes on")
    resume: str = setting("auto", "auto: newest checkpoint in log_dir, if any; none: start over; or a checkpoint path")

    def __post_init__(self):
        check_not_negative(self, "keep_last")
        if self.checkpoint_interval < -1:
            raise ValueError(f"--checkpoint_interval must be -1 (never), 0 (at the end) or more, not "
                             f"{self.checkpoint_interval}")


@dataclass(frozen=True)
class ScaleConfig:
    """What a step trades for memory beyond the model and the batch: sharding over the ranks, and
    recomputing in the backward pass (memory.plan's levers, with the loss's kind)."""
    fsdp: int = setting(0, "shard parameters, gradients and AdamW's state over the ranks (FSDP2), for models that do "
                           "not fit under DDP; checkpoints are then sharded directories", choices=[0, 1])
    recompute: str = setting("none", "recompute in the backward pass instead of keeping activations: the whole block, "
                                     "its attention sublayer, or only SDPA's core (less memory, more compute)",
                             choices=RECOMPUTE)
    recompute_every: int = setting(1, "recompute in every Nth block only (1: all)")

    def __post_init__(self):
        check_positive(self, "recompute_every")


# The flags --loss replaced, and what each meant at 1: refused in one line naming --loss, on a command
# line or in a config file (cli.Retired). A checkpoint's record of them is its run's history, as every
# flag of its record but the hyperparameters: a resumed run computes the loss as its own --loss says.
RETIRED_FLAGS = {"chunked_loss": "--loss chunked", "fused_loss": "--loss fused"}
# The flags of nanoGPT's train.py, and the settings of build-nanogpt's train_gpt2.py (it takes no flags,
# but its names are the ones its readers know), that this trainer names otherwise: (whose, what is here),
# each refused in one line naming this trainer's flag (cli.Renamed), as --name, --name=value or a config key.
NANOGPT, BUILD_NANOGPT = "nanoGPT's", "build-nanogpt's"
ACCUMULATION = "--total_batch_size, tokens per step (-B x -T x ranks x the micro-steps it takes)"
OTHER_PROJECTS_FLAGS = {
    "batch_size": (NANOGPT, "-B/--micro_batch_size (sequences per forward pass per rank)"),
    "gradient_accumulation_steps": (NANOGPT, ACCUMULATION),
    "grad_accum_steps": (BUILD_NANOGPT, ACCUMULATION),
    "learning_rate": (NANOGPT, "--max_lr"),
    "min_lr": (f"{NANOGPT} and {BUILD_NANOGPT}", "--min_lr_ratio, a fraction of --max_lr (6e-5 of 6e-4: 0.1)"),
    "decay_lr": (NANOGPT, "--min_lr_ratio (1: no decay)"),
    "max_iters": (NANOGPT, "--max_steps"),
    "warmup_iters": (NANOGPT, "--warmup_steps"),
    "lr_decay_iters": (NANOGPT, "--decay_steps"),
    "eval_iters": (NANOGPT, "--val_steps"),
    "val_loss_steps": (BUILD_NANOGPT, "--val_steps"),
    "eval_only": (NANOGPT, "--max_steps 0 (evaluate the starting point, then exit)"),
    "out_dir": (NANOGPT, "--log_dir"),
    "dataset": (NANOGPT, "--data_dir (a directory of token shards, from fineweb.py)"),
    "always_save_checkpoint": (NANOGPT, "--checkpoint_interval (every N steps and at the end)"),
    "wandb_log": (NANOGPT, "--wandb"),
    "use_compile": (BUILD_NANOGPT, "--compile"),
}


@dataclass(frozen=True)
class RuntimeConfig:
    """Device, precision, compile, kernels (attention's, the loss's), seeds, data checks, logging, and
    faults injected on purpose. Each auto here is settled on the device the run takes."""
    device: str = setting("auto", "auto (cuda, else mps, else cpu), cpu, cuda, cuda:K (one process only: under "
                                  "torchrun each takes cuda:LOCAL_RANK), mps")
    dtype: str = setting("auto", "autocast dtype; auto: bfloat16 on CUDA from Ampere on, float16 with loss scaling "
                                 "before, else float32", choices=["auto", "bfloat16", "float16", "float32"])
    compile: str = setting("auto", "torch.compile the model; auto: on for CUDA", choices=["auto", "1", "0"])
    compile_mode: str = setting("default", "torch.compile's mode: max-autotune tries more kernels, minutes longer to "
                                           "compile", choices=["default", "max-autotune-no-cudagraphs"])
    attention: str = setting("auto", "SDPA's kernel: auto (torch's choice: flash attention on recent GPUs), cuDNN's, "
                                     "or the math reference", choices=["auto", "cudnn", "math"])
    loss_kind: str = setting("auto", "how the loss is computed, the same loss each way (loss.py): masked, the logits "
                                     "whole; chunked or fused, a chunk of positions at a time with torch's or Triton's "
                                     "row kernel, never the (B*T, vocab) logits (less memory); auto: fused on CUDA where "
                                     "Triton imports, else masked (loss.pick_loss)", flag="loss",
                             choices=("auto",) + LOSSES)
    seed: int = setting(1337, "seeds the init, the data order and the samples")
    shuffle: int = setting(1, "from the second epoch on, permute the shards and the windows within them (the first is "
                              "in file order)", choices=[0, 1])
    check_data: str = setting("quick", "before training, check every shard's header and token ids: quick samples the "
                                       "ids, full reads them all", choices=["quick", "full"])
    max_bad_steps: int = setting(5, "stop after this many non-finite steps in a row")
    wandb: bool = setting(False, "also log to Weights & Biases (needs wandb)")
    wandb_project: str = setting("gpt2-reproduction", "the wandb project of --wandb")
    tensorboard: bool = setting(False, "also log to TensorBoard, in log_dir/tensorboard (needs tensorboard)")
    fault: list | None = setting(None, "for tests of fault tolerance: nan (poison the loss), sigterm or sigkill "
                                       "(signal itself) at STEP, on RANK or all", type=parse_fault, action="append",
                                 metavar="KIND@STEP[:RANK]")

    def __post_init__(self):
        check_positive(self, "max_bad_steps")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), numpy's range, not {self.seed}")


@dataclass(frozen=True)
class TrainConfig:
    """A training run: where its files are, and its settings by concern."""
    preset: str = setting("gpt2", f"a named recipe, configs/NAME.toml, whose values become the defaults: "
                                  f"{', '.join(PRESETS)}", choices=PRESETS, metavar="NAME")
    config: str | None = setting(None, "a TOML file of the same form as a preset's (keys: the flags' long names "
                                       "without dashes), read after the preset; flags given on the command line "
                                       "override both", metavar="FILE")
    data_dir: str = setting("edu_fineweb10B", "directory of *_train_*.npy and *_val_*.npy shards")
    log_dir: str = setting("log", "log.jsonl and checkpoints go here")
    init_from: str = setting("scratch", "scratch (random init), or the weights of gpt2 ... gpt2-xl, a Hugging Face "
                                        "GPT-2 directory or a checkpoint (weights only: a fresh optimizer at step 0); "
                                        "their architecture overrides the model flags")
    plan: bool = setting(False, "print the estimated memory per GPU (or device) of this run, on the device and in the "
                                "dtype it would take, then exit: no data, device or log_dir is touched")
    plan_world_size: int | None = setting(None, "the ranks --plan assumes (default: torchrun's, else 1)")
    gpu_memory: float | None = setting(None, "with --plan: the GiB of the GPU to plan for, one this machine may lack "
                                             "(-B auto picks for it)", metavar="GIB")
    # The recipe pads GPT-2's 50,257 token rows to 50,304, a multiple of 128, for faster matmuls.
    model: GPTConfig = field(default_factory=lambda: GPTConfig(vocab_size=PADDED_VOCAB))
    batch: BatchConfig = field(default_factory=BatchConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self):
        if self.plan_world_size is not None and self.plan_world_size < 1:  # 0 would read as torchrun's, or 1
            raise ValueError(f"--plan_world_size must be positive, not {self.plan_world_size}")
        if self.gpu_memory is not None and not self.gpu_memory > 0:
            raise ValueError(f"--gpu_memory must be positive, not {self.gpu_memory}")
        if self.gpu_memory is not None and not self.plan:
            raise ValueError("--gpu_memory plans for a GPU this run does not take: it needs --plan")
        if not self.schedule.max_steps and not self.eval.eval_interval:
            raise ValueError("--max_steps 0 only evaluates: it needs --eval_interval above 0")
        if problem := seq_len_problem(self.batch.seq_len, self.model.block_size):
            raise ValueError(problem)
        if self.checkpoints.async_checkpoint and not self.scale.fsdp:
            raise ValueError("--async_checkpoint writes sharded checkpoints: it needs --fsdp 1")
        if problem := fault_problem(self.runtime.fault, range(self.schedule.max_steps)):
            raise ValueError(problem)

    def world_size_problem(self, world_size):
        """Why this run cannot split its batch over world_size ranks, or inject a --fault on a rank
        it names, or None."""
        batch = self.batch
        return (fault_problem(self.runtime.fault, range(self.schedule.max_steps), world_size)
                or split_problem(batch.total_batch_size, batch.micro_batch_size, batch.seq_len, world_size))

    @classmethod
    def from_flags(cls, values):
        """The config of the flags' values by name (vars() of the parsed flags, or flags()).
        ValueError, naming the flag, for a value its section's check refuses."""
        return build(cls, values)

    def flags(self):
        """The flags' values by name, as the trainer's parser gives them (--decay_steps resolved):
        what a checkpoint records of its run, and what wandb shows."""
        return {flag_name(f): value for f, value in flag_values(self)}


# ----------------------------------------------------------------------------- the command line

def build_parser(add_help=True, description=None):
    """The trainer's flags: one per setting of TrainConfig; description, --help's text."""
    parser = Parser(description=description, add_help=add_help)
    add_flags(parser)
    return parser


def parse_args(argv=None, description=None):
    """The run's TrainConfig: TrainConfig()'s defaults, under the preset's values, under --config's,
    under the flags (argv, default the command line's); description: --help's text."""
    # A preset's and a config's values become defaults, so flags given on the command line still
    # win, and --help shows them. They are named first, to a parser that leaves --help for later.
    named = build_parser(add_help=False).parse_known_args(argv)[0]
    parser = build_parser(description=description)
    preset = parser.config_defaults(preset_path(named.preset), not_keys=("preset", "config"))
    for key in REPOSITORY_PATHS:
        if key in preset:
            preset[key] = os.path.join(REPO, preset[key])
    parser.set_defaults(**preset)
    if named.config is not None:
        parser.set_defaults(**parser.config_defaults(named.config, not_keys=("preset", "config")))
    try:
        return TrainConfig.from_flags(vars(parser.parse_args(argv)))
    except ValueError as e:  # a section's own check
        parser.error(str(e))


def flag_name(f):
    return f.metadata.get("flag", f.name)


def sections(kind):
    """(field, its section's class or None) of each field of a config class, in order: a section
    is a config within the config (TrainConfig.batch, .schedule, ...), one argument group."""
    for f in fields(kind):
        default = f.default_factory() if callable(f.default_factory) else f.default
        yield f, type(default) if is_dataclass(default) else None


def flag_values(config):
    """(field, value) of each flag of config, its sections' included, in declaration order."""
    for f, section in sections(type(config)):
        if section is not None:
            yield from flag_values(getattr(config, f.name))
        elif "help" in f.metadata:
            yield f, getattr(config, f.name)


def build(kind, values):
    """A kind (TrainConfig or one of its sections) of the flags' values by name. Every float is
    finite: inf would train on, to fail only at the end."""
    kwargs = {}
    for f, section in sections(kind):
        if section is not None:
            kwargs[f.name] = build(section, values)
        elif "help" in f.metadata:
            value = values[flag_name(f)]
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{flag_name(f)} must be a finite number, not {value}")
            kwargs[f.name] = value
    try:
        return kind(**kwargs)
    except ValueError as e:  # GPTConfig names its fields plainly: they are a checkpoint's too
        raise ValueError(str(e) if str(e).startswith("-") else f"--{e}") from None


def add_flags(parser, config=None):
    """The flags of a TrainConfig's fields, config's values (default: TrainConfig()) their defaults,
    in one argument group per section; and the retired flags and other projects' names, each refused
    in one line."""
    config = TrainConfig() if config is None else config
    for name, meant in RETIRED_FLAGS.items():
        parser.add_argument(f"--{name}", action=Retired, instead=f"the loss is one setting, --loss "
                                                                 f"{'|'.join(('auto',) + LOSSES)}; --{name} 1 was {meant}")
    for name, (whose, instead) in OTHER_PROJECTS_FLAGS.items():
        parser.add_argument(f"--{name}", action=Renamed, whose=whose, instead=instead)
    for f, section in sections(type(config)):
        if section is not None:
            group = parser.add_argument_group(f.name, " ".join(section.__doc__.split()).split(". ")[0].rstrip("."))
            for sub, value in flag_values(getattr(config, f.name)):
                add_flag(group, sub, value)
        elif "help" in f.metadata:
            add_flag(parser, f, getattr(config, f.name))


def add_flag(parser, f, value):
    default = None if f.default is None else value  # a None default stays None: __post_init__ derives it
    options = {k: v for k, v in f.metadata.items() if k not in ("flag", "short")}
    names = [f.metadata["short"]] if "short" in f.metadata else []
    kind = f.type.__args__[0] if isinstance(f.type, types.UnionType) else f.type  # int | None: int
    if kind is bool:
        options["action"] = "store_true"
    elif "action" not in options and "type" not in options and kind in (int, float):
        options["type"] = kind
    parser.add_argument(*names, f"--{flag_name(f)}", default=default, **options)

