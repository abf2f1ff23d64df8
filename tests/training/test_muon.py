"""--optimizer muon: torch.optim.Muon on the blocks' matrices, the recipe's AdamW on the rest; the
step equals torch's optimizers applied by hand, the default AdamW path is unchanged, and every
promise of the trainer (accumulation, the non-finite skip, fp16 loss scaling, DDP, exact resume,
the step log, --plan) holds with it."""

import glob
import os
import shutil

import pytest
import torch

import checkpoint as converter
import train_gpt2
from gpt2repro.lm.data import ShardLoader, list_shards
from gpt2repro.runs import checkpoint, checkpoint_files
from gpt2repro.runs.checkpoint_files import OneFileCheckpoint
from gpt2repro.training import memory, optimizers
from gpt2repro.training.faults import Faults
from gpt2repro.training.step import StepConfig, build_trainable, train_step
from helpers.files import listdir
from helpers.limits import file_size_limit
from helpers.models import FixedBatches, as_checkpoint, parts_of
from helpers.processes import run_ranks
from helpers.runs import TINY, TINY_CONFIG, assert_same_run, error_of, final_weights, read_log, train, train_records
from model import GPT, GPTConfig

STEPS = ["--total_batch_size", "256", "-B", "8"]
MUON = ["--optimizer", "muon", "--muon_lr", "0.02"]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY_CONFIG))


def batch(seed=0):
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def block_matrices(model):
    return [m.weight for b in model.transformer.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]


def trainable(model, optimizer="adamw", scaler=None, grad_clip=0.0, **kw):
    """build_trainable's Trainable of model (float32, CPU, one micro-step, peak lr 3e-3), with scaler
    in place of its GradScaler when given."""
    config = optimizers.OptimizerConfig(optimizer, 3e-3, 0.1, grad_clip=grad_clip, **kw)
    step = StepConfig(torch.float32, 4 * 32, config)  # batch()'s
    t = build_trainable(model, "cpu", step)
    if scaler is not None:
        t.scaler = scaler
    return t


def test_every_parameter_belongs_to_exactly_one_optimizer():
    model = tiny_model()
    optimizer = trainable(model, "muon", muon_lr=0.02, muon_momentum=0.9, muon_weight_decay=0.05).optimizer
    assert isinstance(optimizer, optimizers.MuonAdamW) and isinstance(optimizer.adamw, torch.optim.AdamW)
    muon_ids = [id(p) for g in optimizer.muon.param_groups for p in g["params"]]
    adamw_ids = [id(p) for g in optimizer.adamw.param_groups for p in g["params"]]
    # Muon: exactly the four matrices of each block, as nn.Linear holds them, (out, in); c_attn's
    # in a group of their own, orthogonalized as three row blocks.
    assert sorted(muon_ids) == sorted(id(p) for p in block_matrices(model)) and len(muon_ids) == 4 * 2
    qkv, others = optimizer.muon.param_groups
    assert [id(p) for p in qkv["params"]] == [id(b.attn.c_attn.weight) for b in model.transformer.h]
    assert qkv["row_blocks"] == 3 and "row_blocks" not in others
    assert [tuple(p.shape) for p in block_matrices(model)[:4]] == [(96, 32), (32, 32), (128, 32), (32, 128)]
    assert len(set(muon_ids + adamw_ids)) == len(muon_ids) + len(adamw_ids) == len(list(model.parameters()))
    # AdamW: configure_optimizers' split and hyperparameters, less the matrices: the tied embedding
    # and head and the position embedding decay; biases and LayerNorms do not.
    decay, no_decay = optimizer.adamw.param_groups
    assert [id(p) for p in decay["params"]] == [id(model.transformer.wte.weight), id(model.transformer.wpe.weight)]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])
    reference = model.configure_optimizers(0.1, 3e-3, "cpu").param_groups[0]
    for key in ("lr", "betas", "eps", "fused", "foreach", "amsgrad"):
        assert decay[key] == reference[key], key
    for group in (qkv, others):
        assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]) == (0.02, 0.9, 0.05, True)
        assert group["lr_scale"] == 0.02 / 3e-3
    assert optimizer.param_groups == optimizer.adamw.param_groups + optimizer.muon.param_groups


