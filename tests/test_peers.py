"""The peers benchmark's CPU-testable parts: llm.c's token files, the scratch copies adapted from
each peer's checkout (the checkout itself untouched), each program's log read back, and the
refusals. The peers' runs themselves need a GPU (docs/benchmarks.md)."""
import glob
import os
import sys
import types

import numpy as np
import pytest

import bench
import peers
from helpers import exit_message, run_script
from data import shard_name, write_shard
from tokenizer import get_encoding

# The statements of build-nanogpt's train_gpt2.py that the adaptation rewrites, in a stand-in script.
BUILD_NANOGPT_SCRIPT = '''import os
import tiktoken
data_root = "edu_fineweb10B"
enc = tiktoken.get_encoding("gpt2")
total_batch_size = 524288 # tokens
B = 64 # micro batch size
T = 1024 # sequence length
use_compile = False # compile
max_steps = 19073 # one epoch
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


def make_checkout(root, files):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    return str(root)


@pytest.fixture
def build_nanogpt(tmp_path):
    return make_checkout(tmp_path / "build-nanogpt", {"train_gpt2.py": BUILD_NANOGPT_SCRIPT, "hellaswag.py": ""})


@pytest.fixture
def llmc(tmp_path):
    return make_checkout(tmp_path / "llm.c", {"train_gpt2.cu": "", "Makefile": "", "llmc/cuda_utils.cuh": LLMC_FALLBACK})


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
    script = peers.adapt_build_nanogpt(build_nanogpt, str(tmp_path / "scratch"), "shards", 16, 256, 8192, 9)
    with open(script) as f:
        text = f.read()
    assert text.endswith('print(f"peak memory: {torch.cuda.max_memory_allocated()} bytes")\n')
    settings = {}
    exec(text[: text.rindex("print(")], settings)  # all but the peak-memory line, which needs CUDA
    assert (settings["B"], settings["T"], settings["total_batch_size"], settings["max_steps"]) == (16, 256, 8192, 9)
    assert settings["use_compile"] is True and settings["data_root"] == os.path.abspath("shards")
    assert settings["enc"].encode_ordinary("Hello, I'm a language model,") == get_encoding().encode_ordinary(
        "Hello, I'm a language model,")  # the vendored tokenizer: no download
    with open(os.path.join(build_nanogpt, "train_gpt2.py")) as f:
        assert f.read() == BUILD_NANOGPT_SCRIPT


def test_a_changed_build_nanogpt_is_one_line_naming_what_is_missing(build_nanogpt, tmp_path):
    with open(os.path.join(build_nanogpt, "train_gpt2.py"), "w") as f:
        f.write(BUILD_NANOGPT_SCRIPT.replace("use_compile = False", "use_compile = True"))
    with pytest.raises(peers.PeerError, match=r"build-nanogpt's train_gpt2.py has changed: expected one "
                                              r"`use_compile = False`, found 0"):
        peers.adapt_build_nanogpt(build_nanogpt, str(tmp_path / "scratch"), "shards", 64, 1024, 524288, 9)


def test_llmc_fails_where_it_would_fall_back_to_managed_memory(llmc, tmp_path):
    peers.adapt_llmc(llmc, str(tmp_path / "scratch"))
    with open(tmp_path / "scratch" / "llmc" / "cuda_utils.cuh") as f:
        adapted = f.read()
    assert "cudaMallocManaged" not in adapted and "cudaMemAdvise" not in adapted
    assert "cudaGetLastError(); // reset the error before the next API call\n        cudaCheck_(err, file, line);" in adapted
    with open(os.path.join(llmc, "llmc", "cuda_utils.cuh")) as f:
        assert f.read() == LLMC_FALLBACK


def test_llmc_commands(tmp_path):
    run = peers.llmc_run_command("./train_gpt2cu", "d/*_train_*.bin", "d/*_val_*.bin", 64, 1024, 524288, 26)
    flags = dict(zip(run[1::2], run[2::2]))
    assert (flags["-b"], flags["-t"], flags["-d"], flags["-x"], flags["-r"], flags["-e"]) == (
        "64", "1024", "524288", "26", "0", "d12")
    assert int(flags["-v"]) > 26 and flags["-s"] == flags["-h"] == "0"  # no evaluation but the first and last step
    assert "USE_CUDNN=0" in peers.llmc_make_command()
    with_cudnn = peers.llmc_make_command(str(tmp_path))
    assert "USE_CUDNN=1" in with_cudnn and f"CUDNN_FRONTEND_PATH={tmp_path}" in with_cudnn
    assert "NVCC_LDLIBS=-lnvrtc -lcuda" in with_cudnn


def test_cudnn_from_the_wheel_beside_torch_is_found_and_linked(tmp_path, monkeypatch):
    """The nvidia-cudnn wheel ships libcudnn.so.9 but no libcudnn.so, which -lcudnn looks for."""
    wheel = tmp_path / "nvidia" / "cudnn"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "lib" / "libcudnn.so.9").write_bytes(b"")
    cudnn = types.SimpleNamespace(__path__=[str(wheel)])
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(wheel.parent)], cudnn=cudnn))
    monkeypatch.setitem(sys.modules, "nvidia.cudnn", cudnn)
    found = peers.cudnn_wheel(str(tmp_path / "scratch"))
    link = tmp_path / "scratch" / "cudnn-link"
    assert found == (str(wheel / "include"), str(link), str(wheel / "lib"))
    assert os.readlink(link / "libcudnn.so") == str(wheel / "lib" / "libcudnn.so.9")
    command = peers.llmc_make_command("front/include", found)
    assert f"CUDNN_FRONTEND_PATH=front/include -I{wheel / 'include'}" in command
    assert f"NVCC_LDLIBS=-lnvrtc -lcuda -L{link} -Xlinker -rpath={wheel / 'lib'}" in command
    monkeypatch.setitem(sys.modules, "nvidia.cudnn", None)  # no wheel: the system's cuDNN
    assert peers.cudnn_wheel(str(tmp_path / "scratch")) is None


LOGS = {
    "llm.c": ["device memory usage: 27000 MiB / 143000 MiB"]
             + [f"step {i:4d}/8 | loss 10.9 (+0.00z)| norm 1.0 (+0.00z)| lr 1.00e-05 | {ms:.2f} ms | 40.0% bf16 MFU"
                f" | 559000 tok/s" for i, ms in enumerate([9000, 950, 940, 930, 2000], 1)],
    "build-nanogpt": ["validation loss: 10.95"]
                     + [f"step {i:5d} | loss: 10.9 | lr 6.0e-05 | norm: 1.0 | dt: {ms:.2f}ms | tok/sec: 506000.00"
                        for i, ms in enumerate([9000, 950, 940, 930, 2000])] + ["peak memory: 32212254720 bytes"],
}


@pytest.mark.parametrize("program", LOGS)
def test_each_peers_log_gives_its_steady_median_step(program):
    result = peers.read_log(program, "\n".join(LOGS[program]), 524288, warmup=1)
    assert result["ms_per_step"] == 940 and result["steady_steps"] == 3  # the warm-up and last steps left out
    assert result["tokens_per_sec"] == pytest.approx(524288 / 0.94)
    assert result["peak_mem_bytes"] == {"llm.c": 27000 * 2**20, "build-nanogpt": 32212254720}[program]
    with pytest.raises(peers.PeerError, match="5 step"):
        peers.read_log(program, "\n".join(LOGS[program]), 524288, warmup=4)


@pytest.mark.slow
def test_the_projects_own_log_is_read_back(tmp_path):
    """The trainer's real output, on the CPU at a tiny size, through the command the peers run."""
    config = peers.PeersConfig("", "", micro_batch_size=2, seq_len=32, total_batch_size=128, steps=2, warmup=1)
    peers.write_tokens(str(tmp_path / "data"), config)
    command = peers.project_command(str(tmp_path / "data"), str(tmp_path / "log"), 2, 32, 128, config.run_steps)
    command += ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--device", "cpu",
                "--checkpoint_interval", "0"]
    text = peers.run(command, str(tmp_path), str(tmp_path / "project.log"), timeout=300)
    result = peers.read_log("project", text, 128, config.warmup)
    assert result["steady_steps"] == 2 and result["ms_per_step"] > 0 and result["peak_mem_bytes"] is None


def test_a_failing_program_is_one_line_with_its_log(tmp_path):
    with pytest.raises(peers.PeerError, match=r"exited with 3: boom \(its output: .*x.log\)"):
        peers.run(["sh", "-c", "echo start; echo boom; exit 3"], str(tmp_path), str(tmp_path / "x.log"), timeout=60)


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
