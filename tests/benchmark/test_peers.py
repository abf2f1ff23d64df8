"""The peers benchmark's CPU-testable parts: llm.c's token files, the scratch copies adapted from
each peer's checkout (the checkout itself untouched), each program's log read back, and the
refusals. The peers' runs themselves need a GPU (docs/benchmarks.md)."""
import glob
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

import bench
from gpt2repro.benchmark import peers
from gpt2repro.lm.data import shard_name, write_shard
from gpt2repro.lm.tokenizer import get_encoding
from helpers.processes import exit_message, run_script

# The statements of build-nanogpt's train_gpt2.py that the adaptation rewrites, in a stand-in script.
BUILD_NANOGPT_SCRIPT = '''import os
import tiktoken
data_root = "edu_fineweb10B"
enc = tiktoken.get_encoding("gpt2")
total_batch_size = 524288 # tokens
B = 64 # micro batch size
T = 1024 # sequence length
use_compile = False # compile
warmup_steps = 715
max_steps = 19073 # one epoch
'''
# The statements of build-nanogpt's hellaswag.py that the adaptation rewrites, in a stand-in script.
HELLASWAG_SCRIPT = '''import os
import tiktoken
enc = tiktoken.get_encoding("gpt2")
'''
# What peers.py reads of llm.c's train_gpt2.cu: the usage line of its GELU fusion flag, in a stand-in file.
LLMC_SOURCE = '''    fprintf(stderr, "  -ge <int>   gelu fusion: 0=none, 1=forward, 2=forward+backward (default: 2 for >=SM90, 0 for older GPUs)\\n");
'''
# The out-of-memory fallback of llm.c's cuda_utils.cuh, in a stand-in file.
LLMC_FALLBACK = '''int cudaMallocConditionallyManaged(void** out, size_t bytes, const char *file, int line) {
    cudaError_t err = cudaMalloc(out, bytes);
    if(err == cudaErrorMemoryAllocation) {
        cudaGetLastError(); // reset the error before the next API call
        cudaCheck_(cudaMallocManaged(out, bytes), file, line);
        cudaCheck_(cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId), file, line);
        return 1;
    }
}
'''


NVIDIA_WHEELS = peers.nvidia_wheels  # the real one, which the fixture below replaces


@pytest.fixture(autouse=True)
def no_libraries_but_the_tests(monkeypatch):
    """The machine's own CUDA libraries out of sight: no nvidia-* wheels beside torch (a CUDA build of
    torch brings nvidia-cudnn's) and no LD_LIBRARY_PATH, so that each test sees only the stand-ins it
    makes, whether or not the machine has the real ones."""
    monkeypatch.setattr(peers, "nvidia_wheels", lambda: None)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)


def make_checkout(root, files):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    return str(root)


@pytest.fixture
def build_nanogpt(tmp_path):
    return make_checkout(tmp_path / "build-nanogpt", {"train_gpt2.py": BUILD_NANOGPT_SCRIPT,
                                                      "hellaswag.py": HELLASWAG_SCRIPT})


@pytest.fixture
def llmc(tmp_path):
    return make_checkout(tmp_path / "llm.c", {"train_gpt2.cu": LLMC_SOURCE, "Makefile": "", "llmc/cuda_utils.cuh": LLMC_FALLBACK})


def test_llmc_token_files_hold_the_shards_tokens_behind_llmc_header(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, 50257, 1001)
    write_shard(str(data / shard_name("t", "train", 1)), tokens)
    write_shard(str(data / shard_name("t", "val", 0)), tokens[:99])
    train, val = peers.llmc_token_files(str(data), str(tmp_path / "bin"))
    (train_file,), (val_file,) = glob.glob(train), glob.glob(val)
    raw = open(train_file, "rb").read()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 1001] and not header[3:].any()
    assert len(raw) == 256 * 4 + 2 * 1001  # the size llm.c's dataloader checks
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == tokens.tolist()
    assert np.frombuffer(open(val_file, "rb").read()[1024:], dtype="<u2").tolist() == tokens[:99].tolist()


