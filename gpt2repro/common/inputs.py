"""Reading what a user names or is handed: regular files only, text of bounded lines, JSON and plain
data nested within bounds, and values and exceptions as text of bounded length for the one-line errors
about them."""
import json
import os
import stat
import urllib.parse
import urllib.request

from gpt2repro.common.atomic import file_kind


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


def first_line(error):
    """An exception's message as one line (its type's name if it has none), for one-line errors."""
    return " ".join(str(error).split()) or type(error).__name__


def parse_json(text):
    """json.loads(text), but JSON nested past Python's recursion limit is a ValueError, as any
    other text that is not JSON, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep for Python's parser") from None


def unicode_problem(text):
    """Why a string decoded from a user's JSON is not Unicode text, or None: JSON's \\ud800 escape
    decodes to a lone surrogate, which no text holds (UTF-8 cannot encode it, nor the tokenizer read it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds {text[e.start]!r}, a lone surrogate: not Unicode text"
    return None


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


def open_url(url):
    """url opened for reading; a file: URL (a local mirror) only if it names a regular file: a FIFO
    would wait for a writer forever, /dev/zero never end (inputs.open_regular's UnreadableFile)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost"):  # urlopen refuses another host's
        return open_regular(urllib.request.url2pathname(parts.path), "rb")
    return urllib.request.urlopen(url, timeout=60)


def read_bytes(path, max_bytes, what):
    """The bytes of the regular file at path; past max_bytes (only max_bytes + 1 are read)
    UnreadableFile "PATH: more than N bytes: WHAT", what saying what such a file cannot be; else as
    open_regular."""
    with open_regular(path, "rb") as f:
        # Up to its size: read(n) allocates n bytes first, and a large n fails under a memory limit.
        data = f.read(min(os.fstat(f.fileno()).st_size, max_bytes) + 1)
    if len(data) > max_bytes:
        raise UnreadableFile(f"{path}: more than {max_bytes:,} bytes: {what}")
    return data


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


def parse_lines(path, parse):
    """[(number, parse(line))] of each line of path that is not blank (read_lines): parse's
    ValueError is UnreadableFile "PATH line N: why", and so is a file of no such line ("PATH: no
    examples"); else as read_lines."""
    parsed = []
    for number, line in read_lines(path):
        if line.strip():
            try:
                parsed.append((number, parse(line)))
            except ValueError as e:
                raise UnreadableFile(f"{path} line {number}: {e}") from None
    if not parsed:
        raise UnreadableFile(f"{path}: no examples")
    return parsed
