"""devices.py: the device each process takes, the dtype --dtype auto picks, and the peak FLOPS
that MFU is measured against."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gpt2repro.common import devices
from helpers import REPO
from helpers.processes import one_line_error, run_script


def test_under_torchrun_each_process_takes_its_own_gpu_and_no_other(monkeypatch):
    tried = []
    monkeypatch.setattr(devices.torch, "empty", lambda *shape, device: tried.append(device))
    assert devices.pick_device("cuda", local_rank=3) == "cuda:3" and tried == ["cuda:3"]
    assert devices.pick_device("cuda:3", local_rank=3) == "cuda:3"
    with pytest.raises(ValueError, match=r"under torchrun each process takes cuda:LOCAL_RANK \(here cuda:3\)"):
        devices.pick_device("cuda:1", local_rank=3)
    assert devices.pick_device("cuda:1") == "cuda:1" and devices.pick_device("cuda") == "cuda:0"  # one process: any


@pytest.mark.slow
def test_a_device_torch_knows_but_the_scripts_do_not_run_on_is_one_line(tmp_path):
    """meta, hpu, privateuseone: names torch accepts, where the trainer would end in a traceback
    (no autocast on meta, no torch.hpu module)."""
    for device in ("meta", "hpu", "privateuseone"):
        result = run_script("train_gpt2.py", "--preset", "demo", "--device", device, "--log_dir", tmp_path / "log",
                            "--data_dir", tmp_path / "data")
        assert result.returncode in (1, 2) and one_line_error(result) == (
            f"error: --device {device}: not a device this project runs on: use auto, cpu, cuda, cuda:K or mps")
    assert not os.path.exists(tmp_path / "log") and not os.path.exists(tmp_path / "data")
    result = run_script("sample.py", "--model", "gpt2", "--device", "meta")
    assert one_line_error(result) == "sample.py: error: --device meta: not a device this project runs on: use auto, cpu, cuda, cuda:K or mps"


def test_only_cpu_cuda_and_mps_are_picked_and_a_missing_mps_is_one_short_line(monkeypatch):
    for name in ("meta", "hpu", "privateuseone", "xla", "cuda:x", "cpu:", "cuda:0:1"):
        with pytest.raises(ValueError, match="^not a device this project runs on: use auto, cpu, cuda, cuda:K or mps$"):
            devices.pick_device(name)
    assert devices.pick_device("cpu") == "cpu" and devices.pick_device("cpu:0") == "cpu:0"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device mps cannot be used here: this torch or this machine has no Apple GPU \(MPS\)$"):
        devices.pick_device("mps")


def test_dtype_auto_is_bf16_only_on_gpus_with_bf16_tensor_cores(monkeypatch):
    from gpt2repro.common.devices import pick_dtype
    for capability, dtype in [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)]:  # V100, T4: bf16 is only emulated there
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert pick_dtype("auto", "cuda") == dtype
    assert pick_dtype("auto", "cpu") == pick_dtype("auto", "mps") == torch.float32
    assert pick_dtype("float16", "cpu") == torch.float16
    notes = []
    assert [pick_dtype(name, "cpu", notes.append) for name in ("float16", "bfloat16", "float32")] == \
        [torch.float16, torch.bfloat16, torch.float32]
    assert notes == ["note: --dtype float16 on a CPU is slow: a demo step took 6.5x as long as in float32 (bfloat16: "
                     "0.8x)"]


def test_mfu_peak_is_the_named_gpus_and_unknown_gpus_have_none(monkeypatch):
    from gpt2repro.common.devices import peak_flops
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
             "NVIDIA L4": 121e12, "NVIDIA A10": 125e12, "NVIDIA GeForce RTX 4090": 165e12,
             "NVIDIA RTX A1000": None, "NVIDIA A10G": None, "Tesla V100-SXM2-16GB": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert peak_flops("cuda:0") == peak, name
    assert peak_flops("cpu") is None


def test_allow_tf32_sets_high_precision_and_warns_nothing():
    """In a process of its own: torch 2.9 warns once a process, in three lines, at the first
    get or set of the matmul precision."""
    code = ("import warnings; warnings.simplefilter('error'); import torch; from gpt2repro.common import devices; "
            "devices.allow_tf32(); "
            "warnings.resetwarnings(); print(torch.get_float32_matmul_precision())")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "high\n", "")


GiB = 2**30
NO_LIMIT_V1 = "9223372036854771712"  # what v1 writes where no limit is set
# /proc/self/cgroup, /proc/self/mountinfo and the cgroup files of three machines: cgroup v2 with a
# job's limit two levels above the process; v1 beside a v2 hierarchy (this project's machine), the
# root unlimited, a parent's limit nearly spent; v1 in a container whose own cgroup is mounted as the root.
CGROUPS = {
    "v2": ("0::/job.slice/job-7.scope/task\n",
           "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
           {"job.slice/memory.max": "max", "job.slice/memory.current": str(3 * GiB),
            "job.slice/job-7.scope/memory.max": str(3 * GiB // 2), "job.slice/job-7.scope/memory.current": str(GiB // 2),
            "job.slice/job-7.scope/task/memory.max": "max", "job.slice/job-7.scope/task/memory.current": str(GiB // 4)},
           GiB),
    "v1": ("9:name=systemd:/\n4:memory:/process_api/0342c1\n1:cpu:/\n0::/\n",
           "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
           "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
           "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
           "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
           {"memory/memory.limit_in_bytes": NO_LIMIT_V1, "memory/memory.usage_in_bytes": str(9 * GiB),
            "memory/process_api/memory.limit_in_bytes": str(4 * GiB),
            "memory/process_api/memory.usage_in_bytes": str(4 * GiB - GiB // 5),
            "memory/process_api/0342c1/memory.limit_in_bytes": str(3 * GiB // 2),
            "memory/process_api/0342c1/memory.usage_in_bytes": str(GiB // 2),
            "unified/memory.max": str(GiB // 10), "unified/memory.current": "0"},  # not the memory controller's
           GiB // 5),
    "v1 in a container": ("4:memory:/docker/ab12\n",
                          "35 31 0:32 /docker/ab12 /sys/fs/cgroup/memory ro,relatime master:16 - cgroup cgroup rw,memory\n",
                          {"memory/memory.limit_in_bytes": str(3 * GiB // 2),
                           "memory/memory.usage_in_bytes": str(GiB // 2)},
                          GiB),
}


def fake_host(root, meminfo_kib, cgroup="", mountinfo="", files=None):
    """A copy of the /proc and /sys that available_memory reads, under root."""
    for path, text in {"proc/meminfo": f"MemTotal: 24684092 kB\nMemAvailable: {meminfo_kib} kB\n",
                       "proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo,
                       **{f"sys/fs/cgroup/{name}": f"{value}\n" for name, value in (files or {}).items()}}.items():
        os.makedirs(os.path.dirname(root / path), exist_ok=True)
        (root / path).write_text(text)
    return str(root)


@pytest.mark.parametrize("machine", CGROUPS)
def test_available_memory_is_the_least_left_by_the_processs_own_cgroup_and_those_above_it(tmp_path, machine):
    """What -B auto fits on a CPU: MemAvailable, unless the memory cgroup that /proc/self/cgroup
    names for this process, or one above it, leaves less (its limit less its usage; "max", or v1's
    number past any memory, is no limit). A 1.5 GiB limit on a container's or job's own cgroup counts,
    not only one on the root."""
    cgroup, mountinfo, files, headroom = CGROUPS[machine]
    root = fake_host(tmp_path, 20_000_000, cgroup, mountinfo, files)
    assert devices.available_memory(root) == headroom
    assert devices.available_memory(fake_host(tmp_path, 100_000, cgroup, mountinfo, files)) == 100_000 * 1024


def test_available_memory_is_memavailable_without_a_limit_and_none_without_meminfo(tmp_path):
    cgroup, mountinfo, files, _ = CGROUPS["v1"]
    unlimited = {name: NO_LIMIT_V1 if name.endswith("limit_in_bytes") else value for name, value in files.items()}
    assert devices.available_memory(fake_host(tmp_path / "unlimited", 20_000_000, cgroup, mountinfo, unlimited)) == \
        20_000_000 * 1024
    assert devices.available_memory(fake_host(tmp_path / "none", 20_000_000)) == 20_000_000 * 1024  # no cgroup
    assert devices.available_memory(str(tmp_path / "elsewhere")) is None  # no /proc/meminfo: not Linux


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads what the process maps in /proc/self/statm")
def test_the_cpu_allocators_failure_under_a_memory_limit_is_out_of_memory():
    """Under ulimit -v (here 1 GiB past what the process maps) torch's CPU allocator fails with a
    plain RuntimeError, not torch.OutOfMemoryError: is_out_of_memory takes it as one, and no other
    RuntimeError, so the trainer halves -B auto or stops in one line rather than in a traceback."""
    code = ("import os, resource, torch\nfrom gpt2repro.common import devices\n"
            "mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
            "resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            "try:\n"
            "    torch.empty(4 * 2**30, dtype=torch.uint8)\n"
            "except RuntimeError as e:\n"
            "    print(type(e).__name__, devices.is_out_of_memory(e), devices.is_out_of_memory(RuntimeError('other')))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "RuntimeError True False\n"), result.stderr[-2000:]
    assert devices.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))


def test_the_cpu_training_rate_is_the_benchmarks_measured_one():
    """CPU_TRAIN_FLOPS: bench/results/cpu-2core.json's train run of the project, in FLOP/s."""
    from model import GPT, GPTConfig

    with open(os.path.join(REPO, "bench", "results", "cpu-2core.json")) as f:
        run = next(r for r in json.load(f)["results"] if r["name"] == "train" and r["variant"] == "project"
                   and "without" not in r)
    assert run["config"] == "L4 C256 B8 T256 float32 compile=0"
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=4, n_head=4, n_embd=256))
    assert devices.CPU_TRAIN_FLOPS == pytest.approx(run["tokens_per_sec"] * model.flops_per_token(256), rel=1e-3)


