"""Faults injected into training runs: each must be survived, and where the fault allows,
the run must end with the weights of a run that never met it."""
import os
import re
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt2
from gpt2repro.lm.data import write_shard
from gpt2repro.runs import checkpoint, checkpoint_files, loading, logdir
from gpt2repro.training import memory
from gpt2repro.training.train_config import ScaleConfig
from helpers import REPO
from helpers.files import EXAMPLES, WritesAFile, listdir, write_jsonl, write_token_shards
from helpers.limits import disk_full, file_size_limit
from helpers.processes import one_line_error, run_ranks, said_errors, wait_for_line
from helpers.runs import (TINY, TINY_CONFIG, assert_each_step_logged_once, assert_same_run, error_of, final_weights,
                          read_log, run_cli, signal_in_evaluation, train, train_records)
from model import GPT, GPTConfig, n_params

RUN = ["--total_batch_size", "256", "-B", "8", "--max_steps", "8", "--checkpoint_interval", "4"]
LONG = [*RUN, "--max_steps", "40"]


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    """The reference: RUN from start to end with nothing going wrong."""
    log_dir = tmp_path_factory.mktemp("uninterrupted")
    return train(shards, log_dir, *RUN), final_weights(log_dir, 8)


@pytest.fixture(scope="module")
def uninterrupted_long(shards, tmp_path_factory):
    """RUN for 40 steps: long enough for a test to signal it from outside mid-way."""
    log_dir = tmp_path_factory.mktemp("uninterrupted_long")
    return train(shards, log_dir, *LONG), final_weights(log_dir, 40)


def assert_weights_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def popen_train(shards, log_dir, *flags):
    return subprocess.Popen([sys.executable, "train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", str(log_dir),
                             *RUN, *map(str, flags)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_cleanly_and_resumes_exactly(shards, uninterrupted_long, tmp_path):
    proc = popen_train(shards, tmp_path, *LONG)
    wait_for_line(proc, "step     2 |")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopping on a signal" in out
    stopped_at = int(checkpoint_files.list_checkpoints(str(tmp_path))[-1][-9:-3])
    # The summary says it stopped, not that it is done (LONG evaluates nothing).
    assert re.match(rf"stopped: step {stopped_at} of 40, .* no val loss, last checkpoint ",
                    out.strip().splitlines()[-1]), out.strip().splitlines()[-1]
    assert 3 <= stopped_at < 40
    assert_each_step_logged_once(tmp_path, stopped_at)
    train(shards, tmp_path, *LONG)  # the same command again: --resume auto
    assert_weights_equal(final_weights(tmp_path, 40), uninterrupted_long[1])
    assert_each_step_logged_once(tmp_path, 40)


SIGNALLED_WHILE_RESTORING = """
import os, sys, time
sys.path.insert(0, {repo!r})
import train_gpt2
from gpt2repro.runs import checkpoint
restore_parts = checkpoint.restore_parts
def restore_once_signalled(*args):
    print("restoring: waiting for the signal", flush=True)
    while not os.path.exists({sent!r}):  # made once the test has sent it
        time.sleep(0.01)
    return restore_parts(*args)
checkpoint.restore_parts = restore_once_signalled
train_gpt2.main()
"""


@pytest.mark.slow
def test_a_ctrl_c_during_a_resumes_start_up_stops_it_before_its_first_step(shards, tmp_path):
    """A SIGINT while the checkpoint is restored (once lost: the run trained on) ends the run at
    its first step, exit code 0, with nothing trained or written: the checkpoints are as they were."""
    log_dir, sent = tmp_path / "run", tmp_path / "sent"
    train(shards, log_dir, *RUN, "--max_steps", "4")
    def checkpoints():
        return {path: (os.stat(path).st_mtime_ns, open(path, "rb").read())
                for path in checkpoint_files.list_checkpoints(str(log_dir))}
    saved = checkpoints()
    script = tmp_path / "signalled_while_restoring.py"
    script.write_text(SIGNALLED_WHILE_RESTORING.format(repo=REPO, sent=str(sent)))
    proc = subprocess.Popen([sys.executable, script, *TINY, "--data_dir", shards, "--log_dir", log_dir, *RUN],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "restoring: waiting for the signal")
    proc.send_signal(signal.SIGINT)
    sent.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = out.strip().splitlines()
    assert "stopping on a signal at step 4, before this run trained a step: nothing to save; the same command starts " \
           "here again" in lines
    assert re.match(rf"stopped: step 4 of 8, .* no val loss, last checkpoint {log_dir / 'ckpt_000004.pt'}$", lines[-1])
    assert checkpoints() == saved
    assert_each_step_logged_once(log_dir, 4)


STOPPED_UNDER_DROPOUT = [*RUN, "--max_steps", "4", "--dropout", "0.1"]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_sigterm_resume_under_dropout_gives_the_uninterrupted_losses(shards, tmp_path, optimizer, ranks):
    """The step a SIGTERM drops has drawn dropout's masks in its forward pass: the checkpoint
    written then holds the random state of the step's start, as it holds the loader's, so the
    resumed steps draw the masks the uninterrupted run drew, on every rank."""
    def run_into(log_dir, *flags):
        args = [*STOPPED_UNDER_DROPOUT, "--optimizer", optimizer, *flags]
        if ranks == 1:
            return train(shards, log_dir, *args)
        result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", log_dir, *args, "-B", "4")
        assert result.returncode == 0, result.stderr[-3000:]
        return read_log(log_dir)

    uninterrupted = run_into(tmp_path / "uninterrupted")
    run_into(tmp_path / "stopped", "--fault", "sigterm@2")
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path / "stopped"))] == ["ckpt_000002.pt"]
    resumed = run_into(tmp_path / "stopped")  # --resume auto
    assert [r["train_loss"] for r in train_records(resumed)] == [r["train_loss"] for r in train_records(uninterrupted)]


