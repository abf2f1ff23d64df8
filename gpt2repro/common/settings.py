"""How a setting is declared and checked: a dataclass field that is also a flag (setting), and the
checks its config's __post_init__ runs. The configs (model.GPTConfig, optimizers.OptimizerConfig,
train_config's parts) declare their fields with these; train_config.add_flags makes the flags."""
from dataclasses import field


def setting(default, help, **flag):
    """A config's field that is also a flag (train_config.add_flags): its default, its help, and
    argparse's other keywords where its type says too little (choices, metavar; short="-B" adds a
    short form, flag="NAME" names the flag other than the field)."""
    return field(default=default, metadata={"help": help, **flag})


def check_positive(config, *names):
    """ValueError naming the first of config's fields names that is not above 0 (a NaN is not)."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"--{name} must be positive, not {getattr(config, name)}")


def check_not_negative(config, *names):
    for name in names:
        if not getattr(config, name) >= 0:
            raise ValueError(f"--{name} must not be negative, not {getattr(config, name)}")
