"""The peers benchmark: this project's trainer beside the trainers a user would run instead,
build-nanogpt's train_gpt2.py (compiled) and llm.c's train_gpt2cu (with and without cuDNN
attention), on one GPU, the same token shards, and the same B, T and tokens per step.

Each peer runs from a scratch copy of the user's checkout, adapted by this module and never by
hand: build-nanogpt's step count, micro-batch, compile switch, data directory and tokenizer
(offline: the vendored one), plus a line that prints its peak memory; llm.c's out-of-memory
fallback to managed memory (CUDA 13 refuses its cudaMemAdvise call, and managed memory must not
stand in for GPU memory in a benchmark) and its link flags. Each program's own log gives its
milliseconds per step; the first warmup steps (compilation, autotuning) and the last (evaluation)
are left out, and the median of the rest is the result. bench.py --parts peers runs this.
"""
import glob
import os
from dataclasses import dataclass
import re
import shutil
import statistics
import subprocess
import sys

import numpy as np

from data import Shard, shard_name, write_shard
from tokenizer import N_VOCAB

REPO = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("project", "build-nanogpt", "llm.c", "llm.c-cudnn")
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256  # llm.c's dataloader.h token-file header


class PeerError(Exception):
    """A checkout that is missing or not what this module adapts, or a peer that failed."""


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
    """A fresh copy of the checkout src at dst, without its git history."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git"), symlinks=True)


def edit(path, replacements, name):
    """Replaces in the file at path each old text, which must occur exactly once, by its new one."""
    with open(path) as f:
        text = f.read()
    for old, new in replacements:
        if text.count(old) != 1:
            raise PeerError(f"{name}'s {os.path.basename(path)} has changed: expected one `{old.strip()}`, "
                            f"found {text.count(old)}")
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)


def adapt_build_nanogpt(checkout, scratch, data_dir, B, T, total_batch_size, steps):
    """A copy of build-nanogpt at scratch that trains steps steps of B x T sequences, total_batch_size
    tokens a step, compiled, on data_dir's shards, with this repository's tokenizer (tiktoken's
    download needs the network), and prints its peak memory at the end. Returns its script."""
    check_checkout(checkout, BUILD_NANOGPT_FILES, "build-nanogpt")
    scratch_copy(checkout, scratch)
    script = os.path.join(scratch, "train_gpt2.py")
    edit(script, [
        ('data_root = "edu_fineweb10B"', f"data_root = {os.path.abspath(data_dir)!r}"),
        ('enc = tiktoken.get_encoding("gpt2")',
         f"sys.path.insert(0, {REPO!r}); from tokenizer import get_encoding; enc = get_encoding()"),
        ("total_batch_size = 524288", f"total_batch_size = {total_batch_size}"),
        ("B = 64 ", f"B = {B} "),
        ("T = 1024 ", f"T = {T} "),
        ("use_compile = False", "use_compile = True"),
        ("max_steps = 19073", f"max_steps = {steps}"),
        ("import os\n", "import os\nimport sys\n"),
    ], "build-nanogpt")
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
    """The include directory of a cudnn-frontend checkout where llm.c's Makefile looks for one:
    inside the llm.c checkout, or in the home directory; None if neither has one."""
    for root in (llmc_checkout, os.path.expanduser("~")):
        include = os.path.join(root, "cudnn-frontend", "include")
        if os.path.isdir(include):
            return include
    return None


def llmc_make_command(cudnn_include=None, wheel=None):
    """make's command line for train_gpt2cu, with cuDNN attention when cudnn_include (a
    cudnn-frontend's headers) is given; today's cudnn-frontend also needs nvrtc and the driver
    library. wheel: cuDNN from the nvidia-cudnn wheel beside torch (cudnn_wheel), else the system's."""
    command = ["make", "train_gpt2cu", f"USE_CUDNN={int(cudnn_include is not None)}", "NO_MULTI_GPU=1", "NO_USE_MPI=1"]
    if cudnn_include is not None:
        headers, ldlibs = cudnn_include, "-lnvrtc -lcuda"
        if wheel is not None:
            include, link, lib = wheel
            headers += f" -I{include}"  # the Makefile puts -I before CUDNN_FRONTEND_PATH: cuDNN's own headers ride along
            ldlibs += f" -L{link} -Xlinker -rpath={lib}"
        command += [f"CUDNN_FRONTEND_PATH={headers}", f"NVCC_LDLIBS={ldlibs}"]
    return command