# A run that evaluates at steps 0, 2 and 4, each evaluation of several batches: the val loss (4),
# HellaSwag (40 examples, 16 a batch) and samples (32 tokens, one a batch), of a model with GPT-2's
# vocabulary, which the last two need. Its only checkpoint at an interval is the last step's.
EVALUATED = [*RUN, "--max_steps", "4", "--vocab_size", "50304", "--eval_interval", "2", "--val_steps", "4",
             "--hellaswag", "1", "--sample_interval", "2"]
EVALUATIONS = ["val loss", "hellaswag", "samples"]
LOGGED_BEFORE = {"val loss": [], "hellaswag": ["val_loss"], "samples": ["val_loss", "hellaswag_acc_norm"]}  # in order


def evaluation_records(records):
    """What the evaluations logged, as (step, key, value)."""
    keys = ("val_loss", "hellaswag_acc_norm", "samples")
    return [(r["step"], key, r[key]) for r in records for key in keys if key in r]


@pytest.fixture(scope="module")
def hellaswag_examples(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("hellaswag") / "hellaswag.jsonl", EXAMPLES * 8)


@pytest.fixture(scope="module")
def uninterrupted_evaluated(shards, hellaswag_examples, tmp_path_factory):
    return train(shards, tmp_path_factory.mktemp("evaluated"), *EVALUATED, "--hellaswag_path", hellaswag_examples)


@pytest.mark.parametrize("evaluation", EVALUATIONS)
def test_a_stop_during_an_evaluation_is_heard_at_its_next_batch(shards, hellaswag_examples, uninterrupted_evaluated,
                                                                 tmp_path, monkeypatch, capsys, evaluation):
    """A SIGTERM as an evaluation's first batch runs (once, heard only when all of them had run):
    no batch after it runs, the checkpoint of the last step trained is written, and the resumed
    run evaluates that step again and ends as the uninterrupted run did."""
    batches = signal_in_evaluation(evaluation, 2, monkeypatch.setattr)
    records = train(shards, tmp_path, *EVALUATED, "--hellaswag_path", hellaswag_examples)
    assert batches == [evaluation]
    out = capsys.readouterr().out
    assert "stopping on a signal at step 2, its evaluation cut short; `--resume auto` continues here" in out
    assert re.match(r"stopped: step 2 of 4, .* val loss [0-9.]+ at step 0, last checkpoint .*ckpt_000002.pt$",
                    out.strip().splitlines()[-1]), out.strip().splitlines()[-1]
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == ["ckpt_000002.pt"]
    assert [key for step, key, _ in evaluation_records(records) if step == 2] == LOGGED_BEFORE[evaluation]
    monkeypatch.undo()
    resumed = train(shards, tmp_path, *EVALUATED, "--hellaswag_path", hellaswag_examples)  # --resume auto
    assert evaluation_records(resumed) == evaluation_records(uninterrupted_evaluated)
    assert [r["train_loss"] for r in train_records(resumed)] == \
        [r["train_loss"] for r in train_records(uninterrupted_evaluated)]


def test_a_stop_during_the_first_evaluation_saves_nothing(shards, hellaswag_examples, tmp_path, monkeypatch, capsys):
    batches = signal_in_evaluation("hellaswag", 0, monkeypatch.setattr)
    records = train(shards, tmp_path, *EVALUATED, "--hellaswag_path", hellaswag_examples)
    assert batches == ["hellaswag"]
    assert ("stopping on a signal at step 0, before this run trained a step: nothing to save; the same command "
            "starts here again") in capsys.readouterr().out
    assert checkpoint_files.list_checkpoints(str(tmp_path)) == []
    assert [key for _, key, _ in evaluation_records(records)] == ["val_loss"] and not train_records(records)


@pytest.mark.slow
@pytest.mark.parametrize("evaluation", EVALUATIONS)
def test_a_stop_that_one_rank_hears_during_an_evaluation_stops_both_at_its_next_batch(shards, hellaswag_examples,
                                                                                     tmp_path, evaluation):
    """SIGTERM on rank 1 alone, as its first batch of the evaluation at step 2 runs: both ranks ask
    each other before every batch (samples too, which every rank draws), so both stop before the
    next one, rank 0 writes the checkpoint of step 2, and both exit with code 0."""
    script = tmp_path / "signalled_on_rank_1.py"
    script.write_text(SIGNALLED_IN_EVALUATION_ON_RANK_1.format(repo=REPO, evaluation=evaluation))
    ranks = run_ranks(script, *TINY, "--data_dir", shards, "--log_dir", tmp_path / "run", *EVALUATED, "-B", "4",
                      "--hellaswag_path", hellaswag_examples).ranks
    assert [rank.returncode for rank in ranks] == [0, 0], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    assert "stopping on a signal at step 2, its evaluation cut short; `--resume auto` continues here" in ranks[0].stdout
    assert ranks[1].stdout == f"batches of the {evaluation} after the signal: 1\n"
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path / "run"))] == ["ckpt_000002.pt"]
    assert [key for step, key, _ in evaluation_records(read_log(tmp_path / "run")) if step == 2] == \
        LOGGED_BEFORE[evaluation]


