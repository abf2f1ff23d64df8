"""Activation recompute and the memory plan: recompute changes no gradient bit, and memory.py's
estimate matches what a model saves."""
import itertools
import os

import pytest
import torch

import devices
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
def test_recompute_gives_bit_identical_gradients(mode, every):
    """A block recomputed as another (a closure over a loop variable) would change every gradient below it."""
    torch.manual_seed(0)
    model = GPT(CONFIG).train()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 48))
    expected = gradients(model, idx)
    recomputing = GPT(CONFIG, recompute=mode, recompute_every=every).train()
    recomputing.load_state_dict(model.state_dict())
    assert [block.recompute for block in recomputing.transformer.h] == [mode if i % every == 0 else "none"
                                                                         for i in range(4)]
    got = gradients(recomputing, idx)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def saved_for_backward(model, idx):
    """Bytes of the tensors the forward pass saves for the backward (parameters excluded), each
    storage counted once: what activation memory is."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx.roll(1), chunked_loss=True)
    return sum(saved.values())


@pytest.mark.parametrize("mode", RECOMPUTE)
@pytest.mark.parametrize("every", [1, 2])
def test_the_activation_estimate_matches_what_the_model_saves(mode, every):
    model = GPT(CONFIG, recompute=mode, recompute_every=every).train()
    B, T = 2, 64
    measured = saved_for_backward(model, torch.randint(0, CONFIG.vocab_size, (B, T)))
    estimate = memory.activation_bytes(CONFIG, B, T, mode, every, a=4) + memory.head_gradient_bytes(CONFIG)
    assert estimate == pytest.approx(measured, rel=0.02)  # exact but for a few scalars and int64 ids


def test_the_activation_estimate_is_the_sum_over_its_blocks():
    """The closed form against the plain sum, block by block: block i recomputes when i % every == 0."""
    def summed(config, batch, seq_len, mode, every, a):
        blocks = sum(memory.block_activation_bytes(config, mode if i % every == 0 else "none", a)
                     for i in range(config.n_layer))
        return batch * seq_len * (blocks + 8 + 8 + 4 * config.n_embd + 8 + 4 * config.n_embd)
    for n_layer in range(1, 10):
        config = GPTConfig(n_layer=n_layer, n_head=4, n_embd=64)
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
    float32 = memory.plan(config, 8, 128, dtype_bytes=4)
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
    (["--total_batch_size", 10**400 + 1], f"error: -B auto: --total_batch_size {10**400 + 1} is not a multiple of T*"),
    (["--total_batch_size", 10**400 + 1, "-B", 4], f"error: --total_batch_size {10**400 + 1} is not a multiple of B*T*")])
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
    assert chunked.logits - memory.head_gradient_bytes(config) < ddp.logits / 2  # a chunk of 4096 positions, not 8x1024
    compiled = memory.plan(config, 8, 1024, ScaleConfig(), compiled=True)
    assert compiled.logits == ddp.logits / 6 and compiled.activations == ddp.activations  # no float32 copy compiled


def test_the_docs_table_is_what_memory_py_prints():
    with open(os.path.join(REPO, "docs", "scaling.md")) as f:
        assert memory.presets_table() in f.read()