def test_build_nanogpt_is_adapted_in_a_copy(build_nanogpt, tmp_path):
    script = peers.adapt_build_nanogpt(build_nanogpt, str(tmp_path / "scratch"), "shards", 16, 256, 8192, 9, 2)
    with open(script) as f:
        text = f.read()
    assert text.endswith('print(f"peak memory: {torch.cuda.max_memory_allocated()} bytes")\n')
    settings, path = {}, list(sys.path)
    exec(text[: text.rindex("print(")], settings)  # all but the peak-memory line, which needs CUDA
    assert (settings["B"], settings["T"], settings["total_batch_size"], settings["max_steps"]) == (16, 256, 8192, 9)
    assert settings["warmup_steps"] == 2  # the lr warmed up as the project's and llm.c's, so that all three train
    assert settings["use_compile"] is True and settings["data_root"] == os.path.abspath("shards")
    with open(tmp_path / "scratch" / "hellaswag.py") as f:
        hellaswag = f.read()
    assert "tiktoken.get_encoding" not in text and "tiktoken.get_encoding" not in hellaswag  # both offline
    exec(hellaswag, hellaswag_module := {})  # train_gpt2.py imports it first
    for module in (settings, hellaswag_module):
        assert module["enc"].encode_ordinary("Hello, I'm a language model,") == get_encoding().encode_ordinary(
            "Hello, I'm a language model,")  # the vendored tokenizer: no download
    assert sys.path == path  # this repository's folder was on it only for the import
    assert snapshot(build_nanogpt) == {"train_gpt2.py": BUILD_NANOGPT_SCRIPT.encode(),
                                       "hellaswag.py": HELLASWAG_SCRIPT.encode()}


def snapshot(root, leave_out=None):
    """Everything under root, read without following a link: {relative path: bytes, or ("link",
    target), or ("dir",), or ("other", its mode)}, leaving out the directory leave_out."""
    found = {}
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.join(here, d) != leave_out]
        for name in dirs + files:
            path = os.path.join(here, name)
            mode = os.lstat(path).st_mode
            found[os.path.relpath(path, root)] = (
                ("link", os.readlink(path)) if stat.S_ISLNK(mode) else ("dir",) if stat.S_ISDIR(mode)
                else open(path, "rb").read() if stat.S_ISREG(mode) else ("other", stat.S_IFMT(mode)))
    return found


@pytest.mark.parametrize("absolute", [False, True])
def test_a_link_out_of_the_checkout_is_refused_and_nothing_outside_the_scratch_copy_changes(tmp_path, absolute):
    """The scratch copy is at the checkout's depth: a relative link out of it, copied as a link,
    would name the same file outside from there."""
    outside = make_checkout(tmp_path / "outside", {"train_gpt2.py": BUILD_NANOGPT_SCRIPT})
    checkout = make_checkout(tmp_path / "build-nanogpt", {"hellaswag.py": HELLASWAG_SCRIPT})
    target = os.path.join(outside, "train_gpt2.py") if absolute else os.path.join("..", "outside", "train_gpt2.py")
    os.symlink(target, os.path.join(checkout, "train_gpt2.py"))
    scratch = str(tmp_path / "scratch")
    before = snapshot(tmp_path, leave_out=scratch)
    with pytest.raises(peers.PeerError, match=r"train_gpt2.py: a link out of the checkout, to .*outside/train_gpt2.py"):
        peers.adapt_build_nanogpt(checkout, scratch, "shards", 16, 256, 8192, 9, 2)
    assert snapshot(tmp_path, leave_out=scratch) == before


def test_a_link_inside_the_checkout_is_copied_as_the_file_it_names(tmp_path):
    checkout = make_checkout(tmp_path / "build-nanogpt", {"src/train.py": BUILD_NANOGPT_SCRIPT,
                                                         "hellaswag.py": HELLASWAG_SCRIPT})
    os.symlink(os.path.join(checkout, "src", "train.py"), os.path.join(checkout, "train_gpt2.py"))
    scratch = str(tmp_path / "scratch")
    before = snapshot(tmp_path, leave_out=scratch)
    script = peers.adapt_build_nanogpt(checkout, scratch, "shards", 16, 256, 8192, 9, 2)
    assert snapshot(tmp_path, leave_out=scratch) == before
    assert not os.path.islink(script) and "use_compile = True" in open(script).read()
    assert open(os.path.join(scratch, "src", "train.py")).read() == BUILD_NANOGPT_SCRIPT  # a copy too


@pytest.mark.parametrize("make_odd, message", [
    (lambda checkout: os.mkfifo(os.path.join(checkout, "pipe")), r"pipe: not a regular file \(a FIFO"),
    (lambda checkout: os.symlink(os.path.join(checkout, "src"), os.path.join(checkout, "data")),
     r"data: a link to a directory \(the scratch copy follows none\)"),
    (lambda checkout: open(os.path.join(checkout, "train_gpt2.py"), "ab").write(b"# caf\xe9\n"),
     r"build-nanogpt's train_gpt2.py is not UTF-8 text \(byte \d+\): not the file this module adapts")],
    ids=["fifo", "directory_link", "not_utf8"])
def test_a_checkout_that_is_not_plain_text_files_is_one_line(build_nanogpt, tmp_path, make_odd, message):
    os.makedirs(os.path.join(build_nanogpt, "src"))
    make_odd(build_nanogpt)
    before = snapshot(tmp_path, leave_out=str(tmp_path / "scratch"))
    with pytest.raises(peers.PeerError, match=message):
        peers.adapt_build_nanogpt(build_nanogpt, str(tmp_path / "scratch"), "shards", 16, 256, 8192, 9, 2)
    assert snapshot(tmp_path, leave_out=str(tmp_path / "scratch")) == before