SIGNALLED_IN_EVALUATION_ON_RANK_1 = """
import os, sys
sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
import train_gpt2
from helpers.runs import signal_in_evaluation
batches = signal_in_evaluation({evaluation!r}, 2) if os.environ["RANK"] == "1" else None
try:
    train_gpt2.main()
finally:  # a rank that run_ranks starts ends without atexit's handlers
    if batches is not None:
        print("batches of the {evaluation} after the signal:", len(batches), flush=True)
"""


@pytest.mark.slow
def test_sigkill_then_resume_auto_loses_and_repeats_nothing(shards, uninterrupted_long, tmp_path):
    proc = popen_train(shards, tmp_path, *LONG)
    wait_for_line(proc, "step     6 |")
    proc.kill()
    proc.wait()
    assert os.path.exists(tmp_path / "ckpt_000004.pt")
    records = train(shards, tmp_path, *LONG)
    assert_weights_equal(final_weights(tmp_path, 40), uninterrupted_long[1])
    assert [r["train_loss"] for r in train_records(records)] == [r["train_loss"] for r in train_records(uninterrupted_long[0])]


def test_damaged_newest_checkpoint_is_skipped(shards, uninterrupted, tmp_path, capsys):
    train(shards, tmp_path, *RUN)
    newest = tmp_path / "ckpt_000008.pt"
    data = newest.read_bytes()
    for cut in random.Random(0).sample(range(1, len(data)), 4) + [0]:
        newest.write_bytes(data[:cut])
        path, state = checkpoint_files.latest_checkpoint(str(tmp_path))
        assert path.endswith("ckpt_000004.pt") and state["step"] == 4
    assert "skipping" in capsys.readouterr().err
    train(shards, tmp_path, *RUN)  # --resume auto takes step 4 and redoes 4..7
    assert_weights_equal(final_weights(tmp_path, 8), uninterrupted[1])


def test_malicious_checkpoint_is_refused_and_never_runs(shards, tmp_path, capsys):
    marker = str(tmp_path / "pwned")
    bad = tmp_path / "ckpt_000004.pt"
    torch.save({"model": WritesAFile(marker), "config": {}, "step": 4}, bad)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "log", *RUN, "--resume", bad)
    assert "refused" in message and "not a plain-data checkpoint" in message
    with pytest.raises(checkpoint.CheckpointError, match="refused"):
        loading.load_model(str(bad))  # what hellaswag.py, sample.py and export_hf.py load through
    assert not os.path.exists(marker)


def test_a_fault_that_could_never_fire_is_one_line(shards, tmp_path, capsys):
    """A fault test whose fault never fires would pass without testing anything: an empty rank
    (once read as every rank), a step past --max_steps or before the resumed step, a rank the
    run lacks (once accepted, the run exiting 0)."""
    common = ["--data_dir", shards, "--log_dir", tmp_path, *RUN]  # 8 steps, one process
    assert error_of(capsys, *common, "--fault", "oom@2:").endswith(
        "error: argument --fault: 'oom@2:' is not KIND@STEP[:RANK] with KIND one of nan, oom, sigterm, sigkill "
        "(see --help)")
    assert error_of(capsys, *common, "--fault", "nan@8").endswith(
        "error: --fault nan@8: this run trains steps 0 to 7, never step 8 (see --help)")
    assert error_of(capsys, *common, "--fault", "oom@2:1") == "error: --fault oom@2:1: no rank 1 in a run of 1 rank(s)"
    train(shards, tmp_path, *RUN, "--max_steps", "4")
    assert error_of(capsys, *common, "--fault", "nan@3") == (
        "error: --fault nan@3: this run trains steps 4 to 7, never step 3")
    assert [r["step"] for r in train_records(read_log(tmp_path))] == [0, 1, 2, 3]  # nothing past the checkpoint lost


@pytest.mark.slow
def test_a_fault_on_a_rank_the_run_lacks_is_one_line_on_two_ranks(shards, tmp_path):
    result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path, *RUN, "-B", "4",
                       "--fault", "oom@2:2", timeout=120)
    assert result.returncode != 0, result.stderr[-3000:]
    assert said_errors(result.stderr) == ["error: --fault oom@2:2: no rank 2 in a run of 2 rank(s)"]
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_nan_steps_are_skipped_without_touching_the_weights(shards, tmp_path):
    records = train(shards, tmp_path, *RUN, "--checkpoint_interval", "3", "--max_steps", "6",
                    "--fault", "nan@3", "--fault", "nan@4")
    skipped = [r["step"] for r in records if r.get("skipped_step")]
    assert skipped == [3, 4]
    assert [r["step"] for r in train_records(records)] == [0, 1, 2, 5]
    # Steps 3 and 4 made no update: the weights after step 5 started from those at step 3.
    at_3 = checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000003.pt")).state
    assert at_3["optimizer"]["state"][0]["step"].item() == 3
    assert checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000006.pt")).state["optimizer"]["state"][0]["step"].item() == 4


def test_a_nan_step_under_fp16_loss_scaling_is_skipped_and_training_goes_on(shards, tmp_path):
    records = train(shards, tmp_path, *RUN, "--dtype", "float16", "--max_steps", "4", "--fault", "nan@2")
    assert [r["step"] for r in records if r.get("skipped_step")] == [2]
    assert [r["step"] for r in train_records(records)] == [0, 1, 3]


@pytest.mark.slow
def test_too_many_bad_steps_in_a_row_stop_the_run(shards, tmp_path):
    faults = [arg for step in range(2, 8) for arg in ("--fault", f"nan@{step}")]
    result = run_cli("--data_dir", shards, "--log_dir", tmp_path, *RUN, "--max_bad_steps", "3", *faults)
    message = one_line_error(result)
    assert "3 steps in a row had a non-finite loss" in message
    for path in checkpoint_files.list_checkpoints(str(tmp_path)):
        assert all(t.isfinite().all() for t in checkpoint_files.load_checkpoint(path).state["model"].values())


