"""Where and in what precision to run: one answer for training, evaluation, sampling and the benchmark."""
import os
import re
import sys
import warnings
from contextlib import contextmanager, nullcontext

import torch

from gpt2repro.common.inputs import first_line


def compiled(fn, mode):
    """torch.compile(fn) in mode, one of train_gpt2.py's --compile_mode values ("default": torch's own)."""
    return torch.compile(fn, mode=None if mode == "default" else mode)


def resolve_compile(flag, device_type, log):
    """Whether to compile, for --compile flag (auto, 1 or 0) on device_type; log notes why auto stays off."""
    if flag != "auto":
        return flag == "1"
    if device_type == "cuda" and sys.platform != "win32":
        return True
    if device_type == "mps" or sys.platform == "win32":
        log(f"note: --compile auto stays off on {'Windows' if sys.platform == 'win32' else 'MPS'}")
    return False


def allow_tf32():
    """TF32 matmuls on Ampere and later, without torch 2.9's three-line warning that this call
    will be deprecated (2.10 took the warning back)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use the new API settings to control TF32")
        torch.set_float32_matmul_precision("high")

# Dense bf16 peak FLOP/s per GPU, from NVIDIA's datasheets, for MFU. The first entry whose words
# all appear, in order and whole, in the device's name wins: variants before the plain model
# ("H100 NVL" before "H100"), and "L4" does not match an L40, nor "A100" an RTX A1000.
PEAK_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200 NVL", 835e12),
              ("H200", 989e12), ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
              ("L4", 121e12), ("A10", 125e12), ("4090", 165e12)]


# A CPU's training rate, measured: bench/results/cpu-2core.json's train run (a GPT of 4 layers, 256
# wide, B=8, T=256, float32, eager, on 2 cores) took 763 tokens/s of 99.4 MFLOP each.
CPU_TRAIN_FLOPS = 75.8e9
LONG_CPU_RUN = 3600  # seconds: a run forecast to take longer on a CPU says so before it starts


def pick_device(name="auto", local_rank=None):
    """The torch device string for name: auto, cpu, cuda, cuda:K or mps (auto: cuda, else mps,
    else cpu). Under torchrun (local_rank given) each process takes its own GPU, cuda:LOCAL_RANK,
    and no other: DDP's device_ids and NCCL assume it. ValueError for any other name (torch's
    meta, hpu, xla... the code never runs on), or a device that cannot be used here."""
    if name == "auto":
        name = auto_device_type()
    if not re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", name):
        raise ValueError("not a device this project runs on: use auto, cpu, cuda, cuda:K or mps")
    if name.startswith("mps") and not torch.backends.mps.is_available():  # torch's own message is a page long
        raise ValueError(f"device {name} cannot be used here: this torch or this machine has no Apple GPU (MPS)")
    if name == "cuda":
        name = f"cuda:{local_rank or 0}"
    elif local_rank is not None and name.startswith("cuda:") and name != f"cuda:{local_rank}":
        raise ValueError(f"under torchrun each process takes cuda:LOCAL_RANK (here cuda:{local_rank}): use --device cuda")
    try:
        torch.empty(0, device=name)  # a missing GPU, a torch built without CUDA
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"device {name} cannot be used here: {first_line(e)}") from None
    return name


def auto_device_type():
    """What --device auto takes: cuda, else mps, else cpu."""
    return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"


def pick_dtype(name, device_type, log=None):
    """The autocast dtype for --dtype name; float32 means no autocast. auto: bfloat16 on CUDA
    GPUs with bf16 tensor cores (Ampere, compute capability 8, and later), float16 on older ones
    (training adds loss scaling), float32 on CPU and MPS. log, if given, notes float16 on a CPU."""
    if name == "float16" and device_type == "cpu" and log:
        log("note: --dtype float16 on a CPU is slow: a demo step took 6.5x as long as in float32 (bfloat16: 0.8x)")
    if name == "auto":
        if device_type == "cuda":
            # Not torch.cuda.is_bf16_supported(): by default it also says yes where bf16 is only
            # emulated (V100, T4), slowly and without tensor cores.
            return torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
        return torch.float32
    return getattr(torch, name)


def autocast(device_type, dtype):
    """Mixed precision in dtype, or nothing for float32."""
    return torch.autocast(device_type, dtype) if dtype != torch.float32 else nullcontext()


@contextmanager
def evaluating(model):
    """model in evaluation mode (no dropout) within, back in training mode after."""
    model.eval()
    try:
        yield model
    finally:
        model.train()


def device_memory(device):
    """Bytes of memory the device has: a GPU's own, else the host's (Apple's MPS shares it)."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory(root="/"):
    """Bytes of the host's memory that this process may still take: Linux's MemAvailable (free
    memory and the caches the kernel can drop), or less where its memory cgroup leaves less
    (cgroup_headroom); None where it cannot be read (other systems). root: where /proc and /sys
    lie (a test's copy of them)."""
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    headroom = cgroup_headroom(root)
    return max(available if headroom is None else min(available, headroom), 0)


# A memory cgroup's limit and usage: cgroup v1's memory controller, v2's unified hierarchy.
CGROUP_FILES = {"cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes"), "cgroup2": ("memory.max", "memory.current")}


