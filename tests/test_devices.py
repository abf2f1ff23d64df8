"""devices.py: the device each process takes, the dtype --dtype auto picks, the peak FLOPS that
MFU is measured against, and the torch version check every script meets at import."""
import os
import re
import subprocess
import sys

import pytest
import torch

import devices
from helpers import REPO


def test_under_torchrun_each_process_takes_its_own_gpu_and_no_other(monkeypatch):
    tried = []
    monkeypatch.setattr(devices.torch, "empty", lambda *shape, device: tried.append(device))
    assert devices.pick_device("cuda", local_rank=3) == "cuda:3" and tried == ["cuda:3"]
    assert devices.pick_device("cuda:3", local_rank=3) == "cuda:3"
    with pytest.raises(ValueError, match=r"under torchrun each process takes cuda:LOCAL_RANK \(here cuda:3\)"):
        devices.pick_device("cuda:1", local_rank=3)
    assert devices.pick_device("cuda:1") == "cuda:1" and devices.pick_device("cuda") == "cuda:0"  # one process: any


def test_dtype_auto_is_bf16_only_on_gpus_with_bf16_tensor_cores(monkeypatch):
    from devices import pick_dtype
    for capability, dtype in [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)]:  # V100, T4: bf16 is only emulated there
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert pick_dtype("auto", "cuda") == dtype
    assert pick_dtype("auto", "cpu") == pick_dtype("auto", "mps") == torch.float32
    assert pick_dtype("float16", "cpu") == torch.float16


def test_mfu_peak_is_the_named_gpus_and_unknown_gpus_have_none(monkeypatch):
    from devices import peak_flops
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
             "NVIDIA L4": 121e12, "NVIDIA A10": 125e12, "NVIDIA GeForce RTX 4090": 165e12,
             "NVIDIA RTX A1000": None, "NVIDIA A10G": None, "Tesla V100-SXM2-16GB": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert peak_flops("cuda:0") == peak, name
    assert peak_flops("cpu") is None


TOO_OLD = "error: this code needs torch>=2.9 (found {}): pip install -U torch"
# The scripts that use torch; each must stop on an old torch before it imports anything newer.
SCRIPTS = ["train_gpt2.py", "bench.py", "checkpoint.py", "export_hf.py", "hellaswag.py", "memory.py", "sample.py"]
# Run as `python -c` with the script's arguments: torch as found, then its version made older;
# it names on stdout those of torch's newer modules (and transformers) imported before the stop.
OLD_TORCH = """
import runpy, sys
import torch
torch.__version__ = "2.8.0+cu128"
sys.path.insert(0, {repo!r})
try:
    runpy.run_path(sys.argv[1], run_name="__main__")
finally:
    newer = [m for m in ("torch.distributed.tensor", "torch.distributed.fsdp", "transformers") if m in sys.modules]
    if newer:
        print("imported before the stop:", *newer)
"""


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+cu128", "2.7.1", "2.4.1", "1.13.1", "2.0.0a0+git1234"])
def test_a_torch_older_than_the_minimum_is_named_in_one_line(version):
    assert devices.torch_problem(version) == TOO_OLD.format(version)


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0a0+git1234", "2.11.0+cu130", "2.13.0+cpu", "3.0.0", "unknown"])
def test_the_minimum_and_later_pass(version):
    assert devices.torch_problem(version) is None


def test_this_torch_passes_and_requirements_txt_asks_for_the_minimum():
    assert devices.torch_problem(torch.__version__) is None
    with open(os.path.join(REPO, "requirements.txt")) as f:
        minimum = re.search(r"^torch>=(\d+)\.(\d+)\s", f.read(), re.M)
    assert tuple(map(int, minimum.groups())) == devices.MIN_TORCH


@pytest.mark.slow
def test_every_script_stops_on_an_old_torch_with_one_line_and_exit_code_1():
    """In one process per script, torch.__version__ set to 2.8 before the script runs: exit code 1,
    the one line on stderr and nothing else (no traceback), before any argument is read and
    before torch's newer modules are imported."""
    for script in SCRIPTS:
        result = subprocess.run([sys.executable, "-c", OLD_TORCH.format(repo=REPO), os.path.join(REPO, script), "--help"],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert (script, result.returncode, result.stdout, result.stderr) == \
            (script, 1, "", TOO_OLD.format("2.8.0+cu128") + "\n")


def test_allow_tf32_sets_high_precision_and_warns_nothing():
    """In a process of its own: torch 2.9 warns once a process, in three lines, at the first
    get or set of the matmul precision."""
    code = ("import warnings; warnings.simplefilter('error'); import devices, torch; devices.allow_tf32(); "
            "warnings.resetwarnings(); print(torch.get_float32_matmul_precision())")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "high\n", "")
