"""What the scripts' command lines share: errors in one line, a model loaded onto a device, and
bounded reads of the text files a user names."""
import argparse
import os
import stat

from atomic import check_writable
from tokenizer import N_VOCAB


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a usage error exits 2 (argparse's code), a run error 1."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def fail(self, message):
        self.exit(1, f"{self.prog}: error: {message}\n")

    def check_output(self, flag, path):
        """A one-line exit unless path can be written: found out before the work, not after it."""
        try:
            check_writable(path)
        except OSError as e:
            self.fail(f"{flag} {path}: cannot write there ({e.strerror})")


def gpt2_vocab_problem(vocab_size):
    """Why a model of vocab_size cannot read or write GPT-2's token ids, or None if it can."""
    if vocab_size < N_VOCAB:
        return f"a vocabulary of {vocab_size} cannot hold GPT-2's {N_VOCAB} token ids"
    return None


def load_model_onto(parser, name, device="cpu"):
    """(model in eval mode, device) for anything load_model takes, or a one-line exit: a device
    this machine lacks, a model that cannot be loaded, one that cannot hold GPT-2's token ids."""
    from checkpoint import CheckpointError, load_model  # here, so that fineweb.py's parser needs no torch
    from devices import pick_device
    try:
        device = pick_device(device)
    except ValueError as e:
        parser.fail(f"--device {device}: {e}")
    try:
        # Read on the CPU: a training checkpoint also holds AdamW's moments, twice the model's size.
        model = load_model(name)
    except CheckpointError as e:
        parser.fail(str(e))
    problem = gpt2_vocab_problem(model.config.vocab_size)
    if problem:
        parser.fail(f"{name}: {problem}")
    return model.to(device).eval(), device


# A line of a user's text file (for sample.py --prompt @FILE, the whole file) holds at most this
# many characters: 4x what GPT-2's whole context can hold (1,024 tokens of at most 128 bytes),
# hundreds of HellaSwag examples. A longer one is a mistake (a binary file, one with no line
# breaks), refused before it fills the memory or reaches the tokenizer (whose regex fails at 1M spaces).
MAX_LINE_CHARS = 1 << 19

FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
              stat.S_IFSOCK: "a socket"}


class TextFileError(ValueError):
    """A user's text file that cannot be read as one: not a regular file, or a line too long.
    The message starts with the file's path, as given, and names the line where there is one."""


def open_text(path, newline=None):
    """path opened as UTF-8 text, or OSError, or TextFileError if it is not a regular file: a
    FIFO's open() would wait for a writer, /dev/zero never ends, a directory has no text."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # so that a FIFO opens at once, to be refused
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TextFileError(f"{path}: {FILE_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, "
                                f"not a regular file")
        return open(fd, encoding="utf-8", newline=newline)
    except BaseException:
        os.close(fd)
        raise


def read_text(path, max_chars=MAX_LINE_CHARS):
    """The whole file, as is (\r\n stays \r\n); TextFileError past max_chars characters (only
    max_chars + 1 are read), else as open_text, or UnicodeDecodeError."""
    with open_text(path, newline="") as f:
        text = f.read(max_chars + 1)
    if len(text) > max_chars:
        raise TextFileError(f"{path}: more than {max_chars:,} characters")
    return text


def read_lines(path, max_chars=MAX_LINE_CHARS):
    """Yields (number from 1, line without its line break) for each line (ended by \n, \r\n or
    \r; a last line break ends the last line); TextFileError at a line of more than max_chars
    characters (no more of it is read), else as open_text, or UnicodeDecodeError."""
    with open_text(path) as f:
        number = 0
        while line := f.readline(max_chars + 1):  # + 1: a line of max_chars and its line break
            number += 1
            line = line.removesuffix("\n")
            if len(line) > max_chars:
                raise TextFileError(f"{path} line {number}: more than {max_chars:,} characters")
            yield number, line
