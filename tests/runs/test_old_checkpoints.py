"""Checkpoints of both formats that commit de4c38f wrote, before the flags' record was named "flags"
(tests/data/de4c38f/, README.md there): resumed by this code, each trains the steps de4c38f's own
resume trained to its losses, gradient norms and val losses (recorded on another CPU: within REL),
reads its run's record (its "args": the optimizer it names, the hyperparameters this run changed),
and, in one process, the run it continues resumes in turn to its own numbers exactly."""
import json
import os

import pytest

from helpers import REPO
from helpers.processes import run_ranks
from helpers.runs import TINY, read_log, train

OLD = os.path.join(REPO, "tests", "data", "de4c38f")
# As write.sh there resumed them: TINY's flags and these, 16 wide with a context of 32, 2 steps on to 4.
FLAGS = ["--n_embd", "16", "--block_size", "32", "--total_batch_size", "256", "-B", "4", "--eval_interval", "2",
         "--val_steps", "1", "--max_steps", "4"]
ON_TWO_RANKS = pytest.mark.slow  # on 2 ranks
# Another CPU sums floats in another order. The most this machine's three ATEN_CPU_CAPABILITY levels
# differed from resumed.json: 1.1e-7 (a rounding), 7.5e-6 for Muon's step-3 gradient norm (its
# orthogonalization amplifies one). A part restored wrongly (the optimizer's moments, a rank's random
# state, the loader's place) moves a gradient norm by 3.7e-3 or more.
REL = 1e-4


@pytest.mark.parametrize("name, ckpt, flags, ranks", [
    ("adamw", "adamw/ckpt_000002.pt", ["--dropout", "0.1"], 1),
    ("muon", "muon/ckpt_000002.pt", ["--optimizer", "muon"], 1),
    ("adamw_fsdp_in_one", "adamw_fsdp/ckpt_000002", ["--dropout", "0.1"], 1),
    ("muon_fsdp_in_one", "muon_fsdp/ckpt_000002", ["--optimizer", "muon"], 1),
    pytest.param("adamw_fsdp", "adamw_fsdp/ckpt_000002", ["--dropout", "0.1", "--fsdp", "1"], 2, marks=ON_TWO_RANKS),
    pytest.param("muon_fsdp", "muon_fsdp/ckpt_000002", ["--optimizer", "muon", "--fsdp", "1"], 2, marks=ON_TWO_RANKS),
    pytest.param("muon_in_fsdp", "muon/ckpt_000002.pt", ["--optimizer", "muon", "--fsdp", "1"], 2, marks=ON_TWO_RANKS),
])
def test_a_checkpoint_of_de4c38f_resumes_as_de4c38f_resumed_it(shards, tmp_path, capsys, name, ckpt, flags, ranks):
    """One-file and sharded, AdamW (at --dropout 0.1: every rank's random state) and Muon, in one
    process and under FSDP on 2 ranks (a one-file checkpoint too). In one process, the run's own
    checkpoint at step 3 resumes to its numbers bit for bit: this machine's reference."""
    ckpt = os.path.join(OLD, ckpt)
    first = resume(shards, tmp_path / "first", capsys, ranks, *flags, "--resume", ckpt, "--checkpoint_interval", "1")
    assert f"resuming from {ckpt} at step 2" in first
    # Its record, read: max_steps went from 2 to 4, and with it the schedule's decay_steps.
    assert "this run's flags win over the checkpoint's: decay_steps 2 -> 4\n" in first
    with open(os.path.join(OLD, "resumed.json")) as f:
        assert numbers(read_log(tmp_path / "first")) == pytest.approx(numbers(json.load(f)[name]), rel=REL, abs=0)
    if ranks == 1:  # on 2 ranks tests/training/test_fsdp.py resumes exactly; a run on ranks more costs seconds
        (step_3,) = [entry for entry in os.listdir(tmp_path / "first") if entry.startswith("ckpt_000003")]
        resume(shards, tmp_path / "again", capsys, ranks, *flags, "--resume", tmp_path / "first" / step_3)
        assert numbers(read_log(tmp_path / "again")) == {
            key: value for key, value in numbers(read_log(tmp_path / "first")).items() if key[0] >= 3}


def resume(shards, log_dir, capsys, ranks, *flags):
    """The trainer on FLAGS and flags, in this process or on ranks (run_ranks); returns its stdout."""
    if ranks == 1:
        train(shards, log_dir, *FLAGS, *flags)
        return capsys.readouterr().out
    result = run_ranks("train_gpt2.py", *TINY, *FLAGS, *flags, "--data_dir", shards, "--log_dir", log_dir,
                       nproc=ranks, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def numbers(records):
    """{(step, name): value} of the losses, gradient norms and val losses in records (log.jsonl's, or
    resumed.json's of de4c38f)."""
    names = ("train_loss", "grad_norm", "val_loss")
    return {(r["step"], name): r[name] for r in records for name in names if name in r}