def cudnn_wheel(scratch):
    """The nvidia-cudnn wheel beside torch as llm.c's build needs it, or None without one: (its
    headers, a directory in scratch where libcudnn.so names the wheel's versioned library, which
    -lcudnn cannot find alone, and the wheel's library directory, for the binary to load it from)."""
    try:
        import nvidia.cudnn
    except ImportError:
        return None
    root = list(nvidia.cudnn.__path__)[0]
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    versioned = sorted(glob.glob(os.path.join(glob.escape(lib), "libcudnn.so.*")))
    if not (os.path.isdir(include) and versioned):
        return None
    link = os.path.join(scratch, "cudnn-link")
    os.makedirs(link, exist_ok=True)
    if not os.path.lexists(os.path.join(link, "libcudnn.so")):
        os.symlink(versioned[0], os.path.join(link, "libcudnn.so"))
    return include, link, lib


def llmc_run_command(binary, train_pattern, val_pattern, B, T, total_batch_size, steps):
    """train_gpt2cu on a fresh GPT-2 (124M), no recompute, no evaluation but at the first and last
    step (which the timing leaves out), no sampling, HellaSwag or checkpoints."""
    return [binary, "-i", train_pattern, "-j", val_pattern, "-e", "d12", "-b", str(B), "-t", str(T),
            "-d", str(total_batch_size), "-x", str(steps), "-r", "0", "-z", "1", "-v", str(10 * steps + 1),
            "-s", "0", "-h", "0", "-n", "0", "-l", "0.0006", "-u", "700", "-c", "0.1", "-q", "0.0"]


def project_command(data_dir, log_dir, B, T, total_batch_size, steps):
    """This project's trainer with its defaults, on data_dir, with no evaluation, samples or HellaSwag."""
    return [sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data_dir", data_dir, "--log_dir", log_dir,
            "-B", str(B), "-T", str(T), "--total_batch_size", str(total_batch_size), "--max_steps", str(steps),
            "--eval_interval", "0", "--hellaswag", "0", "--sample_interval", "0", "--resume", "none"]


# ----------------------------------------------------------------------------- the logs

STEP_MS = {  # each program's step line, and the group that holds its milliseconds
    "project": re.compile(r"^step +\d+ \| loss .*\| dt ([\d.]+)ms"),
    "build-nanogpt": re.compile(r"^step +\d+ \| loss: .*\| dt: ([\d.]+)ms"),
    "llm.c": re.compile(r"^step +\d+/\d+ \| loss .*\| ([\d.]+) ms \|"),
}
PEAK_BYTES = {  # each program's own report of its peak memory, in bytes
    "project": (re.compile(r"\| mem ([\d.]+)GiB"), 2**30),  # torch.cuda.max_memory_allocated, every step
    "build-nanogpt": (re.compile(r"^peak memory: (\d+) bytes"), 1),  # the line adapt_build_nanogpt adds
    "llm.c": (re.compile(r"^device memory usage: (\d+) MiB"), 2**20),  # cudaMemGetInfo: all the GPU's use
}


def read_log(program, text, tokens_per_step, warmup):
    """ms per step, tokens/s and peak memory (bytes) from a program's output: the median step time
    of the steps after warmup, less the last one. PeerError if too few steps are left."""
    times = [float(m.group(1)) for line in text.splitlines() if (m := STEP_MS[program].search(line))]
    steady = times[warmup:-1]
    if not steady:
        raise PeerError(f"{program}: {len(times)} step(s) in its output, too few after {warmup} warm-up step(s) "
                        f"and the last")
    pattern, unit = PEAK_BYTES[program]
    peaks = [float(m.group(1)) * unit for line in text.splitlines() if (m := pattern.search(line))]
    ms = statistics.median(steady)
    return dict(ms_per_step=ms, tokens_per_sec=tokens_per_step / ms * 1000, steady_steps=len(steady),
                peak_mem_bytes=max(peaks) if peaks else None)


