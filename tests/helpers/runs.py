"""The tiny training run that the trainer's tests share, and reading what it logged."""
import json
import os

import pytest

from helpers.processes import run_script


# The tiny training run of train_gpt2.py that the trainer's tests share.
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--vocab_size", "256",
        "-T", "32", "--warmup_steps", "2", "--max_lr", "3e-3", "--hellaswag", "0", "--sample_interval", "0",
        "--compile", "0", "--device", "cpu", "--dtype", "float32", "--eval_interval", "0", "--core_interval", "0"]
TINY_CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256)


def train(data_dir, log_dir, *flags):
    """train_gpt2.main(TINY + flags) in-process; returns the records of its log.jsonl."""
    import train_gpt2

    train_gpt2.main(TINY + ["--data_dir", data_dir, "--log_dir", str(log_dir), *map(str, flags)])
    return read_log(log_dir)


def read_log(log_dir):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(records):
    return [r for r in records if "train_loss" in r]


def assert_each_step_logged_once(log_dir, n_steps):
    assert [r["step"] for r in train_records(read_log(log_dir))] == list(range(n_steps))


def final_weights(log_dir, step):
    from gpt2repro.runs.checkpoint_files import load_checkpoint

    return load_checkpoint(os.path.join(log_dir, f"ckpt_{step:06d}.pt")).state["model"]


def assert_same_run(a, b, rel=1e-5):
    a, b = train_records(a), train_records(b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=rel)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=100 * rel)


def run_cli(*flags):
    """train_gpt2.py TINY flags, as a user runs it."""
    return run_script("train_gpt2.py", *TINY, *flags)


def error_of(capsys, *flags):
    """The one line on stderr with which train_gpt2.main(TINY + flags) exits non-zero, in-process."""
    import train_gpt2

    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(TINY + [str(f) for f in flags])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# A trainer whose every rank says why it stops (only rank 0 prints the error line), for the tests that
# refuse a checkpoint on several ranks.
RANK_STOPS = """
import os, sys
sys.path.insert(0, {repo!r})
import train_gpt2
real_train = train_gpt2.train


def train(cfg):  # each rank says why it stops: only rank 0 prints the error line
    try:
        return real_train(cfg)
    except Exception as e:
        os.write(1, f"rank {{os.environ['RANK']}} stops: {{e}}\\n".encode())  # one write: lines never interleave
        raise
train_gpt2.train = train
train_gpt2.main()
"""


COMPILED_TRAIN = """
import functools, sys
import torch
sys.path.insert(0, {repo!r})
# torch.compile's wrapper (and its _orig_mod. prefix) without inductor's minutes of C++ builds on a CPU.
torch.compile = functools.partial(torch.compile, backend="eager")
import train_gpt2
real_build = train_gpt2.build_trainable


def build_trainable(*args, **kwargs):
    t = real_build(*args, **kwargs)
    print(f"the step runs through {{type(t.step_model).__name__}} of {{type(getattr(t.step_model, '_orig_mod', None)).__name__}}")
    return t
train_gpt2.build_trainable = build_trainable
train_gpt2.main()
"""


def signal_in_evaluation(evaluation, step, patch=setattr):
    """Makes the trainer's evaluation at step ("val loss", "hellaswag" or "samples") send this
    process SIGTERM while its first batch runs, by patching (with patch: setattr, or pytest's
    monkeypatch.setattr) the function that runs one of its batches, and the Checkpointer's due, which
    the loop asks first at each step. Returns the list of that evaluation's batches run from the
    signal on, filled as they run: a stop heard at once leaves one."""
    import signal

    import hellaswag
    from gpt2repro.lm import generate
    from gpt2repro.runs.checkpoint import Checkpointer
    from model import GPT

    owner, name = {"val loss": (GPT, "forward"), "hellaswag": (hellaswag, "ending_losses"),
                   "samples": (generate, "next_logits")}[evaluation]
    run_batch, due = getattr(owner, name), Checkpointer.due
    at, batches = {}, []

    def due_at(checkpointer, loop_step, *args):
        at["step"] = loop_step
        return due(checkpointer, loop_step, *args)

    def batch(*args, **kwargs):
        if at.get("step") == step:
            if not batches:
                os.kill(os.getpid(), signal.SIGTERM)
            batches.append(evaluation)
        return run_batch(*args, **kwargs)
    patch(Checkpointer, "due", due_at)
    patch(owner, name, batch)
    return batches
