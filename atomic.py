"""Files that are never half-written: shards, manifests, checkpoints, logs rewritten on resume."""
import errno
import fcntl
import os
from contextlib import contextmanager


@contextmanager
def atomic_open(path, mode="wb"):
    """Opens a temporary file beside path for writing; on success flushes it to disk and renames
    it to path, on any error removes it. A crash at any moment leaves the old file or the new
    one, never a truncated file under the final name."""
    tmp = temporary_path(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def temporary_path(path):
    """Where atomic_open writes before renaming to path: beside it, one name per process."""
    return f"{path}.tmp{os.getpid()}"


def check_writable(path):
    """Raises OSError unless atomic_open can write path (making its directory if missing), so a
    script can check where its results go before hours of work rather than after."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a directory, not a file name", path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    open(temporary_path(path), "w").close()
    os.remove(temporary_path(path))


LOCK_NAME = ".lock"  # in a directory one process writes at a time: log_dir, fineweb.py's output_dir


class DirectoryInUse(Exception):
    """Another live process holds the directory's lock."""


def claim_directory(directory, owner):
    """Takes an exclusive lock on directory (flock on its .lock file, which holds our pid) and
    returns the open file that holds it: closing it, or the process ending in any way, SIGKILL
    included, releases it. A second claimant gets DirectoryInUse, naming the first one's pid."""
    f = open(os.path.join(directory, LOCK_NAME), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise DirectoryInUse(f"{directory} is in use by another {owner} (pid {holder}): two would interleave "
                             f"their files; wait for it to end, or choose another directory") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