def test_a_changed_build_nanogpt_is_one_line_naming_what_is_missing(build_nanogpt, tmp_path):
    with open(os.path.join(build_nanogpt, "train_gpt2.py"), "w") as f:
        f.write(BUILD_NANOGPT_SCRIPT.replace("use_compile = False", "use_compile = True"))
    with pytest.raises(peers.PeerError, match=r"build-nanogpt's train_gpt2.py has changed: expected one "
                                              r"`use_compile = False`, found 0"):
        peers.adapt_build_nanogpt(build_nanogpt, str(tmp_path / "scratch"), "shards", 64, 1024, 524288, 9, 2)


def test_llmc_fails_where_it_would_fall_back_to_managed_memory(llmc, tmp_path):
    peers.adapt_llmc(llmc, str(tmp_path / "scratch"))
    with open(tmp_path / "scratch" / "llmc" / "cuda_utils.cuh") as f:
        adapted = f.read()
    assert "cudaMallocManaged" not in adapted and "cudaMemAdvise" not in adapted
    assert "cudaGetLastError(); // reset the error before the next API call\n        cudaCheck_(err, file, line);" in adapted
    with open(os.path.join(llmc, "llmc", "cuda_utils.cuh")) as f:
        assert f.read() == LLMC_FALLBACK


def test_llmc_commands(tmp_path):
    config = peers.PeersConfig("", "", micro_batch_size=64, seq_len=1024, total_batch_size=524288, steps=20, warmup=5,
                               gpu_arch="90", timeout=60)
    run = peers.llmc_run_command("./train_gpt2cu", ("d/*_train_*.bin", "d/*_val_*.bin"), config, peers.LlmcRun("x", 0))
    flags = dict(zip(run[1::2], run[2::2]))
    assert "-ge" not in flags  # llm.c's default: no GELU fusion
    fused = peers.llmc_run_command("./train_gpt2cu", ("t", "v"), config, peers.LlmcRun("x", 1, gelu_fusion=2))
    assert dict(zip(fused[1::2], fused[2::2]))["-ge"] == "2" and dict(zip(fused[1::2], fused[2::2]))["-z"] == "1"
    assert (flags["-i"], flags["-j"]) == ("d/*_train_*.bin", "d/*_val_*.bin")
    assert (flags["-b"], flags["-t"], flags["-d"], flags["-x"], flags["-r"], flags["-e"], flags["-z"]) == (
        "64", "1024", "524288", "26", "0", "d12", "0")
    assert (flags["-l"], flags["-u"], flags["-q"]) == ("0.0006", "5", "0.1")  # the project's lr, warmup and floor
    assert int(flags["-v"]) > 26 and flags["-s"] == flags["-h"] == "0"  # no evaluation but the first and last step
    assert peers.llmc_make_command("90") == ["make", "train_gpt2cu", "GPU_COMPUTE_CAPABILITY=90", "USE_CUDNN=0",
                                             "NO_MULTI_GPU=1", "NO_USE_MPI=1"]
    with_cudnn = peers.llmc_make_command("90", str(tmp_path), toolkit_lib="/cuda/lib")
    assert "USE_CUDNN=1" in with_cudnn and f"CUDNN_FRONTEND_PATH={tmp_path}" in with_cudnn
    assert with_cudnn[-1] == "NVCC_LDLIBS=-lnvrtc -lcuda -Xlinker -rpath=/cuda/lib"


def test_a_cudnn_frontend_given_by_a_relative_path_reaches_make_as_an_absolute_one(tmp_path, monkeypatch):
    """make runs in a scratch copy elsewhere: a relative include path would name nothing there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert peers.cudnn_frontend("llm.c") is None
    os.makedirs(tmp_path / "llm.c" / "cudnn-frontend" / "include")
    assert peers.cudnn_frontend("llm.c") == str(tmp_path / "llm.c" / "cudnn-frontend" / "include")
    os.makedirs(tmp_path / "home" / "cudnn-frontend" / "include")
    assert peers.cudnn_frontend(str(tmp_path / "elsewhere")) == str(tmp_path / "home" / "cudnn-frontend" / "include")


def fake_program(directory, name, script):
    """An executable shell script named name in directory."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + script)
    os.chmod(path, 0o755)
    return path