def test_full_disk_warns_keeps_training_and_keeps_older_checkpoints(shards, tmp_path, monkeypatch, capsys):
    real_disk_usage = checkpoint_files.shutil.disk_usage
    calls = []

    def disk_full_after_first_checkpoint(path):
        calls.append(path)
        usage = real_disk_usage(path)
        return usage._replace(free=usage.free if len(calls) == 1 else 1000)

    monkeypatch.setattr(checkpoint_files.shutil, "disk_usage", disk_full_after_first_checkpoint)
    train(shards, tmp_path, *RUN)
    assert "skipping checkpoint" in capsys.readouterr().err
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == ["ckpt_000004.pt"]
    assert_each_step_logged_once(tmp_path, 8)
    checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000004.pt")).state


def test_a_log_that_cannot_be_written_warns_and_training_goes_on(shards, tmp_path, monkeypatch, capsys):
    def disk_full_for_the_log(path, mode="r", *args, **kwargs):
        if str(path).endswith("log.jsonl") and mode == "a":
            disk_full()
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(logdir, "open", disk_full_for_the_log, raising=False)  # shadows the builtin there
    monkeypatch.setattr(logdir, "atomic_open", disk_full)  # the rewrite at the start
    train_gpt2.main(TINY + ["--data_dir", shards, "--log_dir", str(tmp_path), *RUN])
    err = capsys.readouterr().err
    assert "warning: could not rewrite" in err and "warning: could not append to" in err
    assert checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000008.pt")).state["step"] == 8


def test_a_write_that_fails_midway_leaves_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt_000001.pt")
    checkpoint_files.save_checkpoint(path, {"model": {"w": torch.ones(3)}, "config": {}})

    def half_written(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files.torch, "save", half_written)
    assert checkpoint_files.save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "config": {}}) is False
    assert listdir(tmp_path) == ["ckpt_000001.pt"]
    assert torch.equal(checkpoint_files.load_checkpoint(path).state["model"]["w"], torch.ones(3))


@pytest.mark.parametrize("bad, problem", [
    (np.arange(100, dtype=np.int32), "expected a 1-D uint16 array"),
    (np.zeros(0, dtype=np.uint16), "empty shard"),
])
def test_shards_of_the_wrong_kind_are_named(shards, tmp_path, capsys, bad, problem):
    paths = write_token_shards(tmp_path / "data")
    with open(paths[1], "wb") as f:
        np.save(f, bad)
    message = error_of(capsys, "--data_dir", tmp_path / "data", "--log_dir", tmp_path / "log", *RUN)
    assert paths[1] in message and problem in message


@pytest.mark.slow
def test_full_data_check_finds_what_the_quick_one_samples_past(tmp_path):
    paths = write_token_shards(tmp_path / "data", n_train=1, tokens_per_shard=300_000)
    tokens = np.load(paths[1])
    tokens[70_000] = 999  # outside the first, middle and last 64K tokens that the quick check reads
    write_shard(paths[1], tokens)
    args = ["--data_dir", tmp_path / "data", "--log_dir", tmp_path / "log", *RUN, "--max_steps", "1"]
    assert run_cli(*args).returncode == 0
    message = one_line_error(run_cli(*args, "--check_data", "full"))
    assert paths[1] in message and "token id 999 at position 70000" in message


@pytest.mark.slow
def test_too_few_val_tokens_reduce_val_steps_with_a_warning(tmp_path):
    write_token_shards(tmp_path / "data", n_val=600)
    result = run_cli("--data_dir", tmp_path / "data", "--log_dir", tmp_path / "log", *RUN,
                     "--eval_interval", "4", "--val_steps", "20")
    assert result.returncode == 0, result.stderr
    assert "fewer than --val_steps 20: using 2" in result.stdout
    assert len([r for r in read_log(tmp_path / "log") if "val_loss" in r]) == 3


REPLICA_DUMP = """
import os, sys
import torch
sys.path.insert(0, {repo!r})
import train_gpt2
log_dir = train_gpt2.parse_args(sys.argv[1:]).log_dir
model = train_gpt2.main(sys.argv[1:])
checkpoints = sorted(f for f in os.listdir(log_dir) if f.startswith("ckpt_"))  # on disk as main() returned
torch.save(dict(weights=model.state_dict(), checkpoints=checkpoints), os.path.join(log_dir, "rank%s.pt" % os.environ["RANK"]))
"""


