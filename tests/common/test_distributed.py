"""distributed.py: joining and leaving the process group (setup, leave), the decisions every rank
takes alike (every_rank, agree, on_every_rank), and a refusal of one rank's stopping every rank:
in one process, and across two ranks (torchrun's summary and two nodes: tests/integration/)."""
import os

import pytest
import torch

from gpt2repro.common import distributed
from gpt2repro.common.distributed import RunError, agree, every_rank, on_every_rank
from gpt2repro.runs import checkpoint_files
from helpers import REPO
from helpers.processes import run_ranks, said_errors
from helpers.runs import TINY


def test_in_one_process_every_rank_is_this_one_and_agree_raises_its_error():
    """Outside a process group, every_rank(value) is [value]; agree passes None and raises
    RunError for a message; on_every_rank re-raises fn's RunError and returns fn's result."""
    assert every_rank("x") == ["x"]
    agree(None)
    with pytest.raises(RunError, match="^x$"):
        agree("x")

    def refuse(message):
        raise RunError(message)
    with pytest.raises(RunError, match="^refused$"):
        on_every_rank(refuse, "refused")
    assert on_every_rank(lambda a, b: a + b, 2, 3) == 5


def test_a_cuda_process_sets_its_device(monkeypatch):
    """Each process on CUDA makes its device current before any collective or allocation (on a GPU
    machine this path once failed at its first line: a function-local import had made torch local)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    current = []
    monkeypatch.setattr(distributed, "pick_device", lambda arg, local_rank: "cuda:1")
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert distributed.init("cuda:1") == (0, 0, 1, "cuda:1") and current == ["cuda:1"]


NON_FINITE_ON_RANK_1 = """
import math, os, sys
sys.path.insert(0, {repo!r})
import torch
import train_gpt2
from gpt2repro.runs import checkpoint
real_save = checkpoint.Checkpointer.save


def save(self, step, flags):  # as if rank 1 alone had found its weights no longer finite
    if os.environ["RANK"] == "1":
        with torch.no_grad():
            self.parts["model"].raw_model.lm_head.weight[0, 0] = math.inf
    real_save(self, step, flags)
checkpoint.Checkpointer.save = save
train_gpt2.main()
"""


@pytest.mark.slow
def test_a_refusal_on_one_rank_stops_every_rank_at_once(shards, tmp_path):
    """Non-finite weights found by one rank at checkpoint time: every rank stops with the same
    one-line error, rank 0 writes nothing, and no rank is left waiting for a collective."""
    script = tmp_path / "non_finite.py"
    script.write_text(NON_FINITE_ON_RANK_1.format(repo=REPO))
    result = run_ranks(script, *TINY, "--data_dir", shards, "--log_dir", tmp_path / "log",
                       "--total_batch_size", "128", "-B", "2", "--max_steps", "4", "--checkpoint_interval", "2",
                       timeout=120)
    assert result.returncode != 0
    assert said_errors(result.stderr) == ["error: the weights at step 2 are not finite: not checkpointing them"]
    assert [rank.returncode for rank in result.ranks] == [1, 1]
    assert checkpoint_files.list_checkpoints(str(tmp_path / "log")) == []


GLOO_THREADS_AT_EXIT = """
import gc, os, sys
import torch
sys.path.insert(0, {repo!r})
from gpt2repro.common import distributed
gc.disable()  # a collection at some arbitrary moment must not be what frees the DDP wrapper
threads = lambda: len(os.listdir("/proc/self/task"))
torch.nn.Linear(4, 4)(torch.ones(2, 4)).sum().backward()  # any thread torch itself keeps is started
before = threads()
distributed.init("cpu")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
del model
distributed.leave()
print("threads", before, threads())
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the threads in /proc/self/task")
def test_no_gloo_thread_outlives_the_process_group(tmp_path):
    """A gloo worker thread left running as the interpreter exits can free a tensor then and
    abort a run that had finished (seen in about 1 in 50 runs of test_faults.py's torchrun restart test)."""
    script = tmp_path / "gloo_threads.py"
    script.write_text(GLOO_THREADS_AT_EXIT.format(repo=REPO))
    result = run_ranks(script, nproc=1, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    _, before, after = next(line for line in result.stdout.splitlines() if line.startswith("threads ")).split()
    assert after == before


