"""distributed.py: joining and leaving the process group (setup, leave), the decisions every rank
takes alike (every_rank, agree, on_every_rank), and an error of one rank's reaching the user
(fail_alone, and torchrun's summary): in one process, and across two under torchrun."""
import os

import numpy as np
import pytest
import torch

from gpt2repro.common import distributed
from gpt2repro.common.distributed import RunError, agree, every_rank, on_every_rank
from gpt2repro.lm.data import write_shard
from gpt2repro.runs import checkpoint_files
from helpers import REPO
from helpers.files import write_token_shards
from helpers.processes import run_torchrun, said_errors, torchrun_root_cause
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
    result = run_torchrun(script, *TINY, "--data_dir", shards, "--log_dir", tmp_path / "log",
                          "--total_batch_size", "128", "-B", "2", "--max_steps", "4", "--checkpoint_interval", "2",
                          timeout=120)
    assert result.returncode != 0
    assert said_errors(result.stderr) == ["error: the weights at step 2 are not finite: not checkpointing them"]
    assert "exitcode  : 1" in result.stderr and checkpoint_files.list_checkpoints(str(tmp_path / "log")) == []


# Windows of 16 x 64 tokens, one per rank a step: rank 1 reads windows 1, 3, 5...
ONE_WINDOW_A_RANK = [*TINY, "-T", "64", "-B", "16", "--total_batch_size", str(2 * 16 * 64), "--max_steps", "40",
                     "--checkpoint_interval", "0"]
BAD_ID_AT = 65 * 16 * 64 + 40  # in window 65, at step 32 of rank 1 (its first token, 66560, rank 0 reads as a target)


@pytest.fixture(scope="module")
def bad_id_on_rank_1(tmp_path_factory):
    """(data_dir, the train shard): id 65535 at BAD_ID_AT of a 210,037-token shard, where only
    rank 1's windows read it and the start's quick check (the first, middle and last 64K tokens)
    does not."""
    directory = tmp_path_factory.mktemp("bad_id")
    path = write_token_shards(directory, n_train=1, tokens_per_shard=210_000)[1]
    tokens = np.load(path).astype(np.int64)
    assert 1 << 16 <= BAD_ID_AT < len(tokens) // 2 - (1 << 15)  # between the quick check's first and middle reads
    tokens[BAD_ID_AT] = 65535
    write_shard(path, tokens)
    return str(directory), path


@pytest.mark.slow
def test_a_shard_error_on_one_rank_is_one_line_naming_the_rank_and_the_shard(bad_id_on_rank_1, tmp_path):
    """A bad id that only rank 1 reads, mid-run: rank 1 says so in one line, naming itself and the
    shard; rank 0, whose next collective fails, stops with it, without gloo's traceback; torchrun's
    summary gives the line as the root cause."""
    data_dir, shard = bad_id_on_rank_1
    result = run_torchrun("train_gpt2.py", *ONE_WINDOW_A_RANK, "--data_dir", data_dir, "--log_dir", tmp_path,
                          timeout=240)
    line = f"error: rank 1: {shard}: token id 65535 at position {BAD_ID_AT} is >= vocab_size 256"
    assert result.returncode != 0 and "step    31 |" in result.stdout and "step    32 |" not in result.stdout
    assert said_errors(result.stderr) == [line], result.stderr[-3000:]
    assert "[rank0]" not in result.stderr and "Connection closed" not in result.stderr
    assert torchrun_root_cause(result.stderr) == line


