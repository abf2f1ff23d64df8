"""Activation recompute and the memory plan: recompute changes no gradient bit, and memory.py's
estimate matches what a model saves."""
import itertools
import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import train_gpt2
from gpt2repro.common import devices
from gpt2repro.common.cli import preset_names
from gpt2repro.lm import loss
from gpt2repro.lm.tokenizer import N_VOCAB
from gpt2repro.runs.checkpoint import recorded_flags
from gpt2repro.runs.checkpoint_files import load_checkpoint
from gpt2repro.training import memory
from gpt2repro.training.train_config import ScaleConfig
from helpers import REPO
from helpers.kernels import interpreted
from helpers.processes import exit_message, run_script
from helpers.runs import TINY, error_of, train
from model import GPT, RECOMPUTE, GPTConfig, n_params

CONFIG = GPTConfig(block_size=64, vocab_size=300, n_layer=4, n_head=4, n_embd=64)


# How the default run computes on a GPU: bfloat16, compiled, and --loss auto's loss there (with Triton);
# and on a CPU: float32, eager, and --loss auto's loss there.
ON_A_GPU = memory.Compute(2, True, loss.pick_loss("auto", "cuda", triton=True))
ON_A_CPU = memory.Compute(4, False, loss.pick_loss("auto", "cpu"))


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
    measured = saved_for_backward(model, torch.randint(0, config.vocab_size, (B, T)), loss_kind="chunked")
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
    result = run_script("train_gpt2.py", "--plan", "-B", 8, "--n_layer", 10**12, "--recompute", "full",
                        "--recompute_every", 3, timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{n_params(GPTConfig(n_layer=10**12, vocab_size=50304)):,} parameters")


def test_parameter_count_of_every_preset():
    assert n_params(CONFIG) == sum(p.numel() for p in GPT(CONFIG).parameters())
    for name in preset_names():
        config, _ = memory.preset_model(name)
        with torch.device("meta"):
            model = GPT(config)
        assert n_params(config) == sum(p.numel() for p in model.parameters()), name


def test_memory_reads_each_preset_as_the_trainer_does():
    for name in preset_names():
        cfg = train_gpt2.parse_args(["--preset", name])
        assert memory.preset_model(name) == (cfg.model, loss.pick_loss(cfg.runtime.loss_kind, "cuda", True)), name


def test_plan_prints_the_estimate_and_touches_nothing(tmp_path, capsys):
    log_dir, data_dir = tmp_path / "log", tmp_path / "no_data"
    train_gpt2.main(["--preset", "gpt2-xl", "--plan", "--plan_world_size", "8", "--fsdp", "1", "--recompute", "full",
                     "--log_dir", str(log_dir), "--data_dir", str(data_dir), "--device", "cuda", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    config, _ = memory.preset_model("gpt2-xl")
    expected = memory.plan(config, 8, 1024, ScaleConfig(fsdp=True, recompute="full"), world_size=8,
                           compute=memory.Compute(loss_kind="fused"))
    assert "8 x cuda under FSDP" in out and "bfloat16 autocast" in out
    assert f"{expected.total / memory.GiB:8.2f} GiB" in out.splitlines()[-1]
    assert not log_dir.exists() and not data_dir.exists()


def test_plan_is_of_the_device_and_dtype_the_run_would_take(capsys):
    config, _ = memory.preset_model("demo")
    float32 = memory.plan(config, 8, 128, compute=ON_A_CPU)  # -B auto's pick on a CPU: 8 sequences of the 1,024-token step
    runs = [["--device", "cpu"]] + ([[]] if devices.auto_device_type() == "cpu" else [])  # --device auto on a CPU
    for flags in runs:
        train_gpt2.main(["--preset", "demo", "--plan", *flags])
        out = capsys.readouterr().out
        assert "; 1 x cpu under DDP" in out and "float32, no autocast" in out and "per device:" in out, out
        assert f"{float32.total / memory.GiB:8.2f} GiB" in out.splitlines()[-2]  # the total, above -B auto's line
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
    parameters = n_params(GPTConfig(n_layer=10**12, vocab_size=50304))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: a GPT of {parameters:,} parameters needs")
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
    chunked = memory.plan(config, 8, 1024, compute=memory.Compute(loss_kind="chunked"))
    assert fsdp.optimizer == ddp.optimizer // 8 and fsdp.activations == ddp.activations
    assert recomputed.activations < ddp.activations / 5 and recomputed.weights == ddp.weights
    assert chunked.logits - memory.head_gradient_bytes(config) < ddp.logits / 2  # a chunk of 8192 positions in bf16 and float32: 6 bytes, not 12
    compiled = memory.plan(config, 8, 1024, compute=memory.Compute(compiled=True))
    assert compiled.logits == ddp.logits / 2 and compiled.activations == ddp.activations  # 6 bytes an entry compiled, 12 eager


def test_the_fused_loss_plans_one_chunk_of_logits_in_the_autocast_dtype_alone():
    """Its gradient is written over the logits: a bytes a position and column, against the eager
    masked loss's 12 (three float32 tensors at the backward's peak), for one chunk however many
    positions; the chunked loss adds the float32 copy of the chunk's real columns, in 16 bits only."""
    config, head = GPTConfig(vocab_size=50304), memory.head_gradient_bytes(GPTConfig(vocab_size=50304))
    batch = loss.CHUNK // 1024  # one chunk's positions
    fused = memory.logits_bytes(config, batch, 1024, "fused")
    assert fused - head == memory.logits_bytes(config, batch, 1024, "masked") * 2 // 12
    assert memory.logits_bytes(config, 4 * batch, 1024, "fused") == fused
    assert memory.logits_bytes(config, batch, 1024, "chunked") == fused + loss.CHUNK * N_VOCAB * 4
    assert memory.logits_bytes(config, batch, 1024, "chunked", a=4) == memory.logits_bytes(config, batch, 1024, "fused", a=4)


@pytest.mark.parametrize("loss_kind", ["chunked", pytest.param("fused", marks=interpreted)])
def test_the_loss_op_keeps_what_the_memory_plan_counts(loss_kind):
    """For the backward, the head's input gradient in the place of its input, and the head's
    float32 weight gradient (memory.head_gradient_bytes)."""
    model = GPT(CONFIG).train()
    B, T = 2, 24
    measured = saved_for_backward(model, torch.randint(0, CONFIG.vocab_size, (B, T)), loss_kind=loss_kind)
    estimate = memory.activation_bytes(CONFIG, B, T, a=4) + memory.head_gradient_bytes(CONFIG)
    assert estimate == pytest.approx(measured, rel=0.02)  # exact but for a few scalars and int64 ids


def test_the_docs_table_is_what_memory_py_prints(capsys):
    memory.main([])
    printed = capsys.readouterr().out
    with open(os.path.join(REPO, "docs", "scaling.md")) as f:
        assert printed == memory.presets_table() + "\n" and printed in f.read()


def test_memory_py_refuses_arguments_in_one_line(capsys):
    """It takes none: a flag such as --n_layer 48 would otherwise be ignored, the table printed as if it were read."""
    assert exit_message(capsys, memory.main, "--n_layer", "48") == \
        "gpt2repro.training.memory: error: unrecognized arguments: --n_layer 48 (see --help)"


def planned(capsys, *flags):
    """(the micro-batch -B auto picks, the plan's total in GiB) that --plan prints for flags."""
    train_gpt2.main(["--plan", "-B", "auto", *map(str, flags)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("-B auto: ")
    return int(lines[-1].split()[2]), float(lines[-2].split()[1])


def test_plan_picks_the_micro_batch_that_fits_a_gpu_this_machine_lacks(capsys):
    micro_batch, total = planned(capsys, "--gpu_memory", 24)
    assert micro_batch in (16, 32) and total <= 24
    assert planned(capsys, "--gpu_memory", 80)[0] == 64
    # The same choice as the trainer's (pick_micro_batch), at the largest power of two that fits.
    cfg = train_gpt2.parse_args(["--gpu_memory", "24", "--plan"])
    assert memory.pick_micro_batch(cfg, 1, 24 * memory.GiB, ON_A_GPU) == micro_batch
    assert not memory.fits(memory.run_plan(cfg, 2 * micro_batch, 1, ON_A_GPU), 24 * memory.GiB)


def test_a_model_that_fits_no_micro_batch_is_one_line_naming_fsdp(capsys):
    message = exit_message(capsys, train_gpt2.main, "--plan", "--preset", "gpt2-xl", "-B", "auto", "--gpu_memory", 24)
    assert message.startswith("error: -B auto: a GPT of 1,557,686,400 parameters plans ")
    assert "--fsdp 1 --recompute full over 2 GPUs" in message and "torchrun --nproc_per_node=2" in message


@pytest.mark.parametrize("value, expected", [("0", "must be positive, not 0.0"), ("-3", "must be positive, not -3.0"),
                                             ("nan", "must be a finite number, not nan"),
                                             ("inf", "must be a finite number, not inf")])
def test_a_bad_gpu_memory_is_one_usage_error(capsys, value, expected):
    with pytest.raises(SystemExit) as e:
        train_gpt2.main(["--plan", "--gpu_memory", value])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out and len(err.splitlines()) == 1
    assert err.endswith(f": error: --gpu_memory {expected} (see --help)\n")


def test_auto_where_no_micro_batch_divides_the_step_is_one_line(capsys):
    message = exit_message(capsys, train_gpt2.main, "--plan", "--total_batch_size", 1000, "-T", 128,
                           "--plan_world_size", 2)
    assert message == ("error: -B auto: --total_batch_size 1000 is not a multiple of T*world_size = 128*2 = 256, so no "
                       "micro-batch divides it; try --total_batch_size 1024")


def test_auto_on_a_cpu_fits_the_hosts_available_memory_or_says_it_cannot_read_it(monkeypatch):
    """The same choice as on a GPU, against HOST_HEADROOM of the host's available memory (the
    model's weights, built already, counted in), shared by the processes torchrun started on it."""
    cfg = train_gpt2.parse_args(["--total_batch_size", str(3 * 8 * 1024)])
    weights = 4 * n_params(cfg.model)
    logged = []
    for available, processes in ((64 * memory.GiB, 1), (9 * memory.GiB, 1), (18 * memory.GiB, 2), (None, 1)):
        monkeypatch.setattr(memory, "available_memory", lambda: available)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        picked = memory.resolve_micro_batch(cfg, ON_A_CPU, cfg.model, "cpu", 1, logged.append)
        if available is not None:
            budget = available // processes + weights
            estimate = memory.run_plan(cfg, picked, 1, ON_A_CPU)
            assert memory.fits(estimate, budget, "cpu")
            assert picked == 8 or not memory.fits(memory.run_plan(cfg, 2 * picked, 1, ON_A_CPU), budget, "cpu")
            assert logged[-1] == (f"micro-batch auto: {picked} (plan {memory.size(estimate.total)} of "
                                  f"{memory.size(budget)} available)")
    assert [int(line.split()[2]) for line in logged] == [8, 4, 4, 8]  # 8: the step's 24 sequences' largest power of two
    assert logged[-1] == ("micro-batch auto: 8 (the largest up to 64 that divides the step: the host's available "
                          "memory cannot be read)")
    assert memory.resolve_micro_batch(train_gpt2.parse_args(["-B", "5"]), ON_A_CPU, cfg.model, "cpu", 1,
                                      logged.append) == 5


def test_unfit_advice_names_what_would_fit_or_that_nothing_does():
    """Each lever it names fits where the run does not, or lowers a plan that fits by a tenth; on
    a CPU no FSDP (more processes on one host share its memory)."""
    cfg = train_gpt2.parse_args([])
    full = replace(cfg, scale=replace(cfg.scale, recompute="full"))
    now, recomputed = (memory.run_plan(c, 1, 1, ON_A_CPU).total for c in (cfg, full))
    between = (now + recomputed) / 2 / memory.HOST_HEADROOM
    assert memory.unfit_advice(cfg, 1, between, ON_A_CPU, device="cpu").endswith(
        f"over 80% of {memory.size(between)} available: --recompute full plans {memory.size(recomputed)}")
    assert memory.unfit_advice(cfg, 1, recomputed / 2, ON_A_CPU, device="cpu").endswith(
        f"over 80% of {memory.size(recomputed / 2)} available, and so is --recompute full's {memory.size(recomputed)}: "
        f"nothing fits this host")
    # A plan that fits, where --recompute full saves less than a tenth: the weights and AdamW are most of it.
    short = train_gpt2.parse_args(["-T", "8"])
    assert memory.unfit_advice(short, 1, 64 * memory.GiB, ON_A_CPU, device="cpu").endswith(
        "within 80% of 64.0 GiB available, so memory the plan does not count ran out (another process's?): no setting "
        "the plan knows lowers it by a tenth")


def test_auto_on_a_cpu_with_too_little_memory_trains_at_what_fits_or_stops_in_one_line(shards, tmp_path, capsys,
                                                                                         monkeypatch):
    """The trainer on a CPU, a tiny model standing in for GPT-2 and a faked available memory: at a
    step of 64 sequences -B auto takes 16, the largest whose plan fits; with less memory than one
    sequence plans, it stops in one line before training, leaving no log_dir."""
    cfg = train_gpt2.parse_args([*TINY, "--total_batch_size", "2048"])
    weights = 4 * n_params(cfg.model)
    sixteen, thirty_two = (memory.run_plan(cfg, batch, 1, ON_A_CPU).total for batch in (16, 32))
    monkeypatch.setattr(memory, "available_memory", lambda: (sixteen + thirty_two) / 2 / memory.HOST_HEADROOM - weights)
    train(shards, tmp_path / "fits", "--total_batch_size", "2048", "--max_steps", "1")
    assert "micro-batch auto: 16 (plan " in capsys.readouterr().out
    saved = load_checkpoint(str(tmp_path / "fits" / "ckpt_000001.pt")).state
    assert saved["train_loader"]["tokens_per_index"] == 16 * 32  # the loader records the micro-batch it took
    assert recorded_flags(saved)["micro_batch_size"] == "auto"  # the flags, what was asked
    monkeypatch.setattr(memory, "available_memory", lambda: weights)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "none", "--total_batch_size", "2048")
    assert message.startswith(f"error: -B auto: a GPT of {n_params(cfg.model):,} parameters plans ")
    assert message.endswith(": nothing fits this host") and not (tmp_path / "none").exists()


def test_a_config_file_takes_auto_or_a_number_for_the_micro_batch(tmp_path, capsys):
    config = tmp_path / "run.toml"
    for value, expected in (('"auto"', "auto"), ("16", 16)):
        config.write_text(f"micro_batch_size = {value}\n")
        assert train_gpt2.parse_args(["--config", str(config)]).batch.micro_batch_size == expected
    config.write_text('micro_batch_size = "most"\n')
    assert exit_message(capsys, train_gpt2.parse_args, "--config", config).endswith(
        "micro_batch_size must be what --micro_batch_size takes: 'most' is neither a number of sequences nor auto "
        "(see --help)")


def test_auto_on_a_gpu_fits_its_free_memory_or_says_it_cannot_read_it(monkeypatch):
    cfg, logged = train_gpt2.parse_args([]), []
    for free in (24 * memory.GiB, None):
        monkeypatch.setattr(memory, "free_memory", lambda device, model=None: free)
        picked = memory.resolve_micro_batch(cfg, ON_A_GPU, cfg.model, "cuda:0", 1, logged.append)
        assert picked == (32 if free else 64)
    expected = memory.run_plan(cfg, 32, 1, ON_A_GPU).total / memory.GiB
    assert logged == [f"micro-batch auto: 32 (plan {expected:.1f} GiB of 24.0 GiB free)",
                      "micro-batch auto: 64 (the largest up to 64 that divides the step: the GPU's free memory cannot "
                      "be read)"]


@pytest.mark.parametrize("lever, loss, tolerance", [(None, "masked", 0.10), ("+fused_loss", "fused", 0.05)])
def test_the_plan_is_within_its_tolerance_of_the_peaks_measured_on_a_gpu(lever, loss, tolerance):
    """GPT-2 (124M), B=64, T=1024, bf16, compiled, on one H200: the peaks that bench.py measured
    (bench/results/h200-2026-11-27/levers.json), the masked loss's the one the plan is fitted to."""
    with open(os.path.join(REPO, "bench", "results", "h200-2026-11-27", "levers.json")) as f:
        [measured] = [r["peak_mem_bytes"] for r in json.load(f)["results"] if r.get("lever") == lever]
    estimate = memory.plan(GPTConfig(vocab_size=50304), 64, 1024, compute=memory.Compute(2, True, loss))
    assert estimate.total == pytest.approx(measured, rel=tolerance)