def test_a_run_forecast_past_an_hour_on_a_cpu_says_so_and_points_to_the_demo():
    """GPT-2 (124M)'s recipe: 524,288 tokens a step at 855M FLOPs a token, 19,073 steps; the demo's
    150 steps of 1,024 tokens stay quiet."""
    from model import GPT, GPTConfig

    with torch.device("meta"):
        gpt2, demo = GPT(GPTConfig(vocab_size=50304)), GPT(GPTConfig(128, 50304, 4, 4, 128))
    step = gpt2.flops_per_token(1024) * 524288 / devices.CPU_TRAIN_FLOPS
    assert 5000 < step < 7000  # seconds: about 1.6 h
    assert devices.cpu_forecast(gpt2.flops_per_token(1024) * 524288, 19073) == (
        f"note: on a CPU a step would take about {step / 3600:.1f} h and the 19,073 steps "
        f"{step * 19073 / (365 * 86400):.1f} years (their FLOPs at the 76 GFLOP/s of a training run on 2 cores, "
        f"bench/results/cpu-2core.json): this run is meant for GPUs; `python train_gpt2.py --preset demo` trains a "
        f"small GPT on a CPU in minutes")
    assert devices.cpu_forecast(demo.flops_per_token(128) * 1024, 150) is None
    assert [devices.duration(s) for s in (59, 90, 5400, 86400, 3 * 86400, 400 * 86400)] == \
        ["59 s", "2 min", "1.5 h", "24.0 h", "3 days", "1.1 years"]
