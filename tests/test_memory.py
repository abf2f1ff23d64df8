"""Activation recompute and the memory plan: recompute changes no gradient bit, and memory.py's
estimate matches what a model saves."""
import itertools
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import devices
import fused_loss
import memory
import train_gpt2
from cli import preset_names
from helpers import REPO, exit_message, run_script
from model import GPT, GPTConfig, RECOMPUTE
from train_config import ScaleConfig

CONFIG = GPTConfig(block_size=64, vocab_size=300, n_layer=4, n_head=4, n_embd=64)


def gradients(model, idx, **forward):
    model.zero_grad()
    model(idx, idx, **forward)[1].backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", RECOMPUTE[1:])
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_gives_bit_identical_gradients(mode, every, dropout):
    """A block recomputed as another (a closure over a loop variable) would change every gradient
    below it; a recomputed forward that drew other dropout masks than the first, too."""
    torch.manual_seed(0)
    config = replace(CONFIG, dropout=dropout)
    model = GPT(config).train()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 48))
    torch.manual_seed(1)
    expected = gradients(model, idx)
    recomputing = GPT(config, recompute=mode, recompute_every=every).train()
    recomputing.load_state_dict(model.state_dict())
    assert [block.recompute for block in recomputing.transformer.h] == [mode if i % every == 0 else "none"
                                                                         for i in range(4)]
    torch.manual_seed(1)
    got = gradients(recomputing, idx)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def saved_for_backward(model, idx, **loss):
    """Bytes of the tensors the forward pass, with the loss of GPT.forward's keywords loss, saves for
    the backward (parameters excluded), each storage counted once: what activation memory is."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx.roll(1), **loss)
    return sum(saved.values())


@pytest.mark.parametrize("mode", RECOMPUTE)
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_activation_estimate_matches_what_the_model_saves(mode, every, dropout, monkeypatch):
    """Dropout as on a GPU: CUDA's dropout kernel keeps a bool mask (the CPU's keeps a float32
    one), and flash attention keeps no mask of the attention probabilities (on the CPU, dropout
    takes SDPA to its math kernel, which keeps several): here SDPA runs without it."""
    config = replace(CONFIG, dropout=dropout)
    if dropout:
        monkeypatch.setattr(F, "dropout", lambda x, p, training, inplace=False: torch.native_dropout(x, p, training)[0])
    model = GPT(config, recompute=mode, recompute_every=every).train()
    for block in model.transformer.h:
        block.attn.dropout = 0.0
    B, T = 2, 64
    measured = saved_for_backward(model, torch.randint(0, config.vocab_size, (B, T)), chunked_loss=True)
    estimate = memory.activation_bytes(config, B, T, mode, every, a=4) + memory.head_gradient_bytes(CONFIG)
    assert estimate == pytest.approx(measured, rel=0.02)  # exact but for a few scalars and int64 ids


def test_the_activation_estimate_is_the_sum_over_its_blocks():
    """The closed form against the plain sum, block by block: block i recomputes when i % every == 0."""
    def summed(config, batch, seq_len, mode, every, a):
        blocks = sum(memory.block_activation_bytes(config, mode if i % every == 0 else "none", a)
                     for i in range(config.n_layer))
        mask = config.n_embd if config.dropout else 0
        return batch * seq_len * (blocks + 8 + 8 + mask + 4 * config.n_embd + 8 + 4 * config.n_embd)
    for n_layer, dropout in itertools.product(range(1, 10), (0.0, 0.1)):
        config = GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, dropout=dropout)
        for every, mode, a in itertools.product(range(1, 12), RECOMPUTE, (2, 4)):
            assert memory.activation_bytes(config, 3, 5, mode, every, a) == summed(config, 3, 5, mode, every, a)


@pytest.mark.slow
def test_plan_of_an_absurd_depth_is_printed_at_once():
    """A subprocess with a short timeout: a plan that counts layer by layer would take hours."""
    result = run_script("train_gpt2.py", "--plan", "--n_layer", 10**12, "--recompute", "full", "--recompute_every", 3,
                        timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{memory.n_params(GPTConfig(n_layer=10**12, vocab_size=50304)):,} parameters")


def test_parameter_count_of_every_preset():
    assert memory.n_params(CONFIG) == sum(p.numel() for p in GPT(CONFIG).parameters())
    for name in preset_names():
        config, _ = memory.preset_model(name)
        with torch.device("meta"):
            model = GPT(config)
        assert memory.n_params(config) == sum(p.numel() for p in model.parameters()), name


def test_memory_reads_each_preset_as_the_trainer_does():
    for name in preset_names():
        cfg = train_gpt2.parse_args(["--preset", name])
        assert memory.preset_model(name) == (cfg.model, bool(cfg.scale.chunked_loss)), name


def test_plan_prints_the_estimate_and_touches_nothing(tmp_path, capsys):
    log_dir, data_dir = tmp_path / "log", tmp_path / "no_data"
    train_gpt2.main(["--preset", "gpt2-xl", "--plan", "--plan_world_size", "8", "--fsdp", "1", "--recompute", "full",
                     "--log_dir", str(log_dir), "--data_dir", str(data_dir), "--device", "cuda", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    config, _ = memory.preset_model("gpt2-xl")
    expected = memory.plan(config, 8, 1024, ScaleConfig(fsdp=True, recompute="full", chunked_loss=True), world_size=8)
    assert "8 x cuda under FSDP" in out and "bfloat16 autocast" in out
    assert f"{expected.total / memory.GiB:8.2f} GiB" in out.splitlines()[-1]
    assert not log_dir.exists() and not data_dir.exists()


def test_plan_is_of_the_device_and_dtype_the_run_would_take(capsys):
    config, _ = memory.preset_model("demo")
    float32 = memory.plan(config, train_gpt2.parse_args(["--preset", "demo"]).batch.micro_batch_size, 128, dtype_bytes=4)
    runs = [["--device", "cpu"]] + ([[]] if devices.auto_device_type() == "cpu" else [])  # --device auto on a CPU
    for flags in runs:
        train_gpt2.main(["--preset", "demo", "--plan", *flags])
        out = capsys.readouterr().out
        assert "; 1 x cpu under DDP" in out and "float32, no autocast" in out and "per device:" in out, out
        assert f"{float32.total / memory.GiB:8.2f} GiB" in out.splitlines()[-1]
    # A GPU this machine may lack: bfloat16, as an Ampere or later takes it.
    train_gpt2.main(["--preset", "demo", "--plan", "--device", "cuda"])
    out = capsys.readouterr().out
    assert "1 x cuda" in out and ("bfloat16 autocast" in out or torch.cuda.is_available()) and "per GPU:" in out


PAST_A_FLOAT = "error: a GPT of these sizes needs more than 1.8e+308 bytes: too many to plan"


@pytest.mark.parametrize("flags, expected", [
    (["--n_embd", 10**400, "--n_head", 1], PAST_A_FLOAT), (["--n_layer", 10**400], PAST_A_FLOAT),
    (["--total_batch_size", 10**400 + 1], f"error: --total_batch_size {10**400 + 1} is not a multiple of B*T*world_size")])
def test_a_plan_past_a_floats_range_is_one_line(capsys, flags, expected):
    """Not an OverflowError from dividing such sizes as floats."""
    assert exit_message(capsys, train_gpt2.main, "--plan", *flags).startswith(expected)
    assert not capsys.readouterr().out


@pytest.mark.slow
def test_the_trainer_refuses_absurd_sizes_at_once_before_allocating(tmp_path, capsys):
    """The trainer's own check (memory.fit_problem) is one line too: past a float's range, and at a
    depth it once summed layer by layer (a subprocess with a short timeout, as it took hours)."""
    dirs = ["--log_dir", tmp_path / "log", "--data_dir", tmp_path / "none"]
    message = exit_message(capsys, train_gpt2.main, "--n_embd", 10**400, "--n_head", 1, *dirs)
    assert message == f"{PAST_A_FLOAT} (see --plan)"
    result = run_script("train_gpt2.py", "--n_layer", 10**12, *dirs, timeout=30)
    n_params = memory.n_params(GPTConfig(n_layer=10**12, vocab_size=50304))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: a GPT of {n_params:,} parameters needs")
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("world_size", [0, -3])
def test_a_plan_for_no_gpus_is_a_usage_error(capsys, world_size):
    with pytest.raises(SystemExit) as e:
        train_gpt2.main(["--plan", "--plan_world_size", str(world_size)])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert not out and len(err.splitlines()) == 1
    assert err.endswith(f": error: --plan_world_size must be positive, not {world_size} (see --help)\n")


def test_sharding_and_recompute_shrink_the_plan():
    config, _ = memory.preset_model("gpt2-xl")
    ddp = memory.plan(config, 8, 1024)
    fsdp = memory.plan(config, 8, 1024, ScaleConfig(fsdp=True), world_size=8)
    recomputed = memory.plan(config, 8, 1024, ScaleConfig(recompute="full"))
    chunked = memory.plan(config, 8, 1024, ScaleConfig(chunked_loss=True))
    assert fsdp.optimizer == ddp.optimizer // 8 and fsdp.activations == ddp.activations
    assert recomputed.activations < ddp.activations / 5 and recomputed.weights == ddp.weights
    assert ddp.logits == 2 * (chunked.logits - memory.head_gradient_bytes(config))  # 8x1024 positions, against a chunk of 4096


def test_the_fused_loss_plans_one_chunk_of_logits_in_the_autocast_dtype_alone():
    """Its gradient is written over the logits: a bytes a position and column, against the masked
    loss's a + 8 (a float32 log-softmax and its gradient beside them), for one chunk however many positions."""
    config, head = GPTConfig(vocab_size=50304), memory.head_gradient_bytes(GPTConfig(vocab_size=50304))
    batch = fused_loss.CHUNK // 1024  # one chunk's positions
    fused = memory.logits_bytes(config, batch, 1024, False, fused_loss=True)
    assert fused - head == memory.logits_bytes(config, batch, 1024, False) * 2 // 10
    assert memory.logits_bytes(config, 4 * batch, 1024, False, fused_loss=True) == fused


def test_the_docs_table_is_what_memory_py_prints(capsys):
    memory.main([])
    printed = capsys.readouterr().out
    with open(os.path.join(REPO, "docs", "scaling.md")) as f:
        assert printed == memory.presets_table() + "\n" and printed in f.read()


def test_memory_py_refuses_arguments_in_one_line(capsys):
    """It takes none: a flag such as --n_layer 48 would otherwise be ignored, the table printed as if it were read."""
    assert exit_message(capsys, memory.main, "--n_layer", "48") == \
        "memory.py: error: unrecognized arguments: --n_layer 48 (see --help)"
