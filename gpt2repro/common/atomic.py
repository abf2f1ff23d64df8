"""Files that are never half-written: shards, manifests, checkpoints, logs rewritten on resume,
the scripts' --json results. Only regular files are ever replaced."""
import errno
import fcntl
import os
import secrets
import shutil
import stat
from contextlib import contextmanager, suppress


FILE_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
              stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def file_kind(mode):
    """What a file of st_mode mode is, for messages: "a directory", "a device"..."""
    return FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")


@contextmanager
def atomic_open(path, mode="wb"):
    """Opens a temporary file beside path for writing (create_temporary); on success flushes it to
    disk and renames it to path (replace_file), on any error removes it. A crash at any moment
    leaves the old file or the new one, never a truncated file under the final name. An existing
    path that is not a regular file is an OSError, before anything is written, and is left as it is."""
    check_replaceable(path)
    tmp, fd = create_temporary(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace_file(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def replace_file(tmp, path):
    """Renames the file tmp to path, unless path exists and is not a regular file: a rename would
    replace a device (--json /dev/null, which as root breaks the machine's /dev/null), a FIFO, a
    directory or a symbolic link with a file. Those are refused (check_replaceable), not written to."""
    check_replaceable(path)
    os.replace(tmp, path)


def check_replaceable(path):
    """Raises OSError, naming what path is, if it exists and is not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EEXIST
        raise OSError(code, f"{file_kind(mode)}, not a regular file", path)


# Tries at a free temporary name: past the first, only where something was put at a random name.
TEMPORARY_TRIES = 10


def create_temporary(path):
    """(name, descriptor) of a new file beside path, open for writing, that is this process's own:
    made under a name no one can plant in advance (temporary_path) and created exclusively, so
    that nothing put there first, a symbolic or a hard link to another file included, is ever
    written through; a name taken already is passed over for another."""
    for _ in range(TEMPORARY_TRIES):
        tmp = temporary_path(path)
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside it in {TEMPORARY_TRIES} tries", path)


def temporary_path(path):
    """A name beside path, in its directory (so that renaming it to path is atomic), with a random
    suffix: PATH.tmp and 16 hex digits, which the trainer's and fineweb.py's tidying recognise."""
    return f"{path}.tmp{secrets.token_hex(8)}"


def check_writable(path):
    """Raises OSError unless atomic_open can write path (making its directory if missing), so a
    script can check where its results go before hours of work rather than after."""
    check_replaceable(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp, fd = create_temporary(path)
    os.close(fd)
    os.remove(tmp)


LOCK_NAME = ".lock"  # in a directory one process writes at a time: log_dir, fineweb.py's output_dir


class CannotClaim(Exception):
    """claim_directory's refusal; the message starts with the directory, so a caller can put its
    flag's name before it and print one line."""


class DirectoryInUse(CannotClaim):
    """Another live process holds the directory's lock; holder: its pid, as its lock file says."""

    def __init__(self, message, holder):
        super().__init__(message)
        self.holder = holder


class UnusableLock(CannotClaim):
    """The lock file cannot be ours: not a regular file (a symbolic link, a directory, a FIFO), or
    not writable (a read-only file system, no permission)."""


def claim_directory(directory, owner):
    """Takes an exclusive lock on directory (flock on its .lock file, which holds our pid) and
    returns the open file that holds it: closing it, or the process ending in any way, SIGKILL
    included, releases it. A second claimant gets DirectoryInUse, naming the first one's pid; a
    .lock that is not a regular file we can write gets UnusableLock, and is left as it was."""
    f = open_lock_file(directory)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise DirectoryInUse(f"{directory} is in use by another {owner} (pid {holder}): two would interleave "
                             f"their files; wait for it to end, or choose another directory", holder) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError as e:  # a full disk: the pid is for messages only, but a lock we cannot write is no claim
        with suppress(OSError):  # closing flushes the pid again, fails again, and closes the file
            f.close()
        raise UnusableLock(f"{directory}: cannot write its lock file {LOCK_NAME} ({e.strerror or e})") from None
    return f


def holds_lock(directory, lock):
    """Whether lock, the open file claim_directory returned, is still directory's lock: not once
    directory, or its .lock, was removed or replaced (rm -rf, and a directory made anew under that
    name, whose lock another process may hold)."""
    try:
        there = os.lstat(os.path.join(directory, LOCK_NAME))
    except OSError:
        return False
    held = os.fstat(lock.fileno())
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def remove_if_unused(directory):
    """Removes directory if it holds nothing but a .lock of this process's (its pid): what a start
    that made it, claimed it and then failed would otherwise leave behind. Not a directory made
    anew under that name, where this one's was removed, by a run now starting there."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return
    names = set(os.listdir(directory))
    if names <= {LOCK_NAME} and (not names or lock_holder(directory) == str(os.getpid())):
        shutil.rmtree(directory)


def lock_holder(directory):
    """The pid that directory's .lock says holds it, as text; None where it cannot be read."""
    try:
        with os.fdopen(os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
            return f.read(32).strip()
    except (OSError, UnicodeDecodeError):
        return None


def open_lock_file(directory):
    """directory's .lock, opened for reading and writing (created if missing). Never through a
    symbolic link, whose target would get our pid written over it, and without waiting: O_NONBLOCK
    makes opening a FIFO return at once (O_NOCTTY: a terminal does not become ours), to be refused
    with anything else that is not a regular file."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise not_a_lock(directory, "a symbolic link") from None
        if e.errno == errno.EISDIR:
            raise not_a_lock(directory, "a directory") from None
        raise UnusableLock(f"{directory}: cannot write its lock file {LOCK_NAME} ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_a_lock(directory, file_kind(mode))
    return os.fdopen(fd, "r+")


def not_a_lock(directory, kind):
    return UnusableLock(f"{directory}: its lock file {LOCK_NAME} is {kind}, not a regular file; "
                        f"move it away, or choose another directory")
