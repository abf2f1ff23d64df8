"""The peers benchmark: this project's trainer beside the trainers a user would run instead,
build-nanogpt's train_gpt2.py (compiled) and llm.c's train_gpt2cu (with and without cuDNN
attention), on one GPU, the same token shards, and the same B, T and tokens per step.

Each peer runs from a scratch copy of the user's checkout (untrusted: read, never written
through), adapted by this module and never by hand: build-nanogpt's step count, micro-batch,
compile switch, data directory and tokenizer (offline: the vendored one, in its hellaswag.py
too), plus a line that prints its peak memory; llm.c's out-of-memory fallback to managed memory
(CUDA 13 refuses its cudaMemAdvise call, and managed memory must not stand in for GPU memory in a
benchmark), and its build flags: the GPU's compute capability, cuDNN's paths, the rpath to the
CUDA libraries. Each program's own log gives its milliseconds per step; the first warmup steps
(compilation, autotuning) and the last (evaluation) are left out, and the median of the rest is
the result. bench.py --parts peers runs this; python -m gpt2repro.benchmark.peers prints what the peers need of the
machine (the probe).
"""
import glob
import os
from dataclasses import dataclass
import re
import shlex
import shutil
import stat
import statistics
import subprocess
import sys

import numpy as np

from gpt2repro import REPO
from gpt2repro.lm.data import Shard, shard_name, text_tokens, write_shard

LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256  # llm.c's dataloader.h token-file header


class PeerError(Exception):
    """A checkout that is missing or not what this module adapts, or a peer that failed: one line,
    and log_tail, the last lines of the failed program's output (its log does not outlive the run)."""

    def __init__(self, message, log_tail=()):
        super().__init__(message)
        self.log_tail = list(log_tail)


# ----------------------------------------------------------------------------- the data

def write_llmc_tokens(shard_path, out_path):
    """One of this project's .npy token shards as llm.c reads it: a header of 256 int32 (magic,
    version, token count, then zeros), then the tokens as uint16."""
    shard = Shard(shard_path)
    tokens = shard.read(0, shard.n_tokens)
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = LLMC_MAGIC, LLMC_VERSION, len(tokens)
    with open(out_path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def llmc_token_files(data_dir, out_dir):
    """Every .npy shard of data_dir converted into out_dir; returns llm.c's -i and -j patterns."""
    os.makedirs(out_dir, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(glob.escape(data_dir), "*.npy"))):
        write_llmc_tokens(path, os.path.join(out_dir, os.path.basename(path)[: -len(".npy")] + ".bin"))
    return os.path.join(out_dir, "*_train_*.bin"), os.path.join(out_dir, "*_val_*.bin")


# ----------------------------------------------------------------------------- the checkouts

BUILD_NANOGPT_FILES = ("train_gpt2.py", "hellaswag.py")
LLMC_FILES = ("train_gpt2.cu", "Makefile", "llmc/cuda_utils.cuh")


def check_checkout(path, files, name):
    """PeerError in one line unless path is a directory holding files (a checkout of name)."""
    if not os.path.isdir(path):
        raise PeerError(f"{path}: no such directory (a checkout of {name})")
    if missing := [f for f in files if not os.path.isfile(os.path.join(path, f))]:
        raise PeerError(f"{path}: not a checkout of {name} (no {', '.join(missing)})")


