"""torchrun itself, where the launcher is what a test is about: the README's command, torchrun's
summary of failed ranks and its root cause, restarts (--max-restarts), SIGTERM to torchrun within
its grace period, and two nodes through two launchers on 127.0.0.1. Each launch costs a launcher's
start and a rendezvous besides the ranks'; every other test on ranks starts them in-test
(helpers.processes.run_ranks)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train_gpt2
from gpt2repro.common import cli
from gpt2repro.lm.data import write_shard
from gpt2repro.runs import checkpoint_files
from helpers import REPO
from helpers.files import write_token_shards
from helpers.processes import (finish_torchrun, popen_torchrun, run_ranks, run_torchrun, said_errors,
                               torchrun_root_cause, wait_for_line)
from helpers.runs import (TINY, assert_each_step_logged_once, assert_same_run, final_weights, read_log, train,
                          train_records)

# ----------------------------------------------------------------------------- what the in-test ranks stand in for

ENVIRONMENT_DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""
# Each launch's own (its store's port, its id, its error file's path), or the launcher's alone.
LAUNCH_OWN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_SIGNALS_TO_HANDLE"}


@pytest.mark.slow
def test_ranks_started_in_test_see_the_environment_torchruns_workers_see(tmp_path):
    """run_ranks stands in for torchrun in every other test on ranks. Started from the same
    environment (os.environ, given to torchrun too: what a library's setenv adds, such as readline's
    LINES and COLUMNS, reaches only a child that inherits), each rank sees what torchrun's worker of
    that rank sees, but what is each launch's own; of torchrun's variables it lacks only the error file
    and the launcher's own signal list."""
    script = tmp_path / "dump_environment.py"
    script.write_text(ENVIRONMENT_DUMP)
    for launch in ("torchrun", "in_test"):
        (tmp_path / launch).mkdir()
    for result in (finish_torchrun(popen_torchrun(script, tmp_path / "torchrun", env=dict(os.environ)), timeout=120),
                   run_ranks(script, tmp_path / "in_test")):
        assert result.returncode == 0, result.stderr[-3000:]
    for rank in ("0", "1"):
        under_torchrun, in_test = (json.loads((tmp_path / launch / f"{rank}.json").read_text())
                                   for launch in ("torchrun", "in_test"))
        assert in_test["RANK"] == rank and set(under_torchrun) - set(in_test) == {"TORCHELASTIC_ERROR_FILE",
                                                                                 "TORCHELASTIC_SIGNALS_TO_HANDLE"}
        assert {k: v for k, v in in_test.items() if k not in LAUNCH_OWN} == \
            {k: v for k, v in under_torchrun.items() if k not in LAUNCH_OWN}


# ----------------------------------------------------------------------------- the README's command

