"""torch.compile with inductor, the compiler a GPU run uses, on the CPU: the training step's model
compiles whole, recompiles only where expected, and computes the eager step's losses."""
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import train_gpt2
from gpt2repro.lm.data import ShardLoader, list_shards
from gpt2repro.training.step import StepConfig, build_trainable, train_step
from helpers.files import write_token_shards
from model import GPT, GPTConfig


@pytest.mark.slow
def test_the_step_compiles_whole_with_inductor_and_equals_eager(tmp_path, monkeypatch):
    write_token_shards(tmp_path)
    config = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32)
    counter = CompileCounterWithBackend("inductor")
    # fullgraph=True: a graph break anywhere in the model's forward raises instead of splitting it.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter, fullgraph=True))
    torch._dynamo.reset()
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        step = StepConfig(torch.float32, tokens_per_step=2 * 4 * 32, compile_mode="default" if compiled else None)
        t = build_trainable(GPT(config), "cpu", step)
        train = ShardLoader(list_shards(str(tmp_path), "train"), 4, 32, shuffle=False)
        val = ShardLoader(list_shards(str(tmp_path), "val"), 4, 32, shuffle=False)
        losses[compiled] = [train_step(t, train, 1e-3).loss,
                            train_gpt2.estimate_val_loss(t, val, 2),
                            train_step(t, train, 1e-3).loss,
                            train_step(t, train, 1e-3).loss]
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    # One graph for training and one for evaluation (no grad, eval mode); back to training reuses the first.
    assert counter.frame_count == 2


@pytest.mark.slow
def test_a_compiled_model_with_dropout_trains_and_evaluates_as_eager(tmp_path, monkeypatch):
    """Compiled (aot_eager: torch's autograd tracing without inductor's C++ builds), a model with
    dropout 0.1 draws masks in training, not in evaluation, where it equals the eager model, and learns."""
    write_token_shards(tmp_path)
    config = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    torch.manual_seed(0)
    t = build_trainable(GPT(config), "cpu", StepConfig(torch.float32, 4 * 32, compile_mode="default"))
    x, y = ShardLoader(list_shards(str(tmp_path), "val"), 4, 32, shuffle=False).next_batch()
    assert not torch.equal(t.step_model(x, y)[1], t.step_model(x, y)[1])  # two masks
    t.step_model.eval()
    with torch.no_grad():
        assert torch.equal(t.step_model(x, y)[1], t.raw_model(x, y)[1])
    t.step_model.train()
    train = ShardLoader(list_shards(str(tmp_path), "train"), 4, 32, shuffle=False)
    losses = [train_step(t, train, 3e-3).loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