def scratch_copy(src, dst):
    """A fresh copy of the checkout src at dst, without its git history, that shares nothing with
    it: regular files only, each written anew, so that editing the copy cannot write through to
    the checkout. A link is copied as the file it names where that is inside the checkout;
    PeerError in one line for a link out of it or to a directory, and for anything that is not a
    regular file (a FIFO, a device, a socket)."""
    shutil.rmtree(dst, ignore_errors=True)
    root = os.path.realpath(src)
    for here, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != ".git"]
        if links := [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            raise PeerError(f"{os.path.join(here, links[0])}: a link to a directory (the scratch copy follows none)")
        os.makedirs(os.path.join(dst, os.path.relpath(here, src)), exist_ok=True)
        for name in files:
            path = os.path.join(here, name)
            copy_regular_file(path, root, os.path.join(dst, os.path.relpath(path, src)))


def copy_regular_file(path, root, to):
    """The regular file at path, or that the link at path names inside root, copied to a new file to."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise PeerError(f"{path}: a link out of the checkout, to {real} (the scratch copy follows none)")
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):  # before opening: opening a device can act on it
            raise PeerError(f"{path}: not a regular file (a FIFO, a device or a socket)")
        # O_NONBLOCK: a file swapped for a FIFO since the check must not hang the open; fstat then refuses it
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as source:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PeerError(f"{path}: not a regular file (a FIFO, a device or a socket)")
            with open(to, "xb") as copy:
                shutil.copyfileobj(source, copy)
    except OSError as e:
        raise PeerError(f"{path}: {e.strerror or e}") from None


def edit(path, replacements, name):
    """Replaces in the file at path (UTF-8 text) each old text, which must occur exactly once, by its
    new one; PeerError in one line where the file is not what this module adapts."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PeerError(f"{name}'s {os.path.basename(path)} is not UTF-8 text (byte {e.start}): not the file "
                        f"this module adapts") from None
    for old, new in replacements:
        if text.count(old) != 1:
            raise PeerError(f"{name}'s {os.path.basename(path)} has changed: expected one `{old.strip()}`, "
                            f"found {text.count(old)}")
        text = text.replace(old, new)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


# build-nanogpt's train_gpt2.py and hellaswag.py each build tiktoken's GPT-2 encoding, which downloads
# its files: both get this repository's instead, its folder on the path only while its tokenizer is
# imported, so that none of its modules shadows one of the peer's.
TIKTOKEN_GPT2 = 'enc = tiktoken.get_encoding("gpt2")'
OFFLINE_TOKENIZER = (f"import sys; sys.path.insert(0, {REPO!r}); from gpt2repro.lm.tokenizer import get_encoding; "
                     f"sys.path.remove({REPO!r}); enc = get_encoding()")


def adapt_build_nanogpt(checkout, scratch, data_dir, B, T, total_batch_size, steps, warmup):
    """A copy of build-nanogpt at scratch that trains steps steps of B x T sequences, total_batch_size
    tokens a step, compiled, its lr warmed up over warmup steps, on data_dir's shards, with this
    repository's tokenizer in its script and its hellaswag.py (tiktoken's download needs the
    network), and prints its peak memory at the end. Returns its script."""
    check_checkout(checkout, BUILD_NANOGPT_FILES, "build-nanogpt")
    scratch_copy(checkout, scratch)
    script = os.path.join(scratch, "train_gpt2.py")
    edit(script, [
        ('data_root = "edu_fineweb10B"', f"data_root = {os.path.abspath(data_dir)!r}"),
        (TIKTOKEN_GPT2, OFFLINE_TOKENIZER),
        ("total_batch_size = 524288", f"total_batch_size = {total_batch_size}"),
        ("B = 64 ", f"B = {B} "),
        ("T = 1024 ", f"T = {T} "),
        ("use_compile = False", "use_compile = True"),
        ("warmup_steps = 715", f"warmup_steps = {warmup}"),
        ("max_steps = 19073", f"max_steps = {steps}"),
    ], "build-nanogpt")
    edit(os.path.join(scratch, "hellaswag.py"), [(TIKTOKEN_GPT2, OFFLINE_TOKENIZER)], "build-nanogpt")
    with open(script, "a") as f:
        f.write('\nprint(f"peak memory: {torch.cuda.max_memory_allocated()} bytes")\n')
    return script


def adapt_llmc(checkout, scratch):
    """A copy of llm.c at scratch whose GPU allocations fail when the GPU is full, instead of
    falling back to managed memory in host RAM."""
    check_checkout(checkout, LLMC_FILES, "llm.c")
    scratch_copy(checkout, scratch)
    edit(os.path.join(scratch, "llmc", "cuda_utils.cuh"), [
        ("        cudaCheck_(cudaMallocManaged(out, bytes), file, line);\n", ""),
        ("        cudaCheck_(cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId), file, line);\n",
         "        cudaCheck_(err, file, line);  // out of GPU memory: fail, never fall back to host memory\n"),
    ], "llm.c")


