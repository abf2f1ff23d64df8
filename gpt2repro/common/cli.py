"""What the scripts' command lines share: errors in one line, config files of flag values
(configs/NAME.toml, the trainer's presets), retired flags and other projects' names for flags, and
the torch version check."""
import argparse
import json
import os
import re
import signal
import sys
import time
import tomllib

from gpt2repro import REPO
from gpt2repro.common.atomic import atomic_open, check_writable
from gpt2repro.common.inputs import UnreadableFile, brief, first_line, read_bytes


CONFIG_DIR = os.path.join(REPO, "configs")


def preset_names():
    """The presets, configs/NAME.toml, by name."""
    return sorted(name[:-len(".toml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".toml"))


def preset_path(name):
    return os.path.join(CONFIG_DIR, f"{name}.toml")


class Retired(argparse.Action):
    """A flag that is gone (add_argument(..., action=Retired, instead=TEXT)): given on the command line,
    or as a config file's key (Parser.config_defaults), it is one usage error saying what to use instead."""

    def __init__(self, option_strings, dest, instead, **kwargs):
        super().__init__(option_strings, dest, **{**kwargs, "nargs": "?", "help": argparse.SUPPRESS})
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message())

    def message(self):
        return f"{self.option_strings[0]} is gone: {self.instead}"


class Renamed(Retired):
    """Another project's flag that this one names otherwise (add_argument(..., action=Renamed, whose="nanoGPT's",
    instead=TEXT)): refused as a Retired one is, the line naming this project's flag."""

    def __init__(self, option_strings, dest, whose, instead, **kwargs):
        super().__init__(option_strings, dest, instead, **kwargs)
        self.whose = whose

    def message(self):
        return f"{self.option_strings[0]} is {self.whose} name; here it is {self.instead}"


class ConfigError(Exception):
    """A config file that cannot be read, or is not TOML."""


# A config file is a few dozen flags: anything longer is another file, named by mistake.
MAX_CONFIG_BYTES = 1 << 20


def read_config(path):
    """The key-value pairs of the TOML file at path: a regular file (a FIFO or /dev/zero would
    never end) of at most MAX_CONFIG_BYTES."""
    try:
        data = read_bytes(path, MAX_CONFIG_BYTES, "not a config file")
    except UnreadableFile as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, not UTF-8, an integer of 4,300+ digits; nested thousands deep
        raise ConfigError(f"{path}: not TOML ({first_line(e)})") from None


# The oldest torch this code runs on (requirements.txt says the same). 2.7 brought the newest
# APIs it uses but one: distribute_tensor(src_data_rank=) (fsdp.py) and DCP's
# _StorageInfo.transform_descriptors (dcp_reader.py). Up to 2.8 gloo's reduce_scatter_tensor sums
# where asked to average (FSDP on a CPU got gradients world-size times too large), and 2.9 brought
# torch.optim.Muon (--optimizer muon): 2.9.
MIN_TORCH = (2, 9)


def torch_release(version):
    """(major, minor) of a torch version (2.13.0+cpu, 2.11.0a0+git1234: a nightly counts as the
    release it leads to), or None if it names none."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    return tuple(map(int, found.groups())) if found else None


def torch_problem(version):
    """The one-line error for a torch version older than MIN_TORCH, or None."""
    if (torch_release(version) or MIN_TORCH) < MIN_TORCH:
        return f"error: this code needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} (found {version}): pip install -U torch"
    return None


def check_torch():
    """Exits with torch_problem's one line if the torch imported is older than MIN_TORCH. Every
    script meets it first thing, through Parser, with torch imported if it uses torch at all: an
    old torch stops there, not in a traceback."""
    torch = sys.modules.get("torch")
    if torch is not None and torch_problem(torch.__version__):
        sys.exit(torch_problem(torch.__version__))


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written; each flag's default after its help, unless the help says it or there is none."""

    def _get_help_string(self, action):
        if action.default is None or "(default:" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (a usage error exits 2, argparse's code; a run error 1), no
    abbreviated flags (a typo such as --n_lay must not pass for --n_layer), and a --help that
    shows each flag's default and the description as written."""

    def __init__(self, *args, formatter_class=HelpWithDefaults, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, allow_abbrev=False, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        check_torch()  # before any flag, even --help, is read
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def fail(self, message):
        self.exit(1, f"{self.prog}: error: {message}\n")

    def exit(self, status=0, message=None):
        if status and message:
            # Under torchrun every rank parses the same flags: their one error line comes from rank 0 alone.
            if int(os.environ.get("RANK", 0)) == 0:
                print_error(message.rstrip("\n"))
            message = None
        super().exit(status, message)

    def config_defaults(self, path, not_keys=()):
        """The values of the config file at path, checked against this parser's flags (its keys are
        their long names without dashes; not_keys are refused), as a dict for set_defaults: flags
        given on the command line still win. Any problem is a usage error naming the file and key."""
        try:
            values = read_config(path)
        except ConfigError as e:
            self.error(str(e))
        flags = {action.dest: action for action in self._actions if action.option_strings}
        for key, value in values.items():
            action = flags.get(key)
            if action is None or key in not_keys or key == "help":
                self.error(f"{path}: unknown key {brief(key)} (not one of the flags' long names)")
            if isinstance(action, Retired):
                self.error(f"{path}: {key}: {action.message()}")
            values[key] = value = as_switch(action, value)
            problem = value_problem(action, value)
            if problem:
                self.error(f"{path}: {key} {problem}")
        return {key: float(value) if flags[key].type is float else value for key, value in values.items()}

    def refuse_to_replace(self, path, state):
        """The one-line exit for an output path that holds something (state: how, "exists") that
        the script would replace: only its --force replaces it."""
        self.fail(f"{path} {state} (use --force to replace it)")

    def write_json(self, path, value, printed="the result is above"):
        """value as --json's file at path, whole or not at all; a disk that filled while the script
        worked is one line, which says where the value was printed already."""
        try:
            with atomic_open(path, "w") as f:
                json.dump(value, f, indent=1)
                f.write("\n")
        except OSError as e:
            self.fail(f"--json {path}: cannot write it ({e.strerror}); {printed}")

    def check_output(self, flag, path):
        """A one-line exit unless path can be written: found out before the work, not after it."""
        try:
            check_writable(path)
        except OSError as e:
            self.fail(f"{flag} {path}: cannot write there ({e.strerror})")


def print_error(line):
    """line, a run's one-line error, where the user looks: on stderr, and in torchrun's summary."""
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)


# 128 + SIGINT: the exit code a shell gives a command that a Ctrl-C ended.
INTERRUPTED = 130


def exit_on_ctrl_c():
    """Makes a Ctrl-C (SIGINT) end the script with one line on stderr and exit code INTERRUPTED, not
    a KeyboardInterrupt traceback, until a handler of the script's own replaces this one (the
    trainer's StopSignal, fineweb.py's). Every script a user runs calls it first thing, run as a
    script, before the seconds that importing torch takes. The with and finally blocks that the
    exit leaves run as they would for the traceback: a file being written is removed, not left half-written."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a job started in the background: ignored it stays
        return
    script = os.path.basename(sys.argv[0])

    def interrupted(signum, frame):
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank hears it: rank 0 says it
            os.write(2, f"{script}: interrupted\n".encode())  # not print: the signal may have come mid-print
        sys.exit(INTERRUPTED)
    signal.signal(signal.SIGINT, interrupted)


def tell_torchrun(line):
    """Under torchrun, line in the error file its agent reads (TORCHELASTIC_ERROR_FILE, in the
    format of torch.distributed.elastic's ErrorHandler), whose message torchrun's summary of the
    failed ranks shows as the root cause, in place of a pointer to torch's docs. Nothing elsewhere."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    # The root cause is the failure of the earliest time. A second early: a rank that exits within
    # the same second without a file of its own is stamped with that second by the agent.
    stamped = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()) - 1)}}}
    try:
        with open(error_file, "w") as f:
            json.dump(stamped, f)
    except OSError:  # the line is on stderr all the same
        pass