def run(command, cwd, log_path, timeout):
    """Runs command in cwd, its output (stdout and stderr) written to log_path and returned.
    PeerError in one line if it fails or outlasts timeout seconds."""
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"{command[0]}: still running after {timeout} s (its output: {log_path})") from None
        except OSError as e:
            raise PeerError(f"{command[0]}: {e.strerror}") from None
    with open(log_path, errors="replace") as f:
        text = f.read()
    if code != 0:
        last = text.strip().splitlines()[-1:] or ["no output"]
        raise PeerError(f"{' '.join(command[:2])} exited with {code}: {last[0][:300]} (its output: {log_path})")
    return text


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
    timeout: int = 1800  # seconds a program may run, its start and compilation included

    @property
    def run_steps(self):
        return self.warmup + self.steps + 1


def write_tokens(data_dir, config):
    """Random GPT-2 ids: a val shard and a train shard of a few steps' tokens (every loader wraps)."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, index, steps in (("val", 0, 2), ("train", 1, 4)):
        tokens = rng.integers(0, N_VOCAB, steps * config.total_batch_size + 1)
        write_shard(os.path.join(data_dir, shard_name("peers", split, index)), tokens)


def start_llmc_builds(config, workdir):
    """Scratch copies of llm.c, adapted, and their builds started (on the CPU, while the GPU trains
    the others): {variant: (directory, process, build log)}. cuDNN's variant only where a
    cudnn-frontend checkout is found."""
    include = cudnn_frontend(config.llmc)
    builds = {}
    for variant, cudnn in (("llm.c", None), ("llm.c-cudnn", include)):
        if variant == "llm.c-cudnn" and include is None:
            continue
        scratch = os.path.join(workdir, variant)
        adapt_llmc(config.llmc, scratch)
        log_path = os.path.join(workdir, f"{variant}-build.log")
        with open(log_path, "w") as log:
            command = llmc_make_command(cudnn, cudnn_wheel(scratch) if cudnn else None)
            build = subprocess.Popen(command, cwd=scratch, stdout=log, stderr=subprocess.STDOUT)
        builds[variant] = scratch, build, log_path
    return builds


def bench_peers(config, workdir, record):
    """Times each variant in turn and records each as a result named peers; a peer that fails is
    recorded with its error, and the others still run."""
    data_dir = os.path.join(workdir, "peers-data")
    write_tokens(data_dir, config)
    train_pattern, val_pattern = llmc_token_files(data_dir, os.path.join(workdir, "peers-llmc-data"))
    builds = start_llmc_builds(config, workdir)
    size = f"B{config.micro_batch_size} T{config.seq_len} {config.total_batch_size:,} tokens/step"

    def measure(variant, program, command, cwd):
        result = dict(name="peers", variant=variant, config=size)
        try:
            text = run(command(), cwd, os.path.join(workdir, f"{variant}.log"), config.timeout)
            result.update(read_log(program, text, config.total_batch_size, config.warmup))
        except PeerError as e:
            print(f"warning: peers: {variant}: {e}", file=sys.stderr)
            result["error"] = str(e)
        record(result)
        return result

    B, T, total = config.micro_batch_size, config.seq_len, config.total_batch_size
    results = [measure("project", "project", lambda: project_command(data_dir, os.path.join(workdir, "project-log"),
                                                                      B, T, total, config.run_steps), workdir)]
    nanogpt = os.path.join(workdir, "build-nanogpt")
    results.append(measure("build-nanogpt", "build-nanogpt", lambda: [sys.executable, adapt_build_nanogpt(
        config.build_nanogpt, nanogpt, data_dir, B, T, total, config.run_steps)], nanogpt))
    for variant in ("llm.c", "llm.c-cudnn"):
        if variant not in builds:
            results.append(measure(variant, "llm.c", lambda: no_cudnn_frontend(config.llmc), workdir))
            continue
        scratch, build, log_path = builds[variant]

        def command():
            if build.wait() != 0:
                raise PeerError(f"make exited with {build.returncode} (its output: {log_path})")
            return llmc_run_command("./train_gpt2cu", train_pattern, val_pattern, B, T, total, config.run_steps)
        results.append(measure(variant, "llm.c", command, scratch))
    print_ratios(results)


def no_cudnn_frontend(llmc):
    raise PeerError(f"no cudnn-frontend checkout in {llmc} or ~ (git clone https://github.com/NVIDIA/cudnn-frontend "
                    f"into either)")


def print_ratios(results):
    project = results[0].get("tokens_per_sec")
    for result in results[1:]:
        if project and result.get("tokens_per_sec"):
            print(f"project / {result['variant']}: {project / result['tokens_per_sec']:.3f}x tokens/s")