def cudnn_frontend(llmc_checkout):
    """The include directory, as an absolute path (make runs in a scratch copy elsewhere), of a
    cudnn-frontend checkout where llm.c's Makefile looks for one: inside the llm.c checkout, or in
    the home directory; None if neither has one."""
    for root in (llmc_checkout, os.path.expanduser("~")):
        include = os.path.join(root, "cudnn-frontend", "include")
        if os.path.isdir(include):
            return os.path.abspath(include)
    return None


def nvcc_library_dirs():
    """The directories the nvcc on PATH links from, as its --dryrun's LIBRARIES line names them
    (-L flags); [] without an nvcc."""
    try:
        dryrun = subprocess.run(["nvcc", "--dryrun", "-x", "cu", os.devnull, "-o", os.devnull],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [os.path.normpath(flag[2:]) for line in (dryrun.stdout + dryrun.stderr).splitlines()
            if line.startswith("#$ LIBRARIES=") for flag in shlex.split(line.partition("=")[2]) if flag.startswith("-L")]


def cuda_toolkit_lib():
    """The directory from which nvcc links libcublasLt (and libnvrtc beside it): llm.c's binaries'
    rpath, so that they load what they were built against whether or not the loader's own paths
    hold it. None without an nvcc, or where none of its directories holds libcublasLt."""
    return next((lib for lib in nvcc_library_dirs() if glob.glob(os.path.join(glob.escape(lib), "libcublasLt.so*"))),
                None)


def llmc_make_command(gpu_arch, cudnn_include=None, wheel=None, toolkit_lib=None):
    """make's command line for train_gpt2cu for the GPU of compute capability gpu_arch ("90": 9.0;
    llm.c's Makefile cannot detect it), with cuDNN attention when cudnn_include (a cudnn-frontend's
    headers) is given; today's cudnn-frontend also needs nvrtc and the driver library. wheel: cuDNN
    from the nvidia-cudnn wheel beside torch (cudnn_wheel), else the system's. toolkit_lib: the
    binary's rpath to the CUDA libraries (cuda_toolkit_lib)."""
    command = ["make", "train_gpt2cu", f"GPU_COMPUTE_CAPABILITY={gpu_arch}", f"USE_CUDNN={int(cudnn_include is not None)}",
               "NO_MULTI_GPU=1", "NO_USE_MPI=1"]
    ldlibs = []
    if cudnn_include is not None:
        headers = cudnn_include
        ldlibs.append("-lnvrtc -lcuda")
        if wheel is not None:
            include, link, lib = wheel
            headers += f" -I{include}"  # the Makefile puts -I before CUDNN_FRONTEND_PATH: cuDNN's own headers ride along
            ldlibs.append(f"-L{link} -Xlinker -rpath={lib}")
        command.append(f"CUDNN_FRONTEND_PATH={headers}")
    if toolkit_lib is not None:
        ldlibs.append(f"-Xlinker -rpath={toolkit_lib}")
    if ldlibs:
        command.append(f"NVCC_LDLIBS={' '.join(ldlibs)}")
    return command


def nvidia_wheels():
    """The folder of the nvidia-* wheels beside torch (the nvidia namespace package: cudnn/, cublas/,
    ...), or None without one. The one place that says where they are: the tests point it elsewhere."""
    try:
        import nvidia
    except ImportError:
        return None
    return list(nvidia.__path__)[0]


def cudnn_wheel_files():
    """(headers, versioned library) of the nvidia-cudnn wheel beside torch, or None without one."""
    wheels = nvidia_wheels()
    if wheels is None:
        return None
    root = os.path.join(wheels, "cudnn")
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    versioned = sorted(glob.glob(os.path.join(glob.escape(lib), "libcudnn.so.*")))
    return (include, versioned[0]) if os.path.isdir(include) and versioned else None


def cudnn_wheel(scratch):
    """The nvidia-cudnn wheel beside torch as llm.c's build needs it, or None without one: (its
    headers, a directory in scratch where libcudnn.so names the wheel's versioned library, which
    -lcudnn cannot find alone, and the wheel's library directory, for the binary to load it from)."""
    files = cudnn_wheel_files()
    if files is None:
        return None
    include, versioned = files
    link = os.path.join(scratch, "cudnn-link")
    os.makedirs(link, exist_ok=True)
    if not os.path.lexists(os.path.join(link, "libcudnn.so")):
        os.symlink(versioned, os.path.join(link, "libcudnn.so"))
    return include, link, os.path.dirname(versioned)


def llmc_run_command(binary, patterns, config, run):
    """train_gpt2cu on a fresh GPT-2 (124M), its sizes and steps config's (a PeersConfig), on the
    token files of patterns (train, val), no recompute, run's ZeRO stage and GELU fusion (an LlmcRun),
    no evaluation but at the first and last step (which the timing leaves out), no sampling,
    HellaSwag or checkpoints; the recipe's lr, 6e-4 warmed up over config.warmup steps and decayed to 10%."""
    steps = config.run_steps
    fusion = [] if run.gelu_fusion is None else ["-ge", str(run.gelu_fusion)]
    return [binary, "-i", patterns[0], "-j", patterns[1], "-e", "d12", "-b", str(config.micro_batch_size),
            "-t", str(config.seq_len), "-d", str(config.total_batch_size), "-x", str(steps), "-r", "0",
            "-z", str(run.zero), *fusion, "-v", str(10 * steps + 1), "-s", "0", "-h", "0", "-n", "0", "-l", "0.0006",
            "-u", str(config.warmup), "-c", "0.1", "-q", "0.1"]


def project_command(data_dir, log_dir, B, T, total_batch_size, steps, warmup):
    """This project's trainer with its defaults, on data_dir, its lr warmed up over warmup steps,
    with no evaluation, samples or HellaSwag."""
    return [sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data_dir", data_dir, "--log_dir", log_dir,
            "-B", str(B), "-T", str(T), "--total_batch_size", str(total_batch_size), "--max_steps", str(steps),
            "--warmup_steps", str(warmup), "--eval_interval", "0", "--hellaswag", "0", "--sample_interval", "0", "--resume", "none",
            "--checkpoint_interval", "-1"]  # GPT-2 (124M)'s is 1.5 GB: time and disk the timed job lacks


# ----------------------------------------------------------------------------- the logs

NUMBER = r"(-?nan|-?inf|[-\d.]+)"  # as Python and C print a float
STEP_LINE = {  # each program's step line, with the groups that hold its loss, gradient norm and milliseconds
    "project": re.compile(rf"^step +\d+ \| loss {NUMBER} \|.*\| norm {NUMBER} \| dt ([\d.]+)ms"),
    "build-nanogpt": re.compile(rf"^step +\d+ \| loss: {NUMBER} \|.*\| norm: {NUMBER} \| dt: ([\d.]+)ms"),
    "llm.c": re.compile(rf"^step +\d+/\d+ \| loss {NUMBER} .*\| norm +{NUMBER} .*\| ([\d.]+) ms \|"),
}
PEAK_BYTES = {  # each program's own report of its peak memory, in bytes
    "project": (re.compile(r"\| mem ([\d.]+)GiB"), 2**30),  # torch.cuda.max_memory_allocated, every step
    "build-nanogpt": (re.compile(r"^peak memory: (\d+) bytes"), 1),  # the line adapt_build_nanogpt adds
    "llm.c": (re.compile(r"^device memory usage: (\d+) MiB"), 2**20),  # cudaMemGetInfo: all the GPU's use
}


def read_log(program, text, tokens_per_step, warmup):
    """ms per step, tokens/s and peak memory (bytes) from a program's output: the median step time
    of the steps after warmup, less the last one; and every step's loss and gradient norm, for
    bench.py to judge whether the run trained. PeerError if too few steps are left."""
    steps = [m.groups() for line in text.splitlines() if (m := STEP_LINE[program].search(line))]
    steady = [float(ms) for _, _, ms in steps][warmup:-1]
    if not steady:
        raise PeerError(f"{program}: {len(steps)} step(s) in its output, too few after {warmup} warm-up step(s) "
                        f"and the last")
    pattern, unit = PEAK_BYTES[program]
    peaks = [float(m.group(1)) * unit for line in text.splitlines() if (m := pattern.search(line))]
    ms = statistics.median(steady)
    return dict(ms_per_step=ms, tokens_per_sec=tokens_per_step / ms * 1000, steady_steps=len(steady),
                peak_mem_bytes=max(peaks) if peaks else None, losses=[float(loss) for loss, _, _ in steps],
                grad_norms=[float(norm) for _, norm, _ in steps])


LOG_TAIL_LINES = 30  # of a failed program's output, kept in its error


def start(command, cwd, log_path):
    """command started in cwd, its output (stdout and stderr) written to log_path. PeerError in one
    line if it cannot start (no such program)."""
    with open(log_path, "w") as log:
        try:
            return subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        except OSError as e:
            raise PeerError(f"{command[0]}: {e.strerror}") from None


def finish(process, log_path, timeout):
    """The output of process (from start) once it exits. PeerError in one line, with the last
    lines of its output, if it fails or outlasts timeout seconds (then it is killed)."""
    name = " ".join(process.args[:2])
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    with open(log_path, errors="replace") as f:
        text = f.read()
    lines = text.strip().splitlines()
    if code is None:
        raise PeerError(f"{name}: still running after {timeout} s, stopped", lines[-LOG_TAIL_LINES:])
    if code != 0:
        raise PeerError(f"{name} exited with {code}: {(lines or ['no output'])[-1][:300]}", lines[-LOG_TAIL_LINES:])
    return text


def run(command, cwd, log_path, timeout):
    """Runs command in cwd, its output (stdout and stderr) written to log_path and returned; PeerError
    as start's and finish's."""
    return finish(start(command, cwd, log_path), log_path, timeout)


# ----------------------------------------------------------------------------- the benchmark

@dataclass
class PeersConfig:
    llmc: str  # a checkout of llm.c
    build_nanogpt: str  # a checkout of build-nanogpt
    micro_batch_size: int
    seq_len: int
    total_batch_size: int  # tokens per optimizer step, the same for every program
    steps: int  # steps timed, after the warm-up steps and before the last
    warmup: int
    gpu_arch: str  # the GPU's compute capability as llm.c's Makefile takes it: "90" for 9.0
    timeout: int  # seconds a program may run, its start and compilation included (llm.c: its build, after the others)

    @property
    def run_steps(self):
        return self.warmup + self.steps + 1


def write_tokens(data_dir, config):
    """Text (data.text_tokens), on which each program's loss falls within its steps: a val shard and
    a train shard of a few steps' tokens (every loader wraps)."""
    os.makedirs(data_dir, exist_ok=True)
    for split, index, steps in (("val", 0, 2), ("train", 1, 4)):
        tokens = text_tokens(steps * config.total_batch_size + 1)
        write_shard(os.path.join(data_dir, shard_name("peers", split, index)), tokens)


def system_cudnn():
    """The libcudnn.so that the loader's cache (ldconfig -p) holds, which -lcudnn links against
    without the wheel's; None without one."""
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line.split(" => ")[1].strip() for line in cache.splitlines()
                 if line.strip().startswith("libcudnn.so ") and " => " in line), None)