def as_switch(action, value):
    """A switch's value as its flag takes it: TOML's true and false, and 1 and 0, for a flag of
    choices 0 and 1 or of "1" and "0" (--compile auto|1|0); any other value as it is."""
    on_off = isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if on_off and action.choices is not None and {"1", "0"} <= set(action.choices):
        return str(int(value))
    if on_off and action.choices is not None and set(action.choices) == {0, 1}:
        return int(value)
    return value


# A config file's string is at most a path, which Linux bounds at 4,096 bytes (PATH_MAX): a longer
# one is a mistake, which messages would otherwise echo whole.
MAX_VALUE_CHARS = 4096


def value_problem(action, value):
    """Why value (read from a config file) cannot be action's, or None."""
    if type(value) is str and len(value) > MAX_VALUE_CHARS:
        return f"is {brief(value)}, longer than any flag's value ({MAX_VALUE_CHARS:,} characters at most)"
    if isinstance(action, argparse._StoreTrueAction):
        expected = bool
    elif action.type in (int, float):
        expected = (int, float) if action.type is float else int
    elif action.type is None and action.nargs is None and isinstance(action, argparse._StoreAction):
        expected = str
    elif isinstance(action, argparse._StoreAction) and type(value) in (int, str):  # a type of its own, such as -B's
        try:
            action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            return f"must be what --{action.dest} takes: {e}"
        return None
    else:
        return "cannot be set in a config file"
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        names = {bool: "true or false", int: "an integer", str: "a string"}
        return f"must be {names.get(expected, 'a number')}, not {brief(value)}"
    if action.type is float and type(value) is int and abs(value) > sys.float_info.max:  # compared exactly
        return "is too large for a float"
    if isinstance(value, str) and "\0" in value:  # TOML can hold one, a command line cannot, nor a path
        return "must not hold a NUL character"
    if action.choices is not None and value not in action.choices:
        return f"must be one of {', '.join(map(str, action.choices))}, not {brief(value)}"
    return None