@pytest.mark.slow
def test_ranks_agree_on_a_fault_seen_by_one_rank(shards, tmp_path):
    """A NaN and a SIGTERM on rank 1 only: both ranks skip the same step, drop the same step in
    flight, end with bit-identical weights, and leave train() once rank 0's checkpoint is written."""
    script = tmp_path / "dump_replicas.py"
    script.write_text(REPLICA_DUMP.format(repo=REPO))
    args = [str(script), *TINY, "--data_dir", shards, "--log_dir", str(tmp_path), *RUN, "-B", "4",
            "--max_steps", "20", "--fault", "nan@1:1", "--fault", "sigterm@3:1"]
    result = run_ranks(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_log(tmp_path)
    assert [r["step"] for r in records if r.get("skipped_step")] == [1]
    assert [r["step"] for r in train_records(records)] == [0, 2]
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == ["ckpt_000003.pt"]
    replicas = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert_weights_equal(replicas[0]["weights"], replicas[1]["weights"])
    assert replicas[1]["checkpoints"] == ["ckpt_000003.pt"]


ON_RANK_1 = """
import os, sys
sys.path.insert(0, {repo!r})
import hellaswag, train_gpt2
from gpt2repro.runs import checkpoint
if os.environ["RANK"] == "1":
    {patch}
train_gpt2.main()
"""


def run_with_rank_1_patched(tmp_path, patch, *args):
    script = tmp_path / "patched_on_rank_1.py"
    script.write_text(ON_RANK_1.format(repo=REPO, patch=patch))
    return run_ranks(script, *TINY, *RUN, "-B", "4", *args, timeout=120)


@pytest.mark.slow
def test_ranks_that_find_different_checkpoints_refuse_to_resume(shards, tmp_path):
    train(shards, tmp_path, *RUN, "--max_steps", "2")
    # As on a second node that does not share rank 0's disk: it finds no checkpoint.
    result = run_with_rank_1_patched(tmp_path, "checkpoint.find_resume = lambda resume, log_dir: None",
                                     "--data_dir", shards, "--log_dir", tmp_path, "--max_steps", "4")
    assert result.returncode == 1
    said = said_errors(result.stderr)
    assert len(said) == 1 and said[0].startswith("error: the ranks found different checkpoints to resume from "
                                                 "(step per rank: [2, None])")
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == ["ckpt_000002.pt"]
    assert_each_step_logged_once(tmp_path, 2)


@pytest.mark.slow
def test_hellaswag_is_skipped_on_every_rank_when_one_rank_cannot_load_it(shards, tmp_path):
    examples = write_jsonl(tmp_path / "hellaswag.jsonl", EXAMPLES)
    result = run_with_rank_1_patched(
        tmp_path, "hellaswag.load_examples = lambda path, **flags: (_ for _ in ()).throw(hellaswag.HellaSwagError('offline'))",
        "--data_dir", shards, "--log_dir", tmp_path, "--max_steps", "2", "--eval_interval", "1",
        "--hellaswag", "1", "--hellaswag_path", examples)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping HellaSwag: not every rank could load it (examples per rank: [5, 0])" in result.stdout
    records = read_log(tmp_path)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 1, 2]
    assert not any("hellaswag_acc_norm" in r for r in records)


@pytest.mark.slow
def test_hellaswag_is_downloaded_once_per_machine_not_once_per_rank(shards, tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    write_jsonl(mirror / "hellaswag_val.jsonl", [EXAMPLES[i % len(EXAMPLES)] for i in range(10042)])
    monkeypatch.setenv("HELLASWAG_URL", mirror.as_uri())
    script = tmp_path / "cached_in_tmp.py"
    script.write_text(f"import sys; sys.path.insert(0, {REPO!r})\nimport hellaswag, train_gpt2\n"
                      f"hellaswag.CACHE_DIR = {str(tmp_path / 'cache')!r}\ntrain_gpt2.main()\n")
    result = run_ranks(script, *TINY, *RUN, "-B", "4", "--vocab_size", "50304", "--data_dir", shards,
                       "--log_dir", tmp_path / "log", "--max_steps", "1", "--eval_interval", "1",
                       "--hellaswag", "1", "--hellaswag_limit", "4", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("downloading ") == 1
    assert [r["hellaswag_n"] for r in read_log(tmp_path / "log") if "hellaswag_n" in r] == [4, 4]


@pytest.mark.slow
def test_ranks_stop_together_after_too_many_bad_steps_on_one_rank(shards, tmp_path):
    faults = [arg for step in (1, 2) for arg in ("--fault", f"nan@{step}:1")]
    result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path, *RUN, "-B", "4",
                       "--max_bad_steps", "2", *faults, timeout=120)
    assert result.returncode != 0  # and not a hang: both ranks took the decision at the same step
    said = said_errors(result.stderr)
    assert len(said) == 1 and said[0].startswith("error: 2 steps in a row had a non-finite loss")  # by rank 0
    records = read_log(tmp_path)
    assert [r["step"] for r in records if r.get("skipped_step")] == [1, 2]
    assert [r["step"] for r in train_records(records)] == [0]


def test_a_model_that_cannot_be_loaded_is_one_checkpoint_error(tmp_path):
    """load_model, behind hellaswag.py, sample.py, export_hf.py and --init_from, turns every
    failure into a one-line CheckpointError naming the model."""
    not_hf = tmp_path / "not_a_model"
    not_hf.mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"not_a_model: a directory with neither checkpoints .* nor "
                                                         r"a Hugging Face GPT-2 model \(config.json\) in it$") as e:
        loading.load_model(str(not_hf))
    assert "\n" not in str(e.value)
    wrong_shape = tmp_path / "ckpt_000001.pt"
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    state = {"model": model.state_dict(), "config": {**model.config.__dict__, "n_embd": 32}}
    torch.save(state, wrong_shape)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint of this GPT"):
        loading.load_model(str(wrong_shape))
    text = tmp_path / "hellaswag.jsonl"  # a file given in the wrong place: not taken for a malicious pickle
    text.write_text('{"ctx": "A man", "label": 0}\n')
    with pytest.raises(checkpoint.CheckpointError, match=r": not a checkpoint \(no file that torch.save writes\)"):
        loading.load_model(str(text))


# ----------------------------------------------------------------------------- runs never mixed, erased or lost

