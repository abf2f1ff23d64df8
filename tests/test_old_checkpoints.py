"""Checkpoints of both formats that commit de4c38f wrote, before the flags' record was named "flags"
(tests/data/de4c38f/, README.md there): resumed by this code, each trains the steps de4c38f's own
resume trained to the same losses, gradient norms and val losses, bit for bit, and reads its run's
record (its "args"): the optimizer it names, and the hyperparameters this run changed."""
import json
import os

import pytest

from helpers import REPO, TINY, read_log, run_torchrun, train

OLD = os.path.join(REPO, "tests", "data", "de4c38f")
# As write.sh there resumed them: TINY's flags and these, 16 wide with a context of 32, 2 steps on to 4.
FLAGS = ["--n_embd", "16", "--block_size", "32", "--total_batch_size", "256", "-B", "4", "--eval_interval", "2",
         "--val_steps", "1", "--max_steps", "4"]
ON_TWO_RANKS = pytest.mark.slow  # under torchrun


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
    process and under FSDP on 2 ranks (a one-file checkpoint too)."""
    ckpt = os.path.join(OLD, ckpt)
    if ranks == 1:
        train(shards, tmp_path, *FLAGS, *flags, "--resume", ckpt)
        out = capsys.readouterr().out
    else:
        result = run_torchrun("train_gpt2.py", *TINY, *FLAGS, *flags, "--resume", ckpt, "--data_dir", shards,
                              "--log_dir", tmp_path, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        out = result.stdout
    assert f"resuming from {ckpt} at step 2" in out
    # Its record, read: max_steps went from 2 to 4, and with it the schedule's decay_steps.
    assert "this run's flags win over the checkpoint's: decay_steps 2 -> 4\n" in out
    with open(os.path.join(OLD, "resumed.json")) as f:
        expected = json.load(f)[name]
    assert numbers(read_log(tmp_path)) == expected


def numbers(records):
    """The losses, gradient norms and val losses of records, by step, as resumed.json holds de4c38f's."""
    keys = ("train_loss", "grad_norm", "val_loss")
    return [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in records if any(k in r for k in keys)]