def llmc_builds(config, scratch_of):
    """{build: (make's command, its scratch copy)} of llm.c: without cuDNN, and with cuDNN attention
    against each cuDNN this machine has, the nvidia-cudnn wheel's beside torch and the system's
    (the loader's cache). Each scratch copy is made and adapted here. PeerError for a build that
    cannot be made, in its place."""
    include, toolkit_lib = cudnn_frontend(config.llmc), cuda_toolkit_lib()
    cudnns = [name for name, found in (("wheel", cudnn_wheel_files()), ("system", system_cudnn())) if found]
    builds = {}
    for build, cudnn in [("llm.c", None)] + [(f"llm.c-cudnn-{name}", name) for name in cudnns]:
        scratch = scratch_of(build)
        try:
            if cudnn and include is None:
                raise PeerError(f"no cudnn-frontend checkout in {config.llmc} or ~ (its include/ as "
                                f"llm.c/cudnn-frontend/include: docs/benchmarks.md)")
            adapt_llmc(config.llmc, scratch)
            wheel = cudnn_wheel(scratch) if cudnn == "wheel" else None
            builds[build] = llmc_make_command(config.gpu_arch, include if cudnn else None, wheel, toolkit_lib), scratch
        except PeerError as e:
            builds[build] = e, scratch
    if not cudnns:
        builds["llm.c-cudnn"] = PeerError("no cuDNN: neither the nvidia-cudnn wheel beside torch nor one in the "
                                          "loader's cache (ldconfig -p)"), scratch_of("llm.c-cudnn")
    return builds


