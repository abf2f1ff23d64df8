"""The trainer's settings as one typed config, by concern: what a run trains (the model, the
batch, the schedule and the optimizer), how it is evaluated, how it saves and scales, and how it
runs. train_gpt2.py builds it once, in parse_args, from its flags, the preset and --config; the
flags' long names are its fields' names (the optimizer's aside), and flags() gives them back."""
import math
from dataclasses import asdict, dataclass, fields

from model import GPTConfig
from muon import OptimizerConfig

MODEL_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # GPTConfig's fields that are flags
RUN_FLAGS = ("preset", "config", "data_dir", "log_dir", "init_from", "grad_clip", "plan", "plan_world_size")


@dataclass(frozen=True)
class BatchConfig:
    total_batch_size: int  # tokens per optimizer step, over all ranks
    micro_batch_size: int  # sequences per forward pass per rank
    seq_len: int

    def tokens_per_pass(self, world_size):
        """Tokens of one micro-step: a micro-batch on every rank."""
        return self.micro_batch_size * self.seq_len * world_size

    def grad_accum_steps(self, world_size):
        """Micro-steps per optimizer step."""
        return self.total_batch_size // self.tokens_per_pass(world_size)


@dataclass(frozen=True)
class ScheduleConfig:
    max_steps: int
    warmup_steps: int
    decay_steps: int  # where the cosine reaches min lr (the flag's None: max_steps)
    max_lr: float
    min_lr_ratio: float

    def lr(self, step):
        """Linear warmup to max_lr, cosine decay to min_lr at decay_steps, then flat."""
        max_lr, min_lr = self.max_lr, self.max_lr * self.min_lr_ratio
        if step < self.warmup_steps:
            return max_lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int  # val loss and HellaSwag every N steps and at the end (0: never)
    val_steps: int
    hellaswag: int  # 0 or 1
    hellaswag_path: str | None
    hellaswag_limit: int  # 0: all
    sample_interval: int  # 0: never


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_interval: int  # 0: only at the end
    keep_last: int  # 0: keep all
    async_checkpoint: bool
    resume: str  # auto, none or a path


@dataclass(frozen=True)
class ScaleConfig:
    """What decides a step's memory beyond the model and the batch (memory.plan's levers)."""
    fsdp: int = 0  # 0 or 1
    recompute: str = "none"  # one of model.RECOMPUTE
    recompute_every: int = 1
    chunked_loss: int = 0  # 0 or 1


@dataclass(frozen=True)
class RuntimeConfig:
    device: str
    dtype: str  # a --dtype name: auto, bfloat16, float16, float32
    compile: str  # auto, 1 or 0
    compile_mode: str
    attention: str  # auto, cudnn or math
    seed: int
    shuffle: int  # 0 or 1
    check_data: str  # quick or full
    max_bad_steps: int
    wandb: bool
    wandb_project: str
    tensorboard: bool
    fault: list | None  # faults.Fault, injected on purpose (--fault)


@dataclass(frozen=True)
class TrainConfig:
    preset: str
    config: str | None  # the --config file read after the preset, if any
    data_dir: str
    log_dir: str
    init_from: str  # scratch, or weights to start from (their architecture wins over model)
    model: GPTConfig
    batch: BatchConfig
    schedule: ScheduleConfig
    optimizer: OptimizerConfig
    grad_clip: float  # 0: no clipping
    eval: EvalConfig
    checkpoints: CheckpointConfig
    scale: ScaleConfig
    runtime: RuntimeConfig
    plan: bool  # print the memory plan and exit
    plan_world_size: int | None

    @classmethod
    def from_flags(cls, flags):
        """The config of the flags' values by name (vars() of the parsed flags). ValueError, from
        GPTConfig, for model sizes no GPT can have."""
        if flags["decay_steps"] is None:
            flags = {**flags, "decay_steps": flags["max_steps"]}

        def part(kind):
            return kind(**{f.name: flags[f.name] for f in fields(kind)})
        optimizer = OptimizerConfig(flags["optimizer"], flags["max_lr"], flags["weight_decay"], muon_lr=flags["muon_lr"],
                                    muon_momentum=flags["muon_momentum"], muon_weight_decay=flags["muon_weight_decay"])
        return cls(**{name: flags[name] for name in RUN_FLAGS}, model=GPTConfig(**{n: flags[n] for n in MODEL_FLAGS}),
                   batch=part(BatchConfig), schedule=part(ScheduleConfig), optimizer=optimizer, eval=part(EvalConfig),
                   checkpoints=part(CheckpointConfig), scale=part(ScaleConfig), runtime=part(RuntimeConfig))

    def flags(self):
        """The flags' values by name, as the trainer's parser gives them (--decay_steps resolved):
        what a checkpoint records of its run, and what wandb shows."""
        top = {name: getattr(self, name) for name in RUN_FLAGS}
        model = {name: getattr(self.model, name) for name in MODEL_FLAGS}
        optimizer = {"optimizer": self.optimizer.name, "max_lr": self.optimizer.lr,
                     "weight_decay": self.optimizer.weight_decay, "muon_lr": self.optimizer.muon_lr,
                     "muon_momentum": self.optimizer.muon_momentum,
                     "muon_weight_decay": self.optimizer.muon_weight_decay}
        parts = (self.batch, self.schedule, self.eval, self.checkpoints, self.scale, self.runtime)
        return {**top, **model, **optimizer, **{k: v for part in parts for k, v in asdict(part).items()}}
