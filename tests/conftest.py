"""pytest's setup for the tests: offline, one thread a process, Triton's interpreter without a GPU, one
temporary directory of their own, a test path that does not exist said so, cuda-marked tests skipped
without CUDA, interpreted-marked ones where the interpreter cannot run the kernel, and the fixtures.
The helpers are in helpers/, a module for each kind of help."""
import multiprocessing.util
import os
import shutil
import tempfile

import pytest
import torch

from helpers.files import write_token_shards
from helpers.kernels import interpreter_problem
from helpers.models import make_hf_gpt2

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reaches for the hub fails fast
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU, Triton's kernels (loss.py) run in its interpreter, on CPU tensors. Set here, before
# anything imports triton (torch._dynamo does); not where CUDA is, where inductor's kernels would be interpreted too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread a process, here and in the scripts and torchrun workers the tests start: pytest runs
# tests side by side (-n in pytest.ini), and on a busy CPU each extra thread of a tiny model's ops
# spins waiting for a core, making them many times slower. Only the speed changes.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# The temporary directory of the tests, their subprocesses and the libraries they call (pytest's
# tmp_path, torchrun's, tiktoken's and torch's caches): one, removed at exit, once multiprocessing has
# removed its own directory in it (priority -100), unless a test failed, the run was cut short or
# pytest itself failed (KEPT_BECAUSE): then it stays for a look, and pytest says where and why. A
# run in which no test ran (a path that does not exist, a -k that picks none) leaves nothing.
TEST_TMP = tempfile.mkdtemp(prefix="gpt2-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = TEST_TMP
REMOVE_TEST_TMP = multiprocessing.util.Finalize(None, shutil.rmtree, args=(TEST_TMP,), kwargs={"ignore_errors": True},
                                                exitpriority=-101)
KEPT_BECAUSE = {pytest.ExitCode.TESTS_FAILED: "a test failed", pytest.ExitCode.INTERRUPTED: "the run was interrupted",
                pytest.ExitCode.INTERNAL_ERROR: "pytest failed"}


def pytest_sessionfinish(session, exitstatus):
    if exitstatus in KEPT_BECAUSE:
        REMOVE_TEST_TMP.cancel()


def pytest_configure(config):
    """A test path that does not exist is a usage error, said before the workers start: xdist's
    workers, which collect, would end the run with nothing said (exit code 5, no tests)."""
    for arg in config.args:
        path = os.path.join(config.invocation_params.dir, arg.split("::")[0])
        if not os.path.exists(path):
            raise pytest.UsageError(f"file or directory not found: {arg}")


def pytest_terminal_summary(terminalreporter, exitstatus):
    if exitstatus in KEPT_BECAUSE:
        terminalreporter.write_line(f"{KEPT_BECAUSE[exitstatus]}: the tests' temporary files are kept in {TEST_TMP}")


def pytest_runtest_setup(item):
    """Tests marked interpreted run loss.py's Triton kernel in Triton's interpreter: skipped where it
    cannot, with the reason (asked only once such a test is about to run, as it imports triton)."""
    if item.get_closest_marker("interpreted") and interpreter_problem():
        pytest.skip(interpreter_problem())


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run wherever CUDA is, and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def hf_gpt2_dir(tmp_path):
    """A tiny perturbed Hugging Face GPT-2 saved with save_pretrained; returns (model, dir)."""
    hf = make_hf_gpt2()
    path = tmp_path / "hf_gpt2"
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """write_token_shards' default shards, written once per test module; returns their directory."""
    directory = tmp_path_factory.mktemp("shards")
    write_token_shards(directory)
    return str(directory)


@pytest.fixture
def demo_dir(tmp_path, monkeypatch):
    """The demo preset's own data_dir, moved into tmp_path (a copy of the presets whose demo says
    so): the preset shards only there."""
    from gpt2repro.common import cli

    data_dir = tmp_path / "shakespeare"
    configs = tmp_path / "configs"
    shutil.copytree(cli.CONFIG_DIR, configs)
    demo = (configs / "demo.toml").read_text()
    (configs / "demo.toml").write_text(demo.replace('data_dir = "data/shakespeare"', f"data_dir = {str(data_dir)!r}"))
    monkeypatch.setattr(cli, "CONFIG_DIR", str(configs))
    return data_dir