@dataclass
class LlmcRun:
    variant: str
    zero: int  # -z: ZeRO stage
    gelu_fusion: int = None  # -ge: GELU fused into cuBLASLt's matmul, 1 forward, 2 forward and backward; None: llm.c's default

    def settings(self):
        """{name: value} of what this run asks, as llm.c's table of its settings prints them."""
        return {"zero_stage": str(self.zero), **({} if self.gelu_fusion is None else {"gelu_fusion": str(self.gelu_fusion)})}


# The usage line of llm.c's -ge: a train_gpt2.cu without it would read -ge as -g (genT), silently.
LLMC_GELU_FUSION = "-ge <int>"


def takes_gelu_fusion(scratch):
    """Whether the llm.c in scratch (a scratch copy: regular files) has the -ge flag."""
    with open(os.path.join(scratch, "train_gpt2.cu"), encoding="utf-8", errors="replace") as f:
        return LLMC_GELU_FUSION in f.read()


def llmc_runs(build, gelu_fusion):
    """The runs (LlmcRun) of an llm.c build: the plain build at ZeRO stage 1; each cuDNN build at 0 and 1
    (-z: which is faster on one GPU was seen to differ from machine to machine), and, where gelu_fusion
    (the build takes -ge), at stage 0 with each GELU fusion, its fastest configuration on an H100 or
    later by llm.c's own account (off by default at its HEAD). On one GPU stage 1 shards over one rank:
    its difference from stage 0 is measured once, without the fusion."""
    if build == "llm.c":
        return [LlmcRun(build, 1)]
    return [LlmcRun(f"{build}-z{zero}", zero) for zero in (0, 1)] + [
        LlmcRun(f"{build}-z0-ge{fusion}", 0, fusion) for fusion in ((1, 2) if gelu_fusion else ())]