def test_a_muon_step_equals_torchs_muon_and_adamw_applied_by_hand():
    """Three steps of train_step (float32, CPU, no clipping) against torch.optim.Muon on the
    blocks' matrices, with each c_attn's q, k and v as three matrices of their own, and
    torch.optim.AdamW on the rest, stepped by hand: the same weights, bit for bit."""
    model, reference = tiny_model(), tiny_model()
    t = trainable(model, "muon", muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.1)
    matrices = block_matrices(reference)
    qkv = [b.attn.c_attn.weight for b in reference.transformer.h]
    q_k_v = [[torch.nn.Parameter(third.clone()) for third in w.detach().chunk(3)] for w in qkv]
    others = [p for p in reference.parameters() if all(p is not m for m in matrices)]
    by_hand_muon = torch.optim.Muon([p for parts in q_k_v for p in parts] + [m for m in matrices if m.shape[0] != 96],
                                    lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    by_hand_adamw = torch.optim.AdamW([{"params": [p for p in others if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=False)
    x, y = batch()
    for lr in (1e-3, 3e-3, 2e-3):
        result = train_step(t, FixedBatches([(x, y)]), lr)
        reference.zero_grad()
        loss = reference(x, y)[1]
        loss.backward()
        for w, parts in zip(qkv, q_k_v):
            for part, grad in zip(parts, w.grad.chunk(3)):
                part.grad = grad.clone()
        for group in by_hand_adamw.param_groups:
            group["lr"] = lr
        by_hand_muon.param_groups[0]["lr"] = lr * (0.02 / 3e-3)
        by_hand_adamw.step()
        by_hand_muon.step()
        with torch.no_grad():
            for w, parts in zip(qkv, q_k_v):
                w.copy_(torch.cat(parts))
        assert result.loss == loss.item() and optimizers.current_muon_lr(t.optimizer) == lr * (0.02 / 3e-3)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(t.optimizer.muon.state[model.transformer.h[0].attn.c_attn.weight]["momentum_buffer"],
                       torch.cat([by_hand_muon.state[part]["momentum_buffer"] for part in q_k_v[0]]))


def test_the_default_adamw_path_is_plain_adamw_unchanged():
    """--optimizer adamw (the default): configure_optimizers' AdamW itself, every group at the
    scheduled lr, the same weights as AdamW stepped by hand, bit for bit."""
    model, reference = tiny_model(), tiny_model()
    t = trainable(model)
    assert type(t.optimizer) is torch.optim.AdamW and train_gpt2.parse_args([]).optimizer.name == "adamw"
    by_hand = reference.configure_optimizers(0.1, 3e-3, "cpu")
    assert all("lr_scale" not in g for g in t.optimizer.param_groups)
    x, y = batch()
    for lr in (1e-3, 3e-3, 2e-3):
        train_step(t, FixedBatches([(x, y)]), lr)
        by_hand.zero_grad()
        reference(x, y)[1].backward()
        for group in by_hand.param_groups:
            group["lr"] = lr
        by_hand.step()
        assert optimizers.current_muon_lr(t.optimizer) is None and [g["lr"] for g in t.optimizer.param_groups] == [lr, lr]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_a_non_finite_step_leaves_both_optimizers_untouched_also_under_fp16_loss_scaling():
    x, y = batch()
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = tiny_model()
        before = [p.detach().clone() for p in model.parameters()]
        t = trainable(model, "muon", scaler=scaler)
        Faults([("nan", 0, None)], 0, model, range(1)).before_step(0)  # --fault nan@0: the loss made NaN
        assert train_step(t, FixedBatches([(x, y)]), 3e-3).skipped  # the trainer's own skip
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert not t.optimizer.muon.state and not t.optimizer.adamw.state
    # Under fp16 loss scaling an overflow in a gradient is the scaler's to skip: one in a matrix
    # only Muon steps shows that GradScaler.unscale_ looked at Muon's gradients too.
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    t = trainable(model, "muon", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda grad: grad * float("inf"))
    result = train_step(t, FixedBatches([(x, y)]), 3e-3)
    assert not result.skipped and not torch.isfinite(torch.tensor(result.grad_norm))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not t.optimizer.muon.state and not t.optimizer.adamw.state and t.scaler.get_scale() == 512.0


def test_fp16_loss_scaling_unscales_both_optimizers_gradients():
    """GradScaler.unscale_ and step through MuonAdamW: the step equals the unscaled one (a scale
    of 2**10 and its inverse are exact in float32) and the norm is the true gradients'."""
    x, y = batch()
    results, weights = [], []
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = tiny_model()
        t = trainable(model, "muon", scaler=scaler, grad_clip=1.0)
        results.append([train_step(t, FixedBatches([(x, y)]), 3e-3) for _ in range(2)])
        weights.append([p.detach().clone() for p in model.parameters()])
    assert [r.grad_norm for r in results[1]] == pytest.approx([r.grad_norm for r in results[0]], rel=1e-5)
    assert not any(r.skipped for r in results[1])
    for a, b in zip(*weights):
        assert torch.allclose(a, b, atol=1e-6)


def test_resume_of_muon_is_exact_and_its_momentum_is_in_the_checkpoint(shards, tmp_path):
    full = train(shards, tmp_path / "full", *STEPS, *MUON, "--max_steps", "8", "--checkpoint_interval", "4")
    resumed = train(shards, tmp_path / "resumed", *STEPS, *MUON, "--max_steps", "8",
                    "--resume", tmp_path / "full" / "ckpt_000004.pt")
    tail = [r for r in train_records(full) if r["step"] >= 4]
    assert [r["train_loss"] for r in train_records(resumed)] == [r["train_loss"] for r in tail]
    for key, tensor in final_weights(tmp_path / "full", 8).items():
        assert torch.equal(tensor, final_weights(tmp_path / "resumed", 8)[key]), key
    saved = checkpoint_files.load_checkpoint(tmp_path / "full" / "ckpt_000004.pt").state
    assert set(saved["optimizer"]) == {"adamw", "muon"} and checkpoint.recorded_flags(saved)["optimizer"] == "muon"
    buffers = [s["momentum_buffer"] for s in saved["optimizer"]["muon"]["state"].values()]
    assert len(buffers) == 8 and all(b.abs().sum() > 0 for b in buffers)


def test_gradient_accumulation_with_muon_equals_one_big_batch(shards, tmp_path):
    one = train(shards, tmp_path / "one", "--total_batch_size", "256", "-B", "8", "--max_steps", "4", *MUON)
    four = train(shards, tmp_path / "four", "--total_batch_size", "256", "-B", "2", "--max_steps", "4", *MUON)
    assert [r["train_loss"] for r in train_records(four)] == pytest.approx(
        [r["train_loss"] for r in train_records(one)], rel=2e-5)
    assert_close_under_muon(final_weights(tmp_path / "one", 4), final_weights(tmp_path / "four", 4))


def assert_close_under_muon(a, b):
    """Weights after a few Muon steps from gradients summed in another order (micro-steps, ranks).
    torch's Newton-Schulz iteration runs in bfloat16: a float32 difference in the last bits of a
    gradient can round an entry of the momentum apart, and five iterations spread it over the
    update, so the matrices agree to about a tenth of one step's update (lr 0.02 times entries of
    about 1/sqrt(32)), not to float32's rounding; the AdamW parameters stay close."""
    for key, tensor in a.items():
        assert torch.allclose(tensor, b[key], atol=3e-3 if tensor.dim() == 2 and "transformer.h." in key else 3e-4), key


def test_the_step_log_and_schedule_carry_muons_lr(shards, tmp_path, monkeypatch):
    stepped = []
    real_step = optimizers.BlockMuon.step

    def recording_step(self, *args, **kwargs):
        stepped.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(optimizers.BlockMuon, "step", recording_step)
    flags = [*STEPS, *MUON, "--max_steps", "4"]
    records = train_records(train(shards, tmp_path, *flags))
    schedule = train_gpt2.parse_args(TINY + flags).schedule
    expected = [schedule.lr(step, 3e-3) for step in range(4)]
    assert [r["lr"] for r in records] == expected
    assert [r["lr_muon"] for r in records] == stepped == [lr * (0.02 / 3e-3) for lr in expected]
    assert max(stepped) == pytest.approx(0.02)


@pytest.mark.slow
def test_ddp_with_muon_on_two_processes_equals_one_process(shards, tmp_path):
    single = train(shards, tmp_path / "single", "--total_batch_size", "256", "-B", "4", "--max_steps", "4", *MUON)
    result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path / "ddp",
                       "--total_batch_size", "256", "-B", "2", "--max_steps", "4", *MUON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in result.stdout and "optimizer: Muon" in result.stdout
    ddp = read_log(tmp_path / "ddp")
    assert [r["train_loss"] for r in train_records(ddp)] == pytest.approx(
        [r["train_loss"] for r in train_records(single)], rel=1e-5)
    assert_close_under_muon(final_weights(tmp_path / "single", 4), final_weights(tmp_path / "ddp", 4))


def test_resume_into_the_other_optimizer_is_refused_in_one_line(shards, tmp_path, capsys):
    train(shards, tmp_path / "adamw", *STEPS, "--max_steps", "2")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "adamw", *STEPS, "--max_steps", "4",
                       *MUON)
    assert "is a run of --optimizer adamw, this one is of --optimizer muon" in message
    train(shards, tmp_path / "muon", *STEPS, "--max_steps", "2", *MUON)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "muon", *STEPS, "--max_steps", "4")
    assert "is a run of --optimizer muon, this one is of --optimizer adamw" in message


@pytest.mark.parametrize("tamper, problem", [
    (lambda muon, adamw: muon[0].update(momentum_buffer=torch.zeros(5)),
     "its optimizer cannot be restored (the state of transformer.h.0.attn.c_attn.weight: momentum_buffer has "
     "shape (5,), not its parameter's (96, 32))"),
    (lambda muon, adamw: muon[7].update(momentum_buffer="a string"),
     "its optimizer cannot be restored (the state of transformer.h.1.mlp.c_proj.weight: momentum_buffer is a str, "
     "not a tensor)"),
    (lambda muon, adamw: adamw[0]["exp_avg_sq"].fill_(float("inf")),
     "its optimizer cannot be restored (the state of transformer.wte.weight: exp_avg_sq holds NaN or infinite "
     "values)"),
    (lambda muon, adamw: adamw[0].update(step=torch.zeros(2)), "step has shape (2,), not one number)"),
    (lambda muon, adamw: muon[0].update(step=torch.tensor(3.5)),
     "its optimizer cannot be restored (the state of transformer.h.0.attn.c_attn.weight: it holds 'step', which "
     "Muon keeps none of)"),
    (lambda muon, adamw: muon[2]["momentum_buffer"].index_fill_(0, torch.tensor([3]), 1e30),
     "its optimizer cannot be restored (the state of transformer.h.0.attn.c_proj.weight: momentum_buffer holds 1e+30, "
     "past what a running mean of gradients clipped at --grad_clip 1.0 reaches: 1)"),
])
def test_a_tampered_optimizer_state_is_one_line_before_any_step(shards, tmp_path, capsys, tamper, problem):
    """Muon's and AdamW's state, each tensor checked against its parameter at load: torch loads it as
    it is, to fail at the first step with a traceback, train on from infinities, or from what no
    step of the run could have left there (a Muon step count, which Muon keeps none of; a momentum
    of 1e30, where the run clipped every gradient to a norm of 1)."""
    train(shards, tmp_path / "run", *STEPS, *MUON, "--max_steps", "2")
    state = checkpoint_files.load_checkpoint(tmp_path / "run" / "ckpt_000002.pt").state
    tamper(state["optimizer"]["muon"]["state"], state["optimizer"]["adamw"]["state"])
    torch.save(state, tmp_path / "tampered.pt")
    assert_refused(shards, tmp_path, capsys, tmp_path / "tampered.pt", problem)


def test_a_negative_step_count_is_one_line_and_tampered_group_settings_give_way_to_the_runs(shards, tmp_path, capsys):
    """A negative step count makes AdamW's bias correction negative: refused before any step. A
    Muon momentum of 2.0 or a beta of 1.0 in the saved groups, which torch refuses only when an
    optimizer is built, never steps: the groups' settings are the resumed run's own flags'."""
    train(shards, tmp_path / "run", *STEPS, *MUON, "--max_steps", "2")
    state = checkpoint_files.load_checkpoint(tmp_path / "run" / "ckpt_000002.pt").state
    state["optimizer"]["adamw"]["state"][0].update(step=torch.tensor(-3.0))
    torch.save(state, tmp_path / "negative.pt")
    assert_refused(shards, tmp_path, capsys, tmp_path / "negative.pt",
                   "its optimizer cannot be restored (the state of transformer.wte.weight: step is -3, not a "
                   "count of 0 or more)")
    state = checkpoint_files.load_checkpoint(tmp_path / "run" / "ckpt_000002.pt").state
    state["optimizer"]["muon"]["param_groups"][0].update(momentum=2.0)
    state["optimizer"]["adamw"]["param_groups"][1].update(betas=(0.9, 1.0))
    torch.save(state, tmp_path / "tampered.pt")
    train(shards, tmp_path / "resumed", *STEPS, *MUON, "--max_steps", "3", "--resume", tmp_path / "tampered.pt")
    groups = checkpoint_files.load_checkpoint(tmp_path / "resumed" / "ckpt_000003.pt").state["optimizer"]
    assert groups["muon"]["param_groups"][0]["momentum"] == 0.9 and groups["adamw"]["param_groups"][1]["betas"] == \
        (0.9, 0.95)


def test_a_muon_checkpoint_with_another_number_of_param_groups_is_refused(shards, tmp_path, capsys):
    train(shards, tmp_path / "run", *STEPS, *MUON, "--max_steps", "2")
    state = checkpoint_files.load_checkpoint(tmp_path / "run" / "ckpt_000002.pt").state
    groups = state["optimizer"]["muon"]["param_groups"]
    groups.append({**groups[1], "params": []})
    torch.save(state, tmp_path / "extra.pt")
    assert_refused(shards, tmp_path, capsys, tmp_path / "extra.pt", "its optimizer cannot be restored "
                   "(ValueError: 3 parameter groups saved, this run's optimizer has 2)")


def assert_refused(shards, tmp_path, capsys, bad, problem):
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "resumed", *STEPS, *MUON,
                       "--max_steps", "4", "--resume", bad)
    assert message.startswith(f"error: {bad}: ") and problem in message, message
    assert not os.path.exists(tmp_path / "resumed" / "log.jsonl") or not train_records(read_log(tmp_path / "resumed"))


def test_a_checkpoint_from_before_the_flag_is_adamws(shards):
    model = tiny_model()
    loader = ShardLoader(list_shards(shards, "train"), 2, 32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    flags = train_gpt2.parse_args([]).flags()
    del flags["optimizer"]  # as the trainer saved its flags before --optimizer
    state = as_checkpoint(parts_of(model, model.configure_optimizers(0.1, 1e-3, "cpu"), scaler, loader), 3, flags)
    assert checkpoint.restore_parts(OneFileCheckpoint("ckpt", state),
                                    parts_of(model, model.configure_optimizers(0.1, 1e-3, "cpu"), scaler, loader)) == 3
    optimizer = optimizers.build_optimizer(model, optimizers.OptimizerConfig("muon", 1e-3, 0.1), "cpu")
    with pytest.raises(checkpoint.CheckpointError, match="ckpt is a run of --optimizer adamw, this one is of "
                                                         "--optimizer muon"):
        checkpoint.restore_parts(OneFileCheckpoint("ckpt", state), parts_of(model, optimizer, scaler, loader))


def test_a_resumed_muon_run_keeps_this_machines_adamw_kernel_and_its_own_muon_lr(shards):
    model = tiny_model()
    loader = ShardLoader(list_shards(shards, "train"), 2, 32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    fused = optimizers.OptimizerConfig("muon", 1e-3, 0.1, fused_adamw=True, muon_lr=0.02)
    saved = optimizers.build_optimizer(model, fused, "cuda")
    state = as_checkpoint(parts_of(model, saved, scaler, loader), 3, train_gpt2.parse_args(MUON).flags())
    optimizer = optimizers.build_optimizer(model, optimizers.OptimizerConfig("muon", 1e-3, 0.1, muon_lr=0.04), "cpu")
    assert checkpoint.restore_parts(OneFileCheckpoint("ckpt", state), parts_of(model, optimizer, scaler, loader)) == 3
    assert [(g["fused"], g["foreach"]) for g in optimizer.adamw.param_groups] == [(False, None)] * 2
    assert optimizer.muon.param_groups[0]["lr_scale"] == 0.04 / 1e-3


@pytest.mark.slow
def test_fsdp_with_muon_trains_as_one_process_and_its_checkpoints_pass_both_ways(shards, tmp_path):
    """Under FSDP2 each rank holds rows of Muon's matrices; torch's Muon steps them as DTensors, whose
    Newton-Schulz matmuls gather what they need. 2 ranks train as one process does; a sharded
    checkpoint (momentum included) resumes in one process, directly and converted to one file; and
    a one-file checkpoint resumes under FSDP."""
    flags = ["--total_batch_size", "256", "--max_steps", "6", "--checkpoint_interval", "3", *MUON]

    def fsdp(log_dir, *more):
        result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", log_dir, *flags, "-B", "2",
                           "--fsdp", "1", *more)
        assert result.returncode == 0, result.stderr[-3000:]
        return read_log(log_dir)

    def tail(records):
        return [r for r in records if r["step"] >= 3]
    single = train(shards, tmp_path / "single", *flags, "-B", "4")
    sharded = fsdp(tmp_path / "fsdp")
    assert_same_run(single, sharded, rel=1e-4)  # bfloat16 Newton-Schulz on gradients summed in another order
    resumed = train(shards, tmp_path / "one", *flags, "-B", "4", "--resume", tmp_path / "fsdp" / "ckpt_000003")
    assert_same_run(tail(sharded), resumed, rel=1e-4)  # one process against two ranks, as above
    converter.main([str(tmp_path / "fsdp" / "ckpt_000003"), str(tmp_path / "converted.pt")])
    converted = checkpoint_files.load_checkpoint(tmp_path / "converted.pt").state
    buffers = [s["momentum_buffer"] for s in converted["optimizer"]["muon"]["state"].values()]
    assert len(buffers) == 8 and all(b.abs().sum() > 0 for b in buffers)
    assert converted["optimizer"]["muon"]["param_groups"][0]["lr_scale"] == 0.02 / 3e-3
    from_converted = train(shards, tmp_path / "converted", *flags, "-B", "4", "--resume", tmp_path / "converted.pt")
    assert [(r["train_loss"], r["grad_norm"]) for r in train_records(from_converted)] == [
        (r["train_loss"], r["grad_norm"]) for r in train_records(resumed)]
    assert_same_run(tail(single), fsdp(tmp_path / "fsdp_resumed", "--resume", tmp_path / "single" / "ckpt_000003.pt"),
                    rel=1e-4)


@pytest.mark.slow
def test_fsdp_with_muon_killed_or_out_of_disk_loses_nothing(shards, tmp_path):
    """Muon under --fsdp 1: every rank SIGKILLed at step 5, perhaps while step 4's checkpoint is
    still being written in the background, then rerun (--resume auto), ends as the uninterrupted
    run; a disk that fills during each later sharded save (a file size limit) costs those
    checkpoints, with a warning, and neither the older one nor a step."""
    flags = ["--total_batch_size", "256", "-B", "2", "--fsdp", "1", "--max_steps", "6", "--checkpoint_interval", "2",
             *MUON]

    def fsdp(log_dir, *more, preexec_fn=None):
        return run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", log_dir, *flags, *more,
                         preexec_fn=preexec_fn)
    assert fsdp(tmp_path / "full").returncode == 0
    full = read_log(tmp_path / "full")
    assert fsdp(tmp_path / "killed", "--async_checkpoint", "--fault", "sigkill@5").returncode != 0
    left = set(listdir(tmp_path / "killed"))
    assert {"ckpt_000002", "log.jsonl"} <= left <= {"ckpt_000002", "ckpt_000004", "ckpt_000004.partial", "log.jsonl"}
    result = fsdp(tmp_path / "killed", "--async_checkpoint")
    assert result.returncode == 0 and "resuming from" in result.stdout, result.stderr[-3000:]
    assert_same_run(full, read_log(tmp_path / "killed"))
    assert sorted(listdir(tmp_path / "killed")) == ["ckpt_000002", "ckpt_000004", "ckpt_000006", "log.jsonl"]
    for name in ("ckpt_000004", "ckpt_000006"):
        shutil.rmtree(tmp_path / "full" / name)
    shard_size = max(os.path.getsize(path) for path in glob.glob(str(tmp_path / "full" / "ckpt_000002" / "*.distcp")))
    result = fsdp(tmp_path / "full", "--resume", "auto", preexec_fn=file_size_limit(shard_size // 2))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"warning: could not write checkpoint {tmp_path / 'full' / 'ckpt_000004'}: rank " in result.stderr
    assert "OSError: [Errno 27] File too large" in result.stderr
    assert sorted(listdir(tmp_path / "full")) == ["ckpt_000002", "log.jsonl"]  # no .partial directory left
    assert_same_run(full, read_log(tmp_path / "full"))


def test_plan_counts_one_buffer_per_muon_parameter(capsys):
    train_gpt2.main(["--plan"])
    adamw = capsys.readouterr().out
    train_gpt2.main(["--plan", "--optimizer", "muon"])
    muon_out = capsys.readouterr().out
    config = train_gpt2.parse_args([]).model
    by_adamw, by_muon = memory.plan(config, 64, 1024), memory.plan(config, 64, 1024, optimizer="muon")
    assert by_adamw.optimizer - by_muon.optimizer == 4 * 12 * 12 * 768 * 768 == 4 * memory.n_muon_params(config)
    assert by_muon.total < by_adamw.total and by_muon.weights == by_adamw.weights
    line = [line for line in muon_out.splitlines() if line.strip().startswith("optimizer ")]
    assert line == [f"  {'optimizer':<12} {by_muon.optimizer / memory.GiB:8.2f} GiB"]
    assert f"{by_adamw.optimizer / memory.GiB:8.2f} GiB" in adamw and "optimizer muon" in muon_out
    assert memory.n_muon_params(GPTConfig(**TINY_CONFIG)) == sum(p.numel() for p in optimizers.muon_params(tiny_model()))