def cgroup_headroom(root="/"):
    """The least limit less usage, in bytes, of this process's memory cgroup and of every cgroup
    above it that can be seen (own_memory_cgroup), or None where none sets a limit."""
    found = own_memory_cgroup(root)
    if found is None:
        return None
    directory, top, kind = found
    limit_file, usage_file = CGROUP_FILES[kind]
    least = None
    while True:
        try:
            with open(os.path.join(directory, limit_file)) as f, open(os.path.join(directory, usage_file)) as g:
                headroom = int(f.read()) - int(g.read())
            least = headroom if least is None else min(least, headroom)
        except (OSError, ValueError):  # no such file (v2's root), or "max": no limit here
            pass
        if directory == top:
            return least
        directory = os.path.dirname(directory)


def own_memory_cgroup(root="/"):
    """(the directory of this process's memory cgroup, that of the topmost one mounted above it,
    "cgroup" or "cgroup2"), or None. A container's or a job's limit lies on its own cgroup, not the
    root: the one /proc/self/cgroup names (v1's memory controller, else v2's), under the mount of its
    hierarchy that /proc/self/mountinfo lists, which in a container is often that cgroup itself."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:  # lines of ID:CONTROLLERS:PATH
            paths = {fields[1]: fields[2] for fields in (line.rstrip("\n").split(":", 2) for line in f) if len(fields) == 3}
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    v1 = next((path for controllers, path in paths.items() if "memory" in controllers.split(",")), None)
    kind, path = ("cgroup", v1) if v1 is not None else ("cgroup2", paths.get(""))
    if path is None:
        return None
    for fields in mounts:  # ID PARENT DEV ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS
        if "-" not in fields:
            continue
        fs_type, options = fields[fields.index("-") + 1], fields[-1].split(",")
        below = os.path.relpath(path, fields[3])
        if fs_type == kind and (kind == "cgroup2" or "memory" in options) and not below.startswith(".."):
            top = os.path.join(root, fields[4].lstrip("/"))
            return os.path.normpath(os.path.join(top, below)), os.path.normpath(top), kind
    return None


# What torch's CPU allocator raises, as a plain RuntimeError, when an allocation fails: under a
# memory limit (ulimit -v) or past any memory. A GPU's allocator raises torch.OutOfMemoryError.
CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(error):
    """Whether error is an allocation that failed for want of memory, on a GPU or on the host."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and
                                                         CPU_ALLOCATOR_FAILED in str(error))


def synchronize(device):
    """Waits until the device has run all the work queued on it: a timer stopped without this
    times only the queueing (GPUs and Apple's MPS run asynchronously; a CPU has nothing to wait for)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    elif str(device).startswith("mps"):
        torch.mps.synchronize()


def cpu_forecast(flops_per_step, steps):
    """On a CPU: a note forecasting a run of steps optimizer steps of flops_per_step FLOPs at
    CPU_TRAIN_FLOPS, that it is meant for GPUs, and the demo, where the run would take more than
    LONG_CPU_RUN; None for a shorter run."""
    step = flops_per_step / CPU_TRAIN_FLOPS
    if step * steps <= LONG_CPU_RUN:
        return None
    return (f"note: on a CPU a step would take about {duration(step)} and the {steps:,} steps {duration(step * steps)} "
            f"(their FLOPs at the {CPU_TRAIN_FLOPS / 1e9:.0f} GFLOP/s of a training run on 2 cores, "
            f"bench/results/cpu-2core.json): this run is meant for GPUs; `python train_gpt2.py --preset demo` "
            f"trains a small GPT on a CPU in minutes")


def duration(seconds):
    """seconds for a message: in years from one year, days from two days, hours from one hour,
    minutes from one minute."""
    for unit, size, least, digits in (("years", 365 * 86400, 1, 1), ("days", 86400, 2, 0), ("h", 3600, 1, 1),
                                      ("min", 60, 1, 0)):
        if seconds >= least * size:
            return f"{seconds / size:.{digits}f} {unit}"
    return f"{seconds:.0f} s"


def peak_flops(device):
    """The device's dense bf16 peak FLOP/s, or None where unknown (any CPU)."""
    if not str(device).startswith("cuda"):
        return None
    words = f" {' '.join(re.findall('[A-Za-z0-9]+', torch.cuda.get_device_name(device)))} "
    return next((flops for key, flops in PEAK_FLOPS if f" {key} " in words), None)
