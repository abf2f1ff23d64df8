"""The machine's limits imposed on a child: a full disk, a file size or address space cap."""
import functools
import signal
import subprocess
import sys


def disk_full(*args, **kwargs):
    """Stands in for any write that fails on a full disk."""
    raise OSError(28, "No space left on device")


def file_size_limit(limit):
    """A preexec_fn: the child may write no file past limit bytes (ulimit -f), and a write past it
    fails with EFBIG, as on a full disk, rather than killing it (SIGXFSZ). It pickles, for run_ranks."""
    return functools.partial(limit_file_size, limit)


def limit_file_size(limit):
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def memory_limit(limit):
    """A preexec_fn: the child may map no more than limit bytes (ulimit -v), so that a read that
    never ends fails fast with MemoryError rather than filling this machine's memory."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


@functools.cache
def torch_address_space():
    """The bytes of address space a fresh interpreter maps to import torch: under 1 GiB for a CPU
    build, over 3 GiB for a CUDA build (its libraries), used or not."""
    code = "import re, torch; print(re.search(r'VmPeak:\\s+(\\d+) kB', open('/proc/self/status').read())[1])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) << 10