def test_llmc_is_linked_with_an_rpath_to_where_nvcc_found_cublaslt(tmp_path, monkeypatch):
    """The directory comes from nvcc's own --dryrun, the stubs (a link-time libcuda) left out."""
    toolkit = tmp_path / "cuda-13.0" / "targets" / "x86_64-linux" / "lib"
    (toolkit / "stubs").mkdir(parents=True)
    (toolkit / "libcublasLt.so.13").write_bytes(b"")
    fake_program(tmp_path / "bin", "nvcc", f"""echo '#$ TOP={tmp_path}/cuda-13.0/bin/..' >&2
echo '#$ LIBRARIES=  "-L{tmp_path}/cuda-13.0/bin/../targets/x86_64-linux/lib/stubs" "-L{tmp_path}/cuda-13.0/bin/../targets/x86_64-linux/lib"' >&2
""")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert peers.cuda_toolkit_lib() == str(toolkit)
    assert f"libcublasLt: {toolkit}/libcublasLt.so.13 (toolkit)" in peers.probe()
    os.remove(toolkit / "libcublasLt.so.13")
    assert peers.cuda_toolkit_lib() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert peers.cuda_toolkit_lib() is None and "nvcc: missing" in peers.probe()


def test_llmc_is_built_for_the_gpu_that_runs_it(monkeypatch, llmc, build_nanogpt):
    monkeypatch.setattr(bench.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    args = bench.parse_args(["--device", "cpu", "--parts", "matmul", "--llmc", llmc, "--build_nanogpt", build_nanogpt,
                             "--peer_timeout", "150"])
    config = bench.peers_config(args)
    assert (config.gpu_arch, config.timeout, config.micro_batch_size, config.total_batch_size) == ("90", 150, 64, 524288)


def test_cudnn_from_the_wheel_beside_torch_is_found_and_linked(tmp_path, monkeypatch):
    """The nvidia-cudnn wheel ships libcudnn.so.9 but no libcudnn.so, which -lcudnn looks for."""
    wheel = tmp_path / "nvidia" / "cudnn"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "lib" / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.setattr(peers, "nvidia_wheels", lambda: str(wheel.parent))
    found = peers.cudnn_wheel(str(tmp_path / "scratch"))
    link = tmp_path / "scratch" / "cudnn-link"
    assert found == (str(wheel / "include"), str(link), str(wheel / "lib"))
    assert os.readlink(link / "libcudnn.so") == str(wheel / "lib" / "libcudnn.so.9")
    command = peers.llmc_make_command("90", "/front/include", found)
    assert f"CUDNN_FRONTEND_PATH=/front/include -I{wheel / 'include'}" in command
    assert f"NVCC_LDLIBS=-lnvrtc -lcuda -L{link} -Xlinker -rpath={wheel / 'lib'}" in command
    monkeypatch.setattr(peers, "nvidia_wheels", lambda: str(tmp_path / "elsewhere"))  # nvidia wheels, not cuDNN's
    assert peers.cudnn_wheel(str(tmp_path / "scratch")) is None
    monkeypatch.setattr(peers, "nvidia_wheels", lambda: None)  # none at all: the system's cuDNN
    assert peers.cudnn_wheel(str(tmp_path / "scratch")) is None


def test_the_nvidia_wheels_are_where_the_nvidia_package_lies(tmp_path, monkeypatch):
    """The wheels' folder is the nvidia namespace package's, wherever Python finds it; None without one."""
    (tmp_path / "nvidia" / "cudnn").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name == "nvidia" or name.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert NVIDIA_WHEELS() == str(tmp_path / "nvidia")
    monkeypatch.setitem(sys.modules, "nvidia", None)  # as if not installed: the import fails
    assert NVIDIA_WHEELS() is None


LOGS = {
    "llm.c": ["device memory usage: 27000 MiB / 143000 MiB"]
             + [f"step {i:4d}/8 | loss {loss} (+0.00z)| norm {norm:6.4f} (+0.00z)| lr 1.00e-05 | {ms:.2f} ms | "
                f"559000 tok/s" for i, (loss, norm, ms) in enumerate(zip(
                 [10.9, 9.5, 8.1, 7.0, 6.5], [1.0, 0.5, 0.25, 0.125, 0.0625], [9000, 950, 940, 930, 2000]), 1)],
    "build-nanogpt": ["validation loss: 10.95"]
                     + [f"step {i:5d} | loss: {loss} | lr 6.0e-05 | norm: {norm:.4f} | dt: {ms:.2f}ms | tok/sec: 5.00"
                        for i, (loss, norm, ms) in enumerate(zip([10.9, 9.5, 8.1, 7.0, 6.5], [1.0, 0.5, 0.25, 0.125, 0.0625],
                                                                [9000, 950, 940, 930, 2000]))]
                     + ["peak memory: 32212254720 bytes"],
}


@pytest.mark.parametrize("program", LOGS)
def test_each_peers_log_gives_its_steady_median_step_and_every_steps_loss_and_norm(program):
    result = peers.read_log(program, "\n".join(LOGS[program]), 524288, warmup=1)
    assert result["ms_per_step"] == 940 and result["steady_steps"] == 3  # the warm-up and last steps left out
    assert result["tokens_per_sec"] == pytest.approx(524288 / 0.94)
    assert result["peak_mem_bytes"] == {"llm.c": 27000 * 2**20, "build-nanogpt": 32212254720}[program]
    assert result["losses"] == [10.9, 9.5, 8.1, 7.0, 6.5] and result["grad_norms"] == [1.0, 0.5, 0.25, 0.125, 0.0625]
    with pytest.raises(peers.PeerError, match="5 step"):
        peers.read_log(program, "\n".join(LOGS[program]), 524288, warmup=4)


def llmc_output(norm, ms):
    """llm.c's step lines, every norm printed as norm (C's printf writes a NaN as -nan), ms a step."""
    return "\n".join(f"step {i:4d}/5 | loss {loss} (+0.00z)| norm {norm} (+0.00z)| lr 1.00e-05 | {ms:.2f} ms | 1 tok/s"
                     for i, loss in enumerate([10.9, 9.5, 8.1, 7.0, 6.5], 1))


def test_a_peer_that_trains_nothing_is_reported_wrong_and_gets_no_ratio(capsys):
    """A gradient of nothing (0.0000) or NaN: judged as the run it is, with no speed, and the ratios
    are taken against the runs that trained, llm.c's fastest among them."""
    def run(variant, norm, ms, reference=None):
        return bench.judged(dict(variant=variant, **peers.read_log("llm.c", llmc_output(norm, ms), 524288, 1)), reference)
    project = run("project", "1.0000", 1000)
    runs = [project, run("llm.c", "1.0000", 1500, project), run("llm.c-cudnn-wheel-z1", "0.0000", 100, project),
            run("llm.c-cudnn-wheel-z0", "-nan", 200, project), run("llm.c-cudnn-system-z0", "1.0000", 900, project)]
    assert [r.get("wrong") for r in runs] == [None, None, "its gradient norm at step 0 is 0.0",
                                              "its gradient norm at step 0 is nan", None]
    assert ["tokens_per_sec" in r for r in runs] == [True, True, False, False, True]
    peers.print_ratios(runs)
    assert capsys.readouterr().out.splitlines() == [
        "project / llm.c: 1.500x tokens/s", "project / llm.c-cudnn-system-z0: 0.900x tokens/s",
        "project / llm.c's fastest (llm.c-cudnn-system-z0): 0.900x tokens/s"]


def run_the_project_on_the_cpu(tmp_path):
    """The trainer's real output, on the CPU at a tiny size, through the command the peers run."""
    config = peers.PeersConfig("", "", micro_batch_size=2, seq_len=32, total_batch_size=128, steps=2, warmup=1,
                               gpu_arch="90", timeout=300)
    peers.write_tokens(str(tmp_path / "data"), config)
    command = peers.project_command(str(tmp_path / "data"), str(tmp_path / "log"), 2, 32, 128, config.run_steps,
                                    config.warmup)
    command += ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--device", "cpu"]
    return peers.read_log("project", peers.run(command, str(tmp_path), str(tmp_path / "project.log"), timeout=300),
                          128, config.warmup)


@pytest.mark.slow
def test_the_projects_own_log_is_read_back(tmp_path):
    result = run_the_project_on_the_cpu(tmp_path)
    assert result["steady_steps"] == 2 and result["ms_per_step"] > 0 and result["peak_mem_bytes"] is None


@pytest.mark.slow
def test_the_projects_run_writes_no_checkpoint(tmp_path):
    """At GPT-2 (124M) its last checkpoint is 1.5 GB, written after the timed steps: time and disk
    the benchmark's job does not have."""
    run_the_project_on_the_cpu(tmp_path)
    assert not [name for name in os.listdir(tmp_path / "log") if name.startswith("ckpt")]


def test_a_failing_program_is_one_line_with_the_last_lines_of_its_output(tmp_path):
    """Its log lives in a temporary directory, gone once bench.py exits: the error keeps its tail."""
    with pytest.raises(peers.PeerError) as e:
        peers.run(["sh", "-c", "seq 1 40; echo boom; exit 3"], str(tmp_path), str(tmp_path / "x.log"), timeout=60)
    assert str(e.value) == "sh -c exited with 3: boom"
    assert e.value.log_tail == [str(i) for i in range(12, 41)] + ["boom"]
    with pytest.raises(peers.PeerError) as e:
        peers.run(["sh", "-c", "echo compiling; exec sleep 60"], str(tmp_path), str(tmp_path / "y.log"), timeout=0.5)
    assert str(e.value) == "sh -c: still running after 0.5 s, stopped" and e.value.log_tail == ["compiling"]
    with pytest.raises(peers.PeerError, match=r"^no-such-program: No such file or directory$"):
        peers.run(["no-such-program"], str(tmp_path), str(tmp_path / "z.log"), timeout=60)


@pytest.mark.parametrize("flags, expected", [
    ([], "--parts peers needs --llmc DIR, a checkout of llm.c"),
    (["--llmc", "{llmc}"], "--parts peers needs --build_nanogpt DIR, a checkout of build-nanogpt"),
    (["--llmc", "{missing}", "--build_nanogpt", "{build_nanogpt}"], "--llmc: {missing}: no such directory (a checkout of llm.c)"),
    (["--llmc", "{build_nanogpt}", "--build_nanogpt", "{build_nanogpt}"],
     "--llmc: {build_nanogpt}: not a checkout of llm.c (no train_gpt2.cu, Makefile, llmc/cuda_utils.cuh)"),
    (["--llmc", "{llmc}", "--build_nanogpt", "{build_nanogpt}"],
     "--parts peers: the peers train on a CUDA GPU, and this run's device is cpu"),
])
def test_the_peers_are_refused_in_one_line_before_anything_runs(capsys, llmc, build_nanogpt, tmp_path, flags, expected):
    paths = dict(llmc=llmc, build_nanogpt=build_nanogpt, missing=str(tmp_path / "missing"))
    argv = ["--parts", "peers", "--device", "cpu", *(f.format(**paths) for f in flags)]
    assert exit_message(capsys, bench.parse_args, *argv) == f"bench.py: error: {expected.format(**paths)}" + (
        " (see --help)" if "needs" in expected else "")


@pytest.mark.slow
def test_the_peers_run_only_when_named():
    assert "peers" not in bench.parse_args(["--device", "cpu"]).parts
    result = run_script("bench.py", "--parts", "peers")
    assert result.returncode != 0 and "--parts peers needs --llmc DIR" in result.stderr


# A stand-in for a program's run: four step lines in the project's format, 10 ms each, its loss falling.
PROJECT_STEPS = "".join(f"print('step {i:5d} | loss {10.9 - i} | lr 6e-4 | norm 1.0 | dt 10.00ms | tok/s 1 | mfu 0% | "
                        f"mem 1.0GiB')\n" for i in range(4))


def stand_in_peers(tmp_path, monkeypatch, cuda_utils=LLMC_FALLBACK, source=LLMC_SOURCE):
    """Checkouts in tmp_path/peers of llm.c (cudnn-frontend's headers inside; cuda_utils.cuh and
    train_gpt2.cu as given) and of build-nanogpt (its script prints step lines), the project's command
    a stand-in too, a system cuDNN to build with, tmp_path the working directory; the config of a tiny
    run on them, the checkouts named relatively, as gpu.sh's PEERS=.peers does."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    make_checkout(tmp_path / "peers" / "llm.c", {
        "train_gpt2.cu": source, "Makefile": "", "cudnn-frontend/include/cudnn_frontend.h": "",
        "llmc/cuda_utils.cuh": cuda_utils})
    make_checkout(tmp_path / "peers" / "build-nanogpt", {
        "train_gpt2.py": BUILD_NANOGPT_SCRIPT + "import types\ntorch = types.SimpleNamespace(cuda=types.SimpleNamespace("
                         "max_memory_allocated=lambda: 2**30))\n" + PROJECT_STEPS.replace("| loss", "| loss:").replace(
                         "| norm", "| norm:").replace("| dt", "| dt:"),
        "hellaswag.py": HELLASWAG_SCRIPT})
    monkeypatch.setattr(peers, "project_command", lambda *args: [sys.executable, "-c", PROJECT_STEPS])
    monkeypatch.setattr(peers, "system_cudnn", lambda: "/usr/lib/libcudnn.so")  # as if there were one to build with
    os.makedirs("work")
    return peers.PeersConfig(os.path.join("peers", "llm.c"), os.path.join("peers", "build-nanogpt"),
                             micro_batch_size=2, seq_len=8, total_batch_size=16, steps=2, warmup=1, gpu_arch="90",
                             timeout=60)


@pytest.mark.parametrize("llmc_fault", ["no_make", "make_fails", "changed_source"])
def test_a_failing_llmc_is_an_error_line_and_the_other_peers_still_run(tmp_path, monkeypatch, capsys, llmc_fault):
    """llm.c's builds start first: no make, a failed build (its last lines kept) or a source the
    adaptation does not know must cost llm.c's results only, one row a build. make gets the GPU's
    compute capability and absolute paths."""
    config = stand_in_peers(tmp_path, monkeypatch, LLMC_FALLBACK.replace("cudaMemAdvise", "cudaMemAdviseV2")
                            if llmc_fault == "changed_source" else LLMC_FALLBACK)
    bin_dir = tmp_path / "bin"
    if llmc_fault == "make_fails":
        fake_program(bin_dir, "make", f'echo "$@" >> {tmp_path}/make-args\ni=1; while [ $i -le 40 ]; do echo $i; i=$((i + 1)); done\necho "nvcc fatal: oops"\nexit 2\n')
    monkeypatch.setenv("PATH", str(bin_dir))  # no make and no nvcc, but for that fake make (shell builtins only)
    results = []
    peers.bench_peers(config, "work", results.append, bench.judged)
    assert [r["variant"] for r in results] == ["project", "build-nanogpt", "llm.c", "llm.c-cudnn-system"]
    assert [r["ms_per_step"] for r in results[:2]] == [10.0, 10.0]
    errors = [r["error"] for r in results[2:]]
    if llmc_fault == "no_make":
        assert errors == ["make: No such file or directory"] * 2
    elif llmc_fault == "make_fails":
        assert errors == ["make train_gpt2cu exited with 2: nvcc fatal: oops"] * 2
        assert results[2]["log_tail"] == [str(i) for i in range(12, 41)] + ["nvcc fatal: oops"]
        plain, cudnn = sorted((line.split() for line in open(tmp_path / "make-args").read().splitlines()),
                              key=lambda args: "USE_CUDNN=1" in args)  # the two builds run at once: either first
        assert "GPU_COMPUTE_CAPABILITY=90" in plain and "USE_CUDNN=0" in plain
        assert f"CUDNN_FRONTEND_PATH={tmp_path}/peers/llm.c/cudnn-frontend/include" in cudnn
    else:
        assert errors == ["llm.c's cuda_utils.cuh has changed: expected one `cudaCheck_(cudaMemAdvise(*out, bytes, "
                          "cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId), file, line);`, found 0"] * 2
    err = capsys.readouterr().err
    assert err.count("warning: peers: llm.c") == 2 and "Traceback" not in err


# A stand-in for llm.c's train_gpt2cu, as the stand-in make builds it: the rows of llm.c's table of its
# settings that the peers ask for, -ge taken or (IGNORES_GE) not, then five step lines; its arguments logged.
LLMC_PROGRAM = """#!{python}
import sys
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open({calls!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
print(f"| gelu_fusion           | {{'0' if {ignores_ge} else flags.get('-ge', '0'):<50}} |")
print(f"| zero_stage            | {{flags['-z']:<50}} |")
for i, loss in enumerate([10.9, 9.5, 8.1, 7.0, 6.5], 1):
    print(f"step {{i:4d}}/5 | loss {{loss}} (+0.00z)| norm 1.0000 (+0.00z)| lr 1.00e-05 | 10.00 ms | 1 tok/s")
"""


@pytest.mark.parametrize("llmc_ge", ["takes", "ignores", "lacks"])
def test_llmc_runs_each_gelu_fusion_its_cudnn_builds_take_with_its_record_of_what_ran(tmp_path, monkeypatch, llmc_ge):
    """llm.c at its fastest: each cuDNN build also at -ge 1 and -ge 2 (its GELU fused into cuBLASLt's
    matmuls), one row a setting, each with llm.c's own record of what it ran; a run whose llm.c did not
    take the setting is no answer (a failed row), and an llm.c without -ge (which would read it as -g,
    silently) gets one row that says so instead."""
    config = stand_in_peers(tmp_path, monkeypatch, source="" if llmc_ge == "lacks" else LLMC_SOURCE)
    program = tmp_path / "train_gpt2cu"
    program.write_text(LLMC_PROGRAM.format(python=sys.executable, calls=str(tmp_path / "calls"),
                                           ignores_ge=llmc_ge == "ignores"))
    program.chmod(0o755)
    fake_program(tmp_path / "bin", "make", f"/bin/cp {program} train_gpt2cu\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    results = []
    peers.bench_peers(config, "work", results.append, bench.judged)
    rows = {r["variant"]: r for r in results}
    cudnn = [f"llm.c-cudnn-system-{run}" for run in ("z0", "z1", "z0-ge1", "z0-ge2")]
    assert list(rows) == ["project", "build-nanogpt", "llm.c"] + (
        cudnn[:2] + ["llm.c-cudnn-system-ge"] if llmc_ge == "lacks" else cudnn)
    calls = [dict(zip(line.split()[::2], line.split()[1::2])) for line in (tmp_path / "calls").read_text().splitlines()]
    assert [(flags["-z"], flags.get("-ge")) for flags in calls] == [("1", None), ("0", None), ("1", None)] + (
        [] if llmc_ge == "lacks" else [("0", "1"), ("0", "2")])
    for variant in ["llm.c"] + cudnn[:2]:
        assert rows[variant]["ran"] == {"zero_stage": variant[-1] if "-z" in variant else "1"}
        assert rows[variant]["tokens_per_sec"] == 16 / 0.01 and rows[variant].get("cudnn", "unknown") == "unknown"
    if llmc_ge == "takes":
        for fusion in ("1", "2"):
            row = rows[f"llm.c-cudnn-system-z0-ge{fusion}"]
            assert row["ran"] == {"zero_stage": "0", "gelu_fusion": fusion} and row["tokens_per_sec"] > 0
    elif llmc_ge == "ignores":
        assert [rows[f"llm.c-cudnn-system-z0-ge{fusion}"]["error"] for fusion in ("1", "2")] == [
            f"llm.c ran with gelu_fusion 0, not {fusion} as asked" for fusion in ("1", "2")]
    else:
        assert rows["llm.c-cudnn-system-ge"]["error"] == (
            "this llm.c has no -ge (GELU fusion): no `-ge <int>` in its train_gpt2.cu")


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("ldd") is None, reason="needs a C compiler and ldd")
def test_the_cudnn_an_llmc_binary_loads_is_named_by_its_own_version(tmp_path):
    """A stand-in libcudnn.so.9 whose cudnnGetVersion() says 9.14.0, and a program linked against it:
    the library its loader resolves, asked for its version, as cuDNN 9 encodes it."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "cudnn.c").write_text("int cudnnGetVersion(void) { return 91400; }\n")
    (tmp_path / "main.c").write_text("int cudnnGetVersion(void);\nint main(void) { return cudnnGetVersion() == 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcudnn.so.9", "-o", lib / "libcudnn.so.9",
                    tmp_path / "cudnn.c"], check=True)
    os.symlink("libcudnn.so.9", lib / "libcudnn.so")
    subprocess.run(["cc", "-o", tmp_path / "train_gpt2cu", tmp_path / "main.c", f"-L{lib}", "-lcudnn",
                    f"-Wl,-rpath,{lib}"], check=True)
    assert peers.loaded_cudnn(str(tmp_path / "train_gpt2cu")) == f"9.14.0 ({lib / 'libcudnn.so.9'})"
    assert peers.loaded_cudnn(sys.executable) == "unknown"  # links no cuDNN


def test_llmc_is_built_against_each_cudnn_the_machine_has(llmc, tmp_path, monkeypatch):
    """Without cuDNN, then with cuDNN attention against the nvidia-cudnn wheel's and the system's;
    each cuDNN build runs at ZeRO stage 0 and 1. With neither, one row says so."""
    os.makedirs(os.path.join(llmc, "cudnn-frontend", "include"))
    config = peers.PeersConfig(llmc, "", micro_batch_size=2, seq_len=8, total_batch_size=16, steps=2, warmup=1,
                               gpu_arch="90", timeout=60)
    monkeypatch.setattr(peers, "cudnn_wheel_files", lambda: (str(tmp_path), str(tmp_path / "libcudnn.so.9")))
    monkeypatch.setattr(peers, "system_cudnn", lambda: "/usr/lib/libcudnn.so")
    builds = peers.llmc_builds(config, lambda build: str(tmp_path / "work" / build))
    assert list(builds) == ["llm.c", "llm.c-cudnn-wheel", "llm.c-cudnn-system"]
    (plain, _), (wheel, _), (system, _) = builds.values()
    assert "USE_CUDNN=0" in plain and "USE_CUDNN=1" in wheel and "USE_CUDNN=1" in system
    assert f"-rpath={tmp_path}" in wheel[-1] and "-lcudnn" not in system[-1] and f"-I{tmp_path}" not in " ".join(system)
    runs = [[(run.variant, run.zero, run.gelu_fusion) for run in peers.llmc_runs(build, gelu_fusion=True)]
            for build in builds]
    assert runs == [[("llm.c", 1, None)],
                    *[[(f"{build}-z0", 0, None), (f"{build}-z1", 1, None), (f"{build}-z0-ge1", 0, 1),
                       (f"{build}-z0-ge2", 0, 2)] for build in ("llm.c-cudnn-wheel", "llm.c-cudnn-system")]]
    assert [run.variant for run in peers.llmc_runs("llm.c-cudnn-wheel", gelu_fusion=False)] == [
        "llm.c-cudnn-wheel-z0", "llm.c-cudnn-wheel-z1"]  # an llm.c without -ge
    monkeypatch.setattr(peers, "cudnn_wheel_files", lambda: None)
    monkeypatch.setattr(peers, "system_cudnn", lambda: None)
    builds = peers.llmc_builds(config, lambda build: str(tmp_path / "work" / build))
    assert list(builds) == ["llm.c", "llm.c-cudnn"] and str(builds["llm.c-cudnn"][0]).startswith("no cuDNN: neither")


def test_the_systems_cudnn_is_the_one_the_loaders_cache_names(tmp_path, monkeypatch):
    fake_program(tmp_path / "bin", "ldconfig", """echo '123 libs found in cache `/etc/ld.so.cache'"'"
echo '	libcudnn_ops.so.9 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcudnn_ops.so.9'
echo '	libcudnn.so.9 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcudnn.so.9'
echo '	libcudnn.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libcudnn.so'
""")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert peers.system_cudnn() == "/lib/x86_64-linux-gnu/libcudnn.so"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert peers.system_cudnn() is None