@pytest.mark.slow
def test_a_file_size_limit_mid_save_warns_keeps_the_older_checkpoint_and_trains_on(shards, tmp_path):
    """The free-space check passes, then the write fails: torch's zip writer reports it as a
    RuntimeError ("unexpected pos"), which must be a warning like any full disk."""
    train(shards, tmp_path, *RUN, "--max_steps", "4")
    size = os.path.getsize(tmp_path / "ckpt_000004.pt")
    result = subprocess.run([sys.executable, "train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", str(tmp_path),
                             *RUN], cwd=REPO, capture_output=True, text=True, timeout=120,
                            preexec_fn=file_size_limit(size // 2))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "could not write checkpoint" in result.stderr and "older checkpoints are kept" in result.stderr
    assert sorted(listdir(tmp_path)) == ["ckpt_000004.pt", "log.jsonl"]  # no temporary file left
    assert checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000004.pt")).state["step"] == 4
    assert_each_step_logged_once(tmp_path, 8)


def test_what_killed_saves_left_is_removed_at_start_and_on_pruning(shards, tmp_path):
    orphans = [tmp_path / "ckpt_000002.pt.tmp4242", tmp_path / "ckpt_000006.partial" / "train_state.pt"]
    for orphan in orphans:
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(b"half a checkpoint")
    (tmp_path / "notes.txt").write_text("the user's own")
    train(shards, tmp_path, *RUN)
    assert sorted(listdir(tmp_path)) == ["ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl", "notes.txt"]
    (tmp_path / "ckpt_000009.pt.tmp7").write_bytes(b"")
    checkpoint_files.prune_checkpoints(str(tmp_path), keep_last=1)
    assert sorted(listdir(tmp_path)) == ["ckpt_000008.pt", "log.jsonl", "notes.txt"]


def test_a_partial_save_or_a_checkpoint_that_is_a_link_is_removed_as_a_link(shards, tmp_path):
    """A ckpt_*.partial that links to a folder (which once stopped every start), or a checkpoint
    that does, pruned: the link goes, never what it leads to."""
    elsewhere, log_dir = tmp_path / "elsewhere", tmp_path / "log"
    elsewhere.mkdir()
    log_dir.mkdir()
    (elsewhere / "notes.txt").write_text("the user's own")
    os.symlink(elsewhere, log_dir / "ckpt_000006.partial")
    train(shards, log_dir, *RUN)
    assert sorted(listdir(log_dir)) == ["ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl"]
    os.symlink(elsewhere, log_dir / "ckpt_000002")  # named as a sharded checkpoint, the oldest
    checkpoint_files.prune_checkpoints(str(log_dir), keep_last=2)
    assert sorted(listdir(log_dir)) == ["ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl"]
    assert listdir(elsewhere) == ["notes.txt"]


@pytest.mark.slow
def test_resume_auto_with_every_checkpoint_unreadable_stops_and_resume_none_moves_the_run_aside(shards, tmp_path):
    train(shards, tmp_path, *RUN)
    for name in ("ckpt_000004.pt", "ckpt_000008.pt"):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    log_before = (tmp_path / "log.jsonl").read_bytes()
    message = one_line_error(run_cli("--data_dir", shards, "--log_dir", tmp_path, *RUN))
    assert message.startswith(f"error: no checkpoint in {tmp_path} can be read (ckpt_000004.pt, ckpt_000008.pt)")
    assert "--resume none" in message
    assert (tmp_path / "log.jsonl").read_bytes() == log_before  # nothing of the old run rewritten
    train(shards, tmp_path, *RUN, "--resume", "none")
    [aside] = [name for name in listdir(tmp_path) if name.startswith("previous_")]
    assert sorted(listdir(tmp_path / aside)) == ["ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl"]
    assert (tmp_path / aside / "log.jsonl").read_bytes() == log_before
    assert checkpoint_files.load_checkpoint(str(tmp_path / "ckpt_000008.pt")).state["step"] == 8  # this run's own
    assert_each_step_logged_once(tmp_path, 8)


@pytest.mark.slow
def test_runs_that_start_over_keep_one_earlier_run_and_say_where_it_went(shards, tmp_path, capsys):
    """As the demo's reruns do (its preset sets --resume none): the third run removes the first."""
    flags = [*RUN, "--max_steps", "2", "--resume", "none"]
    records = [train(shards, tmp_path, *flags)]
    assert "moved the earlier run" not in capsys.readouterr().out
    records.append(train(shards, tmp_path, *flags))
    [first] = [name for name in listdir(tmp_path) if name.startswith("previous_")]
    assert (f"--resume none: moved the earlier run ({logdir.megabytes(tmp_path / first)}) to {tmp_path / first}\n"
            in capsys.readouterr().out)
    assert read_log(tmp_path / first) == records[0]
    first_size = logdir.megabytes(tmp_path / first)
    train(shards, tmp_path, *flags)
    [second] = [name for name in listdir(tmp_path) if name.startswith("previous_")]
    moved = [line for line in capsys.readouterr().out.splitlines() if "moved the earlier run" in line]
    assert moved == [f"--resume none: moved the earlier run ({logdir.megabytes(tmp_path / second)}) to "
                     f"{tmp_path / second}, and removed the one before it, {tmp_path / first} ({first_size})"]
    assert sorted(listdir(tmp_path / second)) == ["ckpt_000002.pt", "log.jsonl"]
    assert read_log(tmp_path / second) == records[1]
    assert (tmp_path / "ckpt_000002.pt").exists()


def earlier_runs(log_dir):
    """{name: sorted names of its files} of each previous_* folder in log_dir."""
    return {name: sorted(listdir(log_dir / name)) for name in listdir(log_dir) if name.startswith("previous_")}


def test_a_start_over_that_fails_at_its_first_step_never_displaces_the_run_with_checkpoints(shards, tmp_path, capsys):
    """Two start-overs that fail at step 0 (an out-of-memory step at -B 8) leave only a log.jsonl
    each: neither is the earlier run that a later start-over keeps. Only a run with a checkpoint
    replaces the run whose checkpoints were moved aside."""
    train(shards, tmp_path, *RUN)
    saved = {name: (tmp_path / name).read_bytes() for name in ("ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl")}
    failing = ["--data_dir", shards, "--log_dir", tmp_path, *RUN, "--resume", "none", "--fault", "oom@0"]
    assert error_of(capsys, *failing) == "error: out of memory at step 0 at -B 8: try -B auto, or a smaller -B"
    with pytest.raises(SystemExit):
        train_gpt2.main(TINY + [str(flag) for flag in failing])
    moved = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--resume none:")]
    [(real, files)] = [(name, files) for name, files in earlier_runs(tmp_path).items() if "log.jsonl" in files
                       and len(files) == 3]
    assert all((tmp_path / real / name).read_bytes() == data for name, data in saved.items())
    [empty] = [name for name in earlier_runs(tmp_path) if name != real]
    assert earlier_runs(tmp_path)[empty] == ["log.jsonl"]
    assert moved == [
        f"--resume none: moved the earlier run (0.0 MB, no checkpoint) to {tmp_path / empty}; kept "
        f"{tmp_path / real} ({logdir.megabytes(tmp_path / real)}): a run without a checkpoint never replaces one with"]
    train(shards, tmp_path, *RUN, "--max_steps", "2", "--resume", "none")  # a run that writes a checkpoint...
    train(shards, tmp_path, *RUN, "--max_steps", "2", "--resume", "none")  # ...replaces them both at the next start
    assert list(earlier_runs(tmp_path).values()) == [["ckpt_000002.pt", "log.jsonl"]]


@pytest.mark.slow
def test_a_start_over_killed_before_its_first_checkpoint_never_displaces_the_run_with_checkpoints(shards, tmp_path):
    """A start-over SIGKILLed at step 1 (or stopped by Ctrl-C twice) leaves a log.jsonl and no
    checkpoint; the next start-over keeps the run whose checkpoints the killed one moved aside."""
    train(shards, tmp_path, *RUN)
    saved = {name: (tmp_path / name).read_bytes() for name in ("ckpt_000004.pt", "ckpt_000008.pt")}
    killed = run_cli("--data_dir", shards, "--log_dir", tmp_path, *RUN, "--resume", "none", "--fault", "sigkill@1")
    assert killed.returncode == -signal.SIGKILL
    assert [name for name in listdir(tmp_path) if not name.startswith("previous_")] == ["log.jsonl"]
    train(shards, tmp_path, *RUN, "--max_steps", "2", "--resume", "none")
    [real] = [name for name, files in earlier_runs(tmp_path).items() if "ckpt_000008.pt" in files]
    assert all((tmp_path / real / name).read_bytes() == data for name, data in saved.items())
    assert sorted(earlier_runs(tmp_path).values()) == [["ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl"],
                                                       ["log.jsonl"]]


def test_log_lines_that_are_not_records_are_skipped_and_a_log_that_is_a_directory_is_refused(shards, tmp_path,
                                                                                                capsys):
    train(shards, tmp_path, *RUN, "--max_steps", "4")
    with open(tmp_path / "log.jsonl", "ab") as f:
        f.write(b'null\n[1, 2]\n{"step": null}\n{"step": "3"}\n\xff\xfe not UTF-8\n')
        f.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")  # nested past Python's recursion limit
    train(shards, tmp_path, *RUN)
    assert "skipped 6 line(s) that are not records of a step" in capsys.readouterr().err
    assert_each_step_logged_once(tmp_path, 8)
    (tmp_path / "other" / "log.jsonl").mkdir(parents=True)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "other", *RUN)
    assert message == f"error: {tmp_path / 'other' / 'log.jsonl'} is a directory, not the run's log: move it out of --log_dir"


@pytest.mark.parametrize("field, value, expected", [
    ("config", "gpt2", "not a checkpoint of this project (its config is 'gpt2', not a dict of values)"),
    ("config", dict(TINY_CONFIG, n_head=0, dropout=0.0, bias=True), "holds a model of another architecture: n_head 0"),
    ("step", "3", "its step is '3', not a step number"),
    ("run", 7, "not a checkpoint of this project (its run is 7, not a run's identity)"),
    ("model", [1], "not a checkpoint of this project (its model is a list, not a state dict)"),
    ("optimizer", {}, "its optimizer cannot be restored"),
    ("train_loader", {}, "its train_loader cannot be restored"),
    ("rng", {"cpu": torch.zeros(3), "cuda": []}, "its rng cannot be restored"),
])
def test_a_checkpoint_with_inconsistent_contents_is_one_line_naming_the_field(shards, tmp_path, capsys, field, value,
                                                                               expected):
    train(shards, tmp_path / "run", *RUN, "--max_steps", "4")
    state = checkpoint_files.load_checkpoint(str(tmp_path / "run" / "ckpt_000004.pt")).state
    state[field] = value
    path = tmp_path / "edited.pt"
    torch.save(state, path)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "new", *RUN, "--resume", path)
    assert message.startswith(f"error: {path}") and expected in message


