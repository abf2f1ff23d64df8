"""What the scripts' command lines share: errors in one line, config files of flag values
(configs/NAME.toml, the trainer's presets), bounded reads of the text files a user names, and
the progress of long jobs."""
import argparse
import json
import os
import re
import stat
import sys
import time
import tomllib
from dataclasses import field

from tqdm import tqdm

from atomic import check_writable, file_kind
from tokenizer import N_VOCAB


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def preset_names():
    """The presets, configs/NAME.toml, by name."""
    return sorted(name[:-len(".toml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".toml"))


def preset_path(name):
    return os.path.join(CONFIG_DIR, f"{name}.toml")


def setting(default, help, **flag):
    """A config's field that is also a flag (train_config.add_flags): its default, its help, and
    argparse's other keywords where its type says too little (choices, metavar; short="-B" adds a
    short form, flag="NAME" names the flag other than the field)."""
    return field(default=default, metadata={"help": help, **flag})


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


def check_positive(config, *names):
    """ValueError naming the first of config's fields names that is not above 0 (a NaN is not)."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"--{name} must be positive, not {getattr(config, name)}")


def check_not_negative(config, *names):
    for name in names:
        if not getattr(config, name) >= 0:
            raise ValueError(f"--{name} must not be negative, not {getattr(config, name)}")


class ConfigError(Exception):
    """A config file that cannot be read, or is not TOML."""


# A config file is a few dozen flags: anything longer is another file, named by mistake.
MAX_CONFIG_BYTES = 1 << 20


def read_config(path):
    """The key-value pairs of the TOML file at path: a regular file (a FIFO or /dev/zero would
    never end) of at most MAX_CONFIG_BYTES."""
    try:
        with open_regular(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except UnreadableFile as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES:,} bytes: not a config file")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, not UTF-8, an integer of 4,300+ digits; nested thousands deep
        raise ConfigError(f"{path}: not TOML ({first_line(e)})") from None


# The oldest torch this code runs on (requirements.txt says the same). 2.7 brought the newest
# APIs it uses but one: distribute_tensor(src_data_rank=) (sharding.py) and DCP's
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
        # Under torchrun every rank parses the same flags: their one error line comes from rank 0 alone.
        super().exit(status, message if int(os.environ.get("RANK", 0)) == 0 else None)

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

    def check_output(self, flag, path):
        """A one-line exit unless path can be written: found out before the work, not after it."""
        try:
            check_writable(path)
        except OSError as e:
            self.fail(f"{flag} {path}: cannot write there ({e.strerror})")


def first_line(error):
    """An exception's message as one line (its type's name if it has none), for one-line errors."""
    return " ".join(str(error).split()) or type(error).__name__


def gpt2_vocab_problem(vocab_size):
    """Why a model of vocab_size cannot read or write GPT-2's token ids, or None if it can."""
    if vocab_size < N_VOCAB:
        return f"a vocabulary of {vocab_size} cannot hold GPT-2's {N_VOCAB} token ids"
    return None


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


def brief(value):
    """value, read from a user's file, as text of bounded length for a message: a string as written
    (past 100 characters, its first 40 and its length), a machine-sized number as written, anything
    else by its type (a shared nested list can be cheap to read and endless to print)."""
    if type(value) is str and len(value) > 100:
        return f"{value[:40]!r}... ({len(value):,} characters)"
    if type(value) in (str, bool, float, type(None)) or (type(value) is int and abs(value) < 1 << 64):
        return repr(value)
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def parse_json(text):
    """json.loads(text), but JSON nested past Python's recursion limit is a ValueError, as any
    other text that is not JSON, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep for Python's parser") from None


PLAIN_TYPES = (str, int, float, bool, type(None))


def structure_problem(value, max_depth, leaves=PLAIN_TYPES, max_values=1 << 18):
    """Why value, decoded from a user's file (a checkpoint's plain data, a line of JSON), cannot be
    walked, compared or printed at a bounded cost, or None: it must be dicts (of string or integer
    keys), lists and tuples nested at most max_depth deep (a dict of numbers is 1 deep), max_values
    values in all, their other values of the types leaves. A shared nest (x = [x, x] sixty times)
    is a few hundred bytes to read and 2**60 values to walk: the walk stops at the first problem,
    after max_values steps at most."""
    seen = 0

    def walk(v, depth):
        nonlocal seen
        seen += 1
        if seen > max_values:
            return f"holds more than {max_values:,} values"
        if not isinstance(v, (dict, list, tuple)):
            return None if isinstance(v, leaves) else f"holds {brief(v)}"
        if depth == max_depth:
            return f"is nested more than {max_depth} deep"
        if isinstance(v, dict):
            key = next((k for k in v if type(k) not in (str, int)), None)
            if key is not None:
                return f"has a key that is {brief(key)}, not a string or a number"
            v = v.values()
        return next(filter(None, (walk(item, depth + 1) for item in v)), None)
    return walk(value, 0)


# A line of a user's text file (for sample.py --prompt @FILE, the whole file) holds at most this
# many characters: 4x what GPT-2's whole context can hold (1,024 tokens of at most 128 bytes),
# hundreds of HellaSwag examples. A longer one is a mistake (a binary file, one with no line
# breaks), refused before it fills the memory or reaches the tokenizer (whose regex fails at 1M spaces).
MAX_LINE_CHARS = 1 << 19


class UnreadableFile(ValueError):
    """A user's file that cannot be read as asked: not a regular file, or a text line too long.
    The message starts with the file's path, as given, and names the line where there is one."""


def open_regular(path, mode="r", **open_args):
    """open(path, mode, **open_args) if path is a regular file, UnreadableFile naming its kind if
    not (a FIFO would wait for a writer, /dev/zero never ends), else OSError. The kind is asked of
    the opened file, so nothing can be swapped in between."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # so that a FIFO opens at once, to be refused
    try:
        mode_bits = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode_bits):
            raise UnreadableFile(f"{path}: {file_kind(mode_bits)}, "
                                f"not a regular file")
        return open(fd, mode, **open_args)
    except BaseException:
        os.close(fd)
        raise


def read_text(path, max_chars=MAX_LINE_CHARS):
    """The whole file, as is (\r\n stays \r\n); UnreadableFile past max_chars characters (only
    max_chars + 1 are read), else as open_regular, or UnicodeDecodeError."""
    with open_regular(path, encoding="utf-8", newline="") as f:
        text = f.read(max_chars + 1)
    if len(text) > max_chars:
        raise UnreadableFile(f"{path}: more than {max_chars:,} characters")
    return text


def read_lines(path, max_chars=MAX_LINE_CHARS):
    """Yields (number from 1, line without its line break) for each line (ended by \n, \r\n or
    \r; a last line break ends the last line); UnreadableFile at a line of more than max_chars
    characters (no more of it is read), else as open_regular, or UnicodeDecodeError."""
    with open_regular(path, encoding="utf-8") as f:
        number = 0
        while line := f.readline(max_chars + 1):  # + 1: a line of max_chars and its line break
            number += 1
            line = line.removesuffix("\n")
            if len(line) > max_chars:
                raise UnreadableFile(f"{path} line {number}: more than {max_chars:,} characters")
            yield number, line


# Seconds between plain progress lines: a log (nohup, SLURM) shows that a job of hours lives,
# without a line a second.
PROGRESS_EVERY = 60


def progress_meter(desc, unit, total=None, initial=0, scale=False, disable=False):
    """The progress of a long job, on stderr: tqdm's bar where stderr is a terminal, else a plain
    line every PROGRESS_EVERY seconds (ProgressLines). Both take update(n), set_postfix(**values)
    and close(). total: None where unknown (no time left is shown); scale: 1.2M rather than 1,200,000."""
    if disable or sys.stderr.isatty():
        return tqdm(total=total, unit=unit, desc=desc, initial=initial, unit_scale=scale, disable=disable)
    return ProgressLines(desc, unit, total, initial, scale)


class ProgressLines:
    """progress_meter() where no terminal shows a bar: lines such as
    `hellaswag: 2,400/10,042 ex (24%), 41.3 ex/s, 03:05 left, acc_norm=0.2950`."""

    def __init__(self, desc, unit, total, initial, scale):
        self.desc, self.unit, self.total, self.scale = desc, unit, total, scale
        self.start, self.done = initial, initial
        self.postfix = {}
        self.t0 = self.last = time.monotonic()

    def update(self, n=1):
        self.done += n
        if time.monotonic() - self.last >= PROGRESS_EVERY:
            self.write()

    def set_postfix(self, refresh=True, **values):
        self.postfix = values

    def close(self):
        if self.last != self.t0:  # the log ends at where the job ended, once it has shown any line
            self.write()

    def write(self):
        self.last = time.monotonic()
        rate = (self.done - self.start) / max(self.last - self.t0, 1e-9)
        count = self.number(self.done)
        if self.total:
            count += f"/{self.number(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            count += f" {self.unit}"
        parts = [count, f"{self.number(rate)} {self.unit}/s"]
        if self.total and self.done < self.total and rate > 0:
            parts.append(f"{tqdm.format_interval((self.total - self.done) / rate)} left")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        print(f"{self.desc}: {', '.join(parts)}", file=sys.stderr, flush=True)

    def number(self, x):
        return tqdm.format_sizeof(x) if self.scale else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}".removesuffix(".0")