LLMC_SETTING = re.compile(r"^\| (\w+) +\| (.*?) *\|$")  # a row of the table of its settings that llm.c prints


def settings_that_ran(text, asked):
    """asked ({name: value}) as llm.c's output text says it ran; PeerError where it ran otherwise."""
    ran = {m.group(1): m.group(2) for line in text.splitlines()
           if (m := LLMC_SETTING.match(line)) and m.group(1) in asked}
    if wrong := [f"{name} {ran.get(name, 'unsaid')}, not {value}" for name, value in asked.items()
                 if ran.get(name) != value]:
        raise PeerError(f"llm.c ran with {'; '.join(wrong)} as asked")
    return ran


def loaded_cudnn(binary):
    """The cuDNN that binary loads, as "VERSION (PATH)": the library its loader resolves (ldd), and
    that library's own cudnnGetVersion(), asked in a process of its own; "unknown" where either fails."""
    try:
        linked = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=60).stdout
        path = next(line.split("=>")[1].split(" (")[0].strip() for line in linked.splitlines() if "libcudnn.so" in line)
        asked = subprocess.run([sys.executable, "-c", "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).cudnnGetVersion())",
                                path], capture_output=True, text=True, timeout=60)
        version = int(asked.stdout)
    except (OSError, subprocess.TimeoutExpired, StopIteration, IndexError, ValueError):
        return "unknown"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100} ({path})"  # cuDNN 9's MAJOR*10000+MINOR*100+PATCH