def test_sizes_no_machine_holds_are_refused_before_allocating(tmp_path, capsys):
    for flags in (["--n_embd", "1000000", "--n_head", "1"], ["--block_size", "1000000000"],
                  ["--vocab_size", "1000000000"], ["--n_layer", "100000", "--n_embd", "768", "--n_head", "12"]):
        message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", tmp_path / "log", *flags)
        assert "parameters needs" in message and "GiB per rank" in message and "(see --plan)" in message, flags
    assert not (tmp_path / "log").exists()


def test_a_sharded_save_that_fails_midway_leaves_no_partial_directory(tmp_path, monkeypatch):
    """In one process (DCP writes without torch.distributed): rank 0's train_state.pt, then the
    shards, fail as on a full disk; each is an OSError for the trainer to warn of, and neither
    leaves a .partial directory for --resume auto or the disk to carry."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(**TINY_CONFIG))
    tensors = {"model": model.state_dict(), "optimizer": model.configure_optimizers(0.1, 1e-3, "cpu").state_dict()}
    path = str(tmp_path / "ckpt_000004")

    def zip_writer_full(*args, **kwargs):  # what torch.save raises when the disk fills mid-file
        raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 704 vs 598")
    monkeypatch.setattr(checkpoint_files.torch, "save", zip_writer_full)
    with pytest.raises(OSError, match="unexpected pos 704 vs 598"):
        checkpoint_files.save_dcp(path, tensors, {"step": 4})
    assert listdir(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint_files.dcp, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint_files.save_dcp(path, tensors, {"step": 4})
    assert listdir(tmp_path) == []


OOM_RUN = ["--total_batch_size", "256", "--max_steps", "4", "--checkpoint_interval", "4"]


@pytest.fixture(scope="module")
def halved_micro_batch(shards, tmp_path_factory):
    """The reference for a step that runs out of memory at -B 8: -B 4 throughout."""
    return train(shards, tmp_path_factory.mktemp("halved"), *OOM_RUN, "-B", "4")


def test_an_out_of_memory_step_reruns_at_half_the_micro_batch(shards, tmp_path, capsys, halved_micro_batch):
    """-B auto (8 on a CPU: the step's 8 sequences) meets an out-of-memory error at step 2: the step
    runs again at 4 with twice the micro-steps, and the run trains every step with -B 4's losses.
    Its checkpoint's loader state records the micro-batch it ended at (its flags, what was asked:
    auto), and a resume at another one says so."""
    records = train(shards, tmp_path, *OOM_RUN, "-B", "auto", "--fault", "oom@2")
    out = capsys.readouterr().out
    assert "micro-batch auto: 8 (" in out and ", 1 micro-steps of 8x32 tokens per step of 256" in out
    assert "out of memory at step 2: micro-batch 8 -> 4, 2 micro-steps per step" in out
    assert [r["step"] for r in train_records(records)] == [0, 1, 2, 3]
    assert_same_run(records, halved_micro_batch, rel=1e-5)
    saved = checkpoint_files.load_checkpoint(tmp_path / "ckpt_000004.pt").state
    assert saved["train_loader"]["tokens_per_index"] == 4 * 32 and checkpoint.recorded_flags(saved)["micro_batch_size"] == "auto"
    train(shards, tmp_path, *OOM_RUN, "-B", "auto", "--max_steps", "5")
    assert (f"note: {tmp_path / 'ckpt_000004.pt'} was saved by a run of micro-batches of 128 tokens over all ranks, "
            f"this run's are 256: the same tokens per optimizer step, in other micro-steps") in capsys.readouterr().out


def test_an_out_of_memory_step_at_an_explicit_micro_batch_is_one_line(shards, tmp_path, capsys):
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path, *OOM_RUN, "-B", "8", "--fault", "oom@1")
    assert message == "error: out of memory at step 1 at -B 8: try -B auto, or a smaller -B"


def test_out_of_memory_at_one_sequence_names_the_hosts_memory_and_no_lever_that_changes_nothing(shards, tmp_path,
                                                                                                capsys, monkeypatch):
    """-B auto at one sequence a step (32 tokens of T=32) has nothing left to halve. On a CPU the
    memory is the host's available memory; the tiny model's plan fits it, so the line says that
    what ran out is not in the plan, and names --recompute full, which lowers the plan by over a tenth."""
    monkeypatch.setattr(memory, "available_memory", lambda: 8 * memory.GiB)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path, *OOM_RUN, "--total_batch_size", "32",
                       "-B", "auto", "--fault", "oom@1")
    config = GPTConfig(**TINY_CONFIG)
    plan, recomputed = (memory.plan(config, 1, 32, ScaleConfig(recompute=mode), compute=memory.Compute(dtype_bytes=4)).total
                        for mode in ("none", "full"))
    assert recomputed < 0.9 * plan
    assert message == (f"error: out of memory at step 1 at micro-batch 1: a GPT of {n_params(config):,} "
                       f"parameters plans {plan / 2**20:.1f} MiB per process at micro-batch 1, within 80% of 8.0 GiB "
                       f"available, so memory the plan does not count ran out (another process's?): --recompute full "
                       f"plans {recomputed / 2**20:.1f} MiB")


@pytest.mark.slow
def test_two_ranks_halve_together_when_one_runs_out_of_memory(shards, tmp_path, halved_micro_batch):
    """Only rank 1 runs out of memory (its micro-batch 4 of the step's 8 sequences); rank 0 learns
    of it, both halve, and together they train -B 4's run in one process."""
    result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path, *OOM_RUN, "-B", "auto",
                       "--fault", "oom@2:1", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "micro-batch auto: 4 (" in result.stdout
    assert result.stdout.count("out of memory at step 2: micro-batch 4 -> 2, 2 micro-steps per step") == 1
    assert_same_run(read_log(tmp_path), halved_micro_batch, rel=1e-5)