@pytest.mark.slow
def test_the_demo_under_torchrun_trains_as_on_one_process(tmp_path, demo_dir):
    """The README's torchrun line with the demo: 2 ranks of 4 sequences (-B auto), the losses of one
    process's 8 (3 steps, evaluated but not sampled: what differs between the two is the step)."""
    flags = ["--preset", "demo", "--data_dir", str(demo_dir), "--max_steps", "3", "--val_steps", "2",
             "--sample_interval", "0", "--hellaswag_path", str(tmp_path / "absent.jsonl")]
    train_gpt2.main([*flags, "--log_dir", str(tmp_path / "single")])  # shards the corpus into demo_dir
    result = run_torchrun("train_gpt2.py", *flags, "--log_dir", tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2, device cpu, 1 micro-steps of 4x128 tokens per step of 1024" in result.stdout
    assert_same_run(read_log(tmp_path / "single"), read_log(tmp_path / "ddp"))


# ----------------------------------------------------------------------------- torchrun's summary

@pytest.mark.slow
def test_a_bad_flag_under_torchrun_is_one_line_from_rank_0(shards, tmp_path):
    result = run_torchrun("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path, "--max_lr", "x")
    assert result.returncode != 0
    line = "train_gpt2.py: error: argument --max_lr: invalid float value: 'x' (see --help)"
    assert [text for text in result.stderr.splitlines() if text.startswith("train_gpt2.py: error:")] == [line], \
        result.stderr[-3000:]
    assert torchrun_root_cause(result.stderr) == line  # torchrun's summary gives it too, where the user looks


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



# ----------------------------------------------------------------------------- restarts and preemption

RUN = ["--total_batch_size", "256", "-B", "8", "--max_steps", "8", "--checkpoint_interval", "4"]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_the_newest_checkpoint(shards, tmp_path):
    # Two ranks of B=4 read what one process of B=8 reads: the reference run's weights.
    train(shards, tmp_path / "uninterrupted", *RUN)
    args = ["train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", str(tmp_path / "restarted"), *RUN, "-B", "4",
            "--fault", "sigkill@6:1"]
    result = run_torchrun("--max-restarts=1", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "ckpt_000004.pt at step 4" in result.stdout
    assert_each_step_logged_once(tmp_path / "restarted", 8)
    for key, tensor in final_weights(tmp_path / "uninterrupted", 8).items():
        assert torch.allclose(final_weights(tmp_path / "restarted", 8)[key], tensor, atol=1e-5), key


# Steps of 1200 micro-steps (about 2 s here): longer than the grace period torchrun is given below.
PREEMPTED = ["train_gpt2.py", *TINY, "-B", "1", "--total_batch_size", str(1200 * 2 * 32), "--max_steps", "2",
             "--checkpoint_interval", "0"]


@pytest.mark.slow
@pytest.mark.skipif(cli.torch_release(torch.__version__) < (2, 12), reason="torchrun's --shutdown-timeout: torch 2.12")
def test_preemption_through_torchrun_checkpoints_within_its_grace_period(shards, tmp_path):
    """SLURM and Kubernetes send SIGTERM to torchrun, which forwards it to the workers and SIGKILLs
    them after a grace period (--shutdown-timeout: 30 s by default, 1 s here) that a step may
    outlast. The step in flight is dropped at a micro-step, the checkpoint written in time, and
    the resumed run's losses are the uninterrupted run's (the runs torchrun is not part of: in-test)."""
    result = run_ranks(*PREEMPTED, "--data_dir", shards, "--log_dir", tmp_path / "uninterrupted")
    assert result.returncode == 0, result.stderr[-3000:]
    proc = popen_torchrun(*PREEMPTED, "--data_dir", shards, "--log_dir", tmp_path / "stopped",
                          torchrun_flags=["--shutdown-timeout", "1"])
    wait_for_line(proc, "step     0 |")
    proc.send_signal(signal.SIGTERM)  # to torchrun only, as srun or the kubelet sends it
    stopped = finish_torchrun(proc, timeout=60)
    assert "stopping on a signal at step 1" in stopped.stdout, stopped.stderr[-3000:]
    # torchrun's own traceback follows (it re-raises the signal), but none from a worker, none SIGKILLed.
    assert "closing signal SIGKILL" not in stopped.stderr and 'train_gpt2.py", line' not in stopped.stderr
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path / "stopped"))] == ["ckpt_000001.pt"]
    result = run_ranks(*PREEMPTED, "--data_dir", shards, "--log_dir", tmp_path / "stopped")  # --resume auto
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [[r["train_loss"] for r in train_records(read_log(tmp_path / run))] for run in ("uninterrupted", "stopped")]
    assert len(losses[0]) == 2 and losses[1] == losses[0]


# ----------------------------------------------------------------------------- two nodes

def popen_node(node_rank, port, *args):
    """One node's torchrun launcher (one CPU worker) of a two-node run that meets at 127.0.0.1:port,
    in its own process group, so that a hung run's worker dies with it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
           "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--local_addr=127.0.0.1",
           *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_two_nodes(*args, stop_at_step=None):
    """Both nodes' launchers to the end; with stop_at_step, node 1's gets SIGTERM once the shared
    log_dir's log.jsonl holds that step, as a cluster preempting one node sends it, and node 0's
    once node 1's has exited."""
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
        # In the barrier the launcher may not act on SIGTERM at all (seen: no worker left, 30 s on),
        # so the grace period is all that waits: 10 s covers a worker still exiting on a loaded machine.
        nodes[0].send_signal(signal.SIGTERM)
        try:
            out, err = nodes[0].communicate(timeout=10)
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
    exactly as one node of two processes (started in-test): the same losses, step for step."""
    one_node = run_ranks(*TWO_NODES, "--data_dir", shards, "--log_dir", tmp_path / "one_node")
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