def start_llmc_builds(config, workdir):
    """llm.c's builds (llmc_builds) started in workdir, on the CPU while the GPU trains the others:
    {build: (its scratch copy, make's process or the PeerError that stopped it, the build's log)}."""
    builds = {}
    for build, (make, scratch) in llmc_builds(config, lambda build: os.path.join(workdir, build)).items():
        log_path = os.path.join(workdir, f"{build}-build.log")
        if not isinstance(make, PeerError):
            try:
                make = start(make, scratch, log_path)
            except PeerError as e:
                make = e
        builds[build] = scratch, make, log_path
    return builds


class PeerRuns:
    """The programs' runs, one after another: each judged by judge(result, reference), reference the
    project's result (bench.judged: a run that did not train is reported without a speed), then
    recorded; one that fails is recorded with its error and the last lines of its output."""

    def __init__(self, config, workdir, record, judge):
        self.config, self.workdir, self.record, self.judge = config, workdir, record, judge
        self.size = f"B{config.micro_batch_size} T{config.seq_len} {config.total_batch_size:,} tokens/step"
        self.results = []

    def measure(self, variant, program, command, cwd, about=None, settings=None):
        """Runs command, a program's command line, in cwd, and records its figures, with about; and,
        where settings ({name: value}) is given, llm.c's own record that it ran with them (ran)."""
        result = dict(name="peers", variant=variant, config=self.size, **(about or {}))
        try:
            text = run(command, cwd, os.path.join(self.workdir, f"{variant}.log"), self.config.timeout)
            timed = read_log(program, text, self.config.total_batch_size, self.config.warmup)
            if settings:
                timed["ran"] = settings_that_ran(text, settings)
        except PeerError as e:
            return self.fail(variant, e)
        self.keep(self.judge(dict(result, **timed), self.results[0] if self.results else None))

    def fail(self, variant, error):
        """Records variant as failed, with error's line and the last lines of its output."""
        print(f"warning: peers: {variant}: {error}", file=sys.stderr)
        print("".join(f"    {line}\n" for line in error.log_tail), end="", file=sys.stderr)
        result = dict(name="peers", variant=variant, config=self.size, error=str(error))
        if error.log_tail:
            result["log_tail"] = error.log_tail
        self.keep(result)

    def keep(self, result):
        self.record(result)
        self.results.append(result)


def bench_peers(config, workdir, record, judge):
    """Times the project, build-nanogpt and each of llm.c's configurations in turn, each recorded
    as a result named peers (PeerRuns); then prints the ratios."""
    workdir = os.path.abspath(workdir)  # the programs run in scratch copies inside it
    data_dir = os.path.join(workdir, "peers-data")
    write_tokens(data_dir, config)
    patterns = llmc_token_files(data_dir, os.path.join(workdir, "peers-llmc-data"))
    builds = start_llmc_builds(config, workdir)
    runs = PeerRuns(config, workdir, record, judge)
    B, T, total, steps, warmup = (config.micro_batch_size, config.seq_len, config.total_batch_size, config.run_steps,
                                  config.warmup)
    try:
        runs.measure("project", "project", project_command(
            data_dir, os.path.join(workdir, "project-log"), B, T, total, steps, warmup), workdir)
        nanogpt = os.path.join(workdir, "build-nanogpt")
        try:
            script = adapt_build_nanogpt(config.build_nanogpt, nanogpt, data_dir, B, T, total, steps, warmup)
            runs.measure("build-nanogpt", "build-nanogpt", [sys.executable, script], nanogpt)
        except PeerError as e:
            runs.fail("build-nanogpt", e)
        for build, (scratch, make, log_path) in builds.items():
            try:
                if isinstance(make, PeerError):
                    raise make
                finish(make, log_path, config.timeout)
            except PeerError as e:
                runs.fail(build, e)
                continue
            measure_llmc(runs, build, scratch, patterns)
    finally:  # a run cut short leaves no build behind
        for _, make, _ in builds.values():
            if isinstance(make, subprocess.Popen) and make.poll() is None:
                make.kill()
                make.wait()
    print_ratios(runs.results)


