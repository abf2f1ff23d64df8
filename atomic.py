"""Files that are never half-written: shards, manifests, checkpoints, logs rewritten on resume."""
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