@pytest.mark.slow
def test_under_torchrun_a_run_error_is_torchruns_root_cause(shards, tmp_path):
    """Every rank refuses a step that does not divide over 2 ranks; rank 0 says it, first, and
    torchrun's summary of the failed ranks gives that line as the root cause, not a pointer to its docs."""
    result = run_torchrun("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path,
                          "--total_batch_size", "96", "-B", "1", timeout=120)
    line = "error: --total_batch_size 96 is not a multiple of B*T*world_size = 1*32*2 = 64; try --total_batch_size 128 or another -B"
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == line, result.stderr[-3000:]
    assert said_errors(result.stderr) == [line] and torchrun_root_cause(result.stderr) == line


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
    result = run_torchrun(script, nproc=1, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    _, before, after = next(line for line in result.stdout.splitlines() if line.startswith("threads ")).split()
    assert after == before


def popen_node(node_rank, port, *args):
    """One node's torchrun launcher (one CPU worker) of a two-node run that meets at 127.0.0.1:port,
    in its own process group, so that a hung run's worker dies with it."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
           "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--local_addr=127.0.0.1",
           *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_two_nodes(*args, stop_at_step=None):
    """Both nodes' launchers to the end; with stop_at_step, node 1's gets SIGTERM once the shared
    log_dir's log.jsonl holds that step, as a cluster preempting one node sends it, and node 0's
    once node 1's has exited."""
    import json
    import signal
    import socket
    import subprocess
    import time
    from helpers.processes import finish_torchrun
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [popen_node(k, port, *args) for k in (0, 1)]
    if stop_at_step is not None:
        log = os.path.join(args[args.index("--log_dir") + 1], "log.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and nodes[1].poll() is None:
            if os.path.exists(log) and any(json.loads(line).get("step", -1) >= stop_at_step for line in open(log)):
                nodes[1].send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        stopped = finish_torchrun(nodes[1], timeout=180)
        # Node 0's worker has checkpointed and exited with the others; its launcher would wait at
        # torchrun's exit barrier (300 s) for node 1's, which the signal ended: the cluster ends it
        # too, with SIGTERM, then SIGKILL after a grace period (retried, communicate loses no output).
        nodes[0].send_signal(signal.SIGTERM)
        try:
            out, err = nodes[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(nodes[0].pid, signal.SIGKILL)
            out, err = nodes[0].communicate()
        return [subprocess.CompletedProcess(nodes[0].args, nodes[0].returncode, out, err), stopped]
    return [finish_torchrun(node, timeout=180) for node in nodes]


# Steps of 200 micro-steps: long enough that a signal lands mid-run.
TWO_NODES = ["train_gpt2.py", *TINY, "-B", "1", "--total_batch_size", str(200 * 2 * 32), "--max_steps", "5",
             "--checkpoint_interval", "0"]


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes_and_resume_after_one_is_preempted(shards, tmp_path):
    """Two torchrun launchers (--nnodes=2, one process each) on one machine, sharing --log_dir,
    as the README's multi-node command runs, with node 1 preempted and both relaunched, train
    exactly as one node of two processes: the same losses, step for step."""
    from helpers.processes import run_torchrun
    from helpers.runs import read_log, train_records
    one_node = run_torchrun(*TWO_NODES, "--data_dir", shards, "--log_dir", tmp_path / "one_node")
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    expected = [r["train_loss"] for r in train_records(read_log(tmp_path / "one_node"))]
    assert len(expected) == 5
    run = [*TWO_NODES, "--data_dir", shards, "--log_dir", tmp_path / "preempted"]
    stopped = run_two_nodes(*run, stop_at_step=1)
    assert "stopping on a signal at step" in stopped[0].stdout + stopped[1].stdout, stopped[1].stderr[-3000:]
    stopped_at = checkpoint_files.checkpoint_step(checkpoint_files.list_checkpoints(str(tmp_path / "preempted"))[-1])
    assert 1 <= stopped_at < 5
    for node in run_two_nodes(*run):  # the same commands again: --resume auto
        assert node.returncode == 0, node.stderr[-3000:]
    assert [r["train_loss"] for r in train_records(read_log(tmp_path / "preempted"))] == expected


ON_ANOTHER_HOST = """
import os, socket, sys
sys.path.insert(0, {repo!r})
if os.environ["RANK"] == "1":
    socket.gethostname = lambda: "node-1"  # as on a second machine
import train_gpt2
train_gpt2.main()
"""


@pytest.mark.slow
def test_a_rank_that_fails_on_another_node_is_named_on_rank_0s_node_too(bad_id_on_rank_1, tmp_path):
    """Two launchers (--nnodes=2), rank 1's on "another host": rank 1 says its shard error on its
    node, and rank 0, whose collective then fails, says the same line on its node, where the user
    of node 0's output would otherwise see nothing."""
    data_dir, shard = bad_id_on_rank_1
    script = tmp_path / "on_another_host.py"
    script.write_text(ON_ANOTHER_HOST.format(repo=REPO))
    nodes = run_two_nodes(script, *ONE_WINDOW_A_RANK, "--data_dir", data_dir, "--log_dir", tmp_path / "log")
    line = f"error: rank 1: {shard}: token id 65535 at position {BAD_ID_AT} is >= vocab_size 256"
    for node in nodes:
        assert node.returncode != 0 and said_errors(node.stderr) == [line], node.stderr[-3000:]
        assert "Connection closed" not in node.stderr and torchrun_root_cause(node.stderr) == line