def measure_llmc(runs, build, scratch, patterns):
    """Each run of an llm.c build that built in scratch (llmc_runs), recorded with the cuDNN its binary
    loads and what llm.c says it ran; a cuDNN build whose llm.c has no -ge says so in a row of its own."""
    about = None if build == "llm.c" else dict(cudnn=loaded_cudnn(os.path.join(scratch, "train_gpt2cu")))
    fusion = takes_gelu_fusion(scratch)
    for run in llmc_runs(build, fusion):
        command = llmc_run_command("./train_gpt2cu", patterns, runs.config, run)
        runs.measure(run.variant, "llm.c", command, scratch, about, run.settings())
    if build != "llm.c" and not fusion:
        runs.fail(f"{build}-ge", PeerError(f"this llm.c has no -ge (GELU fusion): no `{LLMC_GELU_FUSION}` in its "
                                           f"train_gpt2.cu"))


def print_ratios(results):
    """The project's tokens/s over each peer's that trained, and over llm.c's fastest configuration."""
    project = results[0].get("tokens_per_sec")
    timed = [r for r in results[1:] if r.get("tokens_per_sec")]
    if not project:
        return
    for result in timed:
        print(f"project / {result['variant']}: {project / result['tokens_per_sec']:.3f}x tokens/s")
    llmc = [r for r in timed if r["variant"].startswith("llm.c")]
    if llmc:
        best = max(llmc, key=lambda r: r["tokens_per_sec"])
        print(f"project / llm.c's fastest ({best['variant']}): {project / best['tokens_per_sec']:.3f}x tokens/s")


# ----------------------------------------------------------------------------- the probe

RUNTIME_LIBRARIES = ("libcuda", "libcublas", "libcublasLt", "libnvrtc", "libcudnn")  # what llm.c's binaries load


def library_dirs():
    """{where: [directories]} that the probe searches for RUNTIME_LIBRARIES: the toolkit's (llm.c's
    rpath is one), LD_LIBRARY_PATH's, the nvidia wheels' beside torch, and the loader cache's (ldconfig -p)."""
    places = {"toolkit": nvcc_library_dirs(),
              "LD_LIBRARY_PATH": [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]}
    wheels = nvidia_wheels()
    places["wheels"] = sorted(glob.glob(os.path.join(glob.escape(wheels), "*", "lib"))) if wheels else []
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        cache = ""
    places["loader cache"] = sorted({os.path.dirname(line.split(" => ")[1]) for line in cache.splitlines()
                                     if " => " in line})
    return places


def tool_version(command, line):
    """Where command's program is on PATH, and the line of its output at index line; "missing"
    without it."""
    path = shutil.which(command[0])
    if path is None:
        return f"{command[0]}: missing"
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        said = out[line] if -len(out) <= line < len(out) else "no output"
    except (OSError, subprocess.TimeoutExpired) as e:
        said = str(e)
    return f"{command[0]}: {path} ({said})"


def probe():
    """Lines that say what the peers need of this machine: the GPU and torch, make and nvcc, and
    where each library llm.c's binaries load lies (a run that fails to load one is read against them)."""
    import torch
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
             f"python {sys.version.split()[0]}"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU {torch.cuda.get_device_name()}: compute capability {major}.{minor}, "
                     f"GPU_COMPUTE_CAPABILITY={major}{minor}")
    else:
        lines.append("GPU: none that torch sees")
    lines += [tool_version(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 0),
              tool_version(["make", "--version"], 0), tool_version(["nvcc", "--version"], -2),
              f"llm.c's rpath to the toolkit's libraries: {cuda_toolkit_lib()}"]
    places = library_dirs()
    for library in RUNTIME_LIBRARIES:
        found = [f"{path} ({where})" for where, dirs in places.items() for d in dirs
                 for path in sorted(glob.glob(os.path.join(glob.escape(d), f"{library}.so*")))]
        lines.append(f"{library}: {', '.join(found) or 'not found'}")
    return lines


if __name__ == "__main__":
    print("\n".join(probe()))
