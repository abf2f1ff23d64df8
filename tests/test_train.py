"""train_gpt2.py: flags and schedule, the training step, accumulation, DDP on gloo, exact resume,
init_from, logging to wandb and TensorBoard, bad input."""
import json
import os
import re
import sys
import urllib.request
from functools import partial

import numpy as np
import pytest
import torch

import hellaswag
import train_gpt2
from gpt2repro.common import devices, distributed
from gpt2repro.lm.data import ShardLoader, list_shards, write_shard
from gpt2repro.runs import checkpoint, checkpoint_files, loading
from gpt2repro.runs.checkpoint_files import OneFileCheckpoint, load_checkpoint
from gpt2repro.training import train_config
from gpt2repro.training.optimizers import OptimizerConfig, build_optimizer
from gpt2repro.training.step import StepConfig, Trainable, build_trainable, train_step
from helpers import REPO
from helpers.files import EXAMPLES, listdir, write_jsonl, write_token_shards
from helpers.models import FixedBatches, as_checkpoint, make_tiny_gpt, parts_of, save_as_checkpoint
from helpers.processes import one_line_error, run_ranks
from helpers.runs import (COMPILED_TRAIN, TINY, TINY_CONFIG, assert_same_run, error_of, final_weights, read_log,
                          run_cli, train, train_records)
from model import GPT, GPTConfig


def test_help_shows_every_flags_default_under_the_chosen_preset(capsys):
    with pytest.raises(SystemExit):
        train_gpt2.parse_args(["--preset", "demo", "--help"])
    out = capsys.readouterr().out
    assert "\n    torchrun --standalone --nproc_per_node=8 train_gpt2.py" in out  # the usage examples as written
    help_text = " ".join(out.split())
    assert "--log_dir LOG_DIR log.jsonl and checkpoints go here (default: log_demo)" in help_text
    assert "(default: None)" not in help_text and help_text.count("(default: max_steps)") == 1
    flags = [a for a in train_config.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in flags if not a.help] == []


def test_lr_schedule_is_gpt2s():
    cfg = train_gpt2.parse_args([])
    lr = partial(cfg.schedule.lr, max_lr=cfg.optimizer.max_lr)
    assert lr(0) == pytest.approx(6e-4 / 715)
    assert lr(714) == pytest.approx(6e-4)
    assert lr(715) == pytest.approx(6e-4)
    midway = 715 + (19073 - 715) // 2
    assert lr(midway) == pytest.approx(3.3e-4, rel=1e-3)
    assert lr(19072) == pytest.approx(6e-5, rel=1e-6)
    assert lr(19073) == lr(30000) == pytest.approx(6e-5)


def test_defaults_are_the_gpt2_124m_recipe():
    a = train_gpt2.parse_args([]).flags()
    assert (a["total_batch_size"], a["micro_batch_size"], a["seq_len"], a["vocab_size"]) == (524288, "auto", 1024, 50304)
    assert (a["n_layer"], a["n_head"], a["n_embd"], a["max_steps"], a["warmup_steps"]) == (12, 12, 768, 19073, 715)
    assert (a["weight_decay"], a["grad_clip"], a["seed"], a["eval_interval"], a["checkpoint_interval"]) == \
        (0.1, 1.0, 1337, 250, 5000)
    demo = train_gpt2.parse_args(["--preset", "demo", "--max_steps", "7"])
    assert demo.schedule.max_steps == 7 and demo.data_dir == os.path.join(REPO, "data", "shakespeare")


def test_demo_shards_that_cannot_be_written_are_one_line(tmp_path, demo_dir, monkeypatch, capsys):
    import fineweb

    def disk_full(path, tokens):
        raise OSError(f"{path}: cannot write the shard (No space left on device)")
    monkeypatch.setattr(fineweb, "write_shard", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(["--preset", "demo", "--data_dir", str(demo_dir), "--log_dir", str(tmp_path / "log")])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (f"error: {demo_dir / 'shakespeare_val_000000.npy'}: "
                                       f"cannot write the shard (No space left on device)\n")


def test_demo_shards_only_its_own_data_dir(tmp_path, demo_dir, capsys):
    mistyped = tmp_path / "shakspeare"
    message = error_of(capsys, "--preset", "demo", "--data_dir", mistyped, "--log_dir", tmp_path / "log")
    assert message.startswith(f"error: no *_train_*.npy shards in {str(mistyped)!r}")
    assert not mistyped.exists() and not demo_dir.exists()


def test_a_data_dir_that_is_a_text_file_says_how_to_train_on_it(tmp_path, capsys):
    """The bundled Tiny Shakespeare has the demo preset; another corpus, fineweb.py's command for it.
    Neither gets `fineweb.py --output_dir` a file, which fineweb.py refuses, and nothing is written."""
    demo_text = os.path.join(REPO, "data", "tinyshakespeare.txt")
    message = error_of(capsys, "--preset", "demo", "--data_dir", demo_text, "--log_dir", tmp_path / "log")
    assert message == (f"error: --data_dir {demo_text} is a file, not a directory of *_train_*.npy shards: "
                       f"`python train_gpt2.py --preset demo` trains on it, sharded into "
                       f"{os.path.join(REPO, 'data', 'shakespeare')} on first use")
    corpus = tmp_path / "my notes.txt"
    corpus.write_text("some text")
    message = error_of(capsys, "--preset", "demo", "--data_dir", corpus, "--log_dir", tmp_path / "log")
    shards = f"'{tmp_path / 'my notes'}'"
    assert message == (f"error: --data_dir {corpus} is a file, not a directory of *_train_*.npy shards: shard it with "
                       f"`python fineweb.py --input '{corpus}' --output_dir {shards}`, then train with --data_dir {shards}")
    assert sorted(os.listdir(tmp_path)) == ["my notes.txt"]


def test_a_data_dir_of_val_shards_alone_says_its_corpus_fit_in_one_shard(tmp_path, capsys):
    """What fineweb.py made of a small corpus before it refused one: the trainer names the cause."""
    val = write_token_shards(tmp_path / "data", n_train=0)[0]
    message = error_of(capsys, "--data_dir", tmp_path / "data", "--log_dir", tmp_path / "log")
    assert message == (f"error: {str(tmp_path / 'data')!r} holds val shards ({os.path.basename(val)}) and no "
                       f"*_train_*.npy: its corpus fit in one shard, the val split; shard it again with a smaller "
                       f"--shard_size")


def test_a_long_run_on_a_cpu_says_so_before_it_starts(tmp_path, capsys):
    """Ten million steps of the tiny model would take days on a CPU: a note says so at start,
    before the data is looked at (here missing); a short run says nothing."""
    with pytest.raises(SystemExit):
        train_gpt2.main(TINY + ["--max_steps", "10000000", "--data_dir", str(tmp_path / "none"),
                                "--log_dir", str(tmp_path / "log")])
    out, err = capsys.readouterr()
    assert re.search(r"^note: on a CPU a step would take about \d+ s and the 10,000,000 steps [\d.]+ days .*this "
                     r"run is meant for GPUs; `python train_gpt2.py --preset demo` trains a small GPT", out, re.M), out
    assert err.startswith("error: no *_train_*.npy shards")
    with pytest.raises(SystemExit):
        train_gpt2.main(TINY + ["--max_steps", "100", "--data_dir", str(tmp_path / "none"),
                                "--log_dir", str(tmp_path / "log")])
    assert "note: on a CPU" not in capsys.readouterr().out


def test_demo_shards_the_bundled_corpus_trains_and_samples(tmp_path, demo_dir, capsys):
    data_dir = demo_dir
    train_gpt2.main(["--preset", "demo", "--data_dir", str(data_dir), "--log_dir", str(tmp_path / "log"),
                     "--max_steps", "3", "--eval_interval", "3", "--sample_interval", "3", "--val_steps", "2",
                     "--hellaswag_path", str(tmp_path / "absent.jsonl")])
    out = capsys.readouterr().out
    assert "skipping HellaSwag" in out
    records = read_log(tmp_path / "log")
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    summary = (r"done: step 3 of 3, 3,072 tokens, \d\d:\d\d wall time, val loss "
               + f"{val_loss:.4f} at step 3, last checkpoint {re.escape(str(tmp_path / 'log' / 'ckpt_000003.pt'))}")
    assert re.fullmatch(summary, out.strip().splitlines()[-1]), out.strip().splitlines()[-1]
    assert [os.path.basename(p) for p in sorted(os.listdir(data_dir)) if p.endswith(".npy")][:2] == [
        "shakespeare_train_000001.npy", "shakespeare_train_000002.npy"]
    assert len([p for p in os.listdir(data_dir) if p.endswith(".npy")]) == 11  # 338,026 tokens in 32,768s
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3]
    samples = next(r["samples"] for r in records if "samples" in r)
    assert len(samples) == 4 and all(s.startswith("Hello, I'm a language model,") for s in samples)
    assert os.path.exists(tmp_path / "log" / "ckpt_000003.pt")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_demos_step_of_1024_tokens_divides_over_1_2_and_4_processes(world_size):
    demo = train_gpt2.parse_args(["--preset", "demo"])
    assert demo.world_size_problem(world_size) is None and demo.batch.total_batch_size == 1024


def test_max_steps_0_evaluates_the_starting_point_and_trains_nothing(shards, tmp_path, capsys):
    run = ["--total_batch_size", "256", "-B", "8", "--eval_interval", "4", "--val_steps", "2"]
    trained = train(shards, tmp_path / "run", *run, "--max_steps", "4")
    checkpoint_file = tmp_path / "run" / "ckpt_000004.pt"
    before = checkpoint_file.read_bytes()
    # A checkpoint, evaluated from another log_dir: the val loss its own run logged at that step.
    capsys.readouterr()
    evaluated = train(shards, tmp_path / "eval", *run, "--max_steps", "0", "--resume", checkpoint_file)
    assert evaluated == [r for r in trained if r["step"] == 4 and "val_loss" in r]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("done: evaluated step 4, no steps trained, 1,024 tokens, ") and \
        f"val loss {evaluated[0]['val_loss']:.4f} at step 4, last checkpoint none" in summary, summary
    assert checkpoint_file.read_bytes() == before and listdir(tmp_path / "eval") == ["log.jsonl"]
    # From scratch: the loss of the initial weights, the same as at step 0 of a training run.
    initial = train(shards, tmp_path / "init", *run, "--max_steps", "0")
    assert initial == [r for r in trained if r["step"] == 0 and "val_loss" in r]
    # In the run's own log_dir, of an earlier checkpoint: its records are all kept, the new one added.
    train(shards, tmp_path / "run", *run, "--max_steps", "6", "--checkpoint_interval", "2")
    history = read_log(tmp_path / "run")
    again = train(shards, tmp_path / "run", *run, "--max_steps", "0", "--resume", checkpoint_file)
    assert again[:-1] == history and again[-1] == evaluated[0]


def test_training_on_from_an_older_checkpoint_into_its_log_dir_is_refused(shards, tmp_path, capsys):
    run = ["--total_batch_size", "256", "-B", "8", "--checkpoint_interval", "2"]
    history = train(shards, tmp_path, *run, "--max_steps", "6")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path, *run, "--max_steps", "8",
                       "--resume", tmp_path / "ckpt_000002.pt")
    assert "holds checkpoints past step 2 (ckpt_000006.pt, ...)" in message and "mix two runs" in message
    assert read_log(tmp_path) == history
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == [
        "ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.pt"]
    branched = train(shards, tmp_path / "branch", *run, "--max_steps", "4", "--resume", tmp_path / "ckpt_000002.pt")
    assert [r["step"] for r in train_records(branched)] == [2, 3]


def test_hellaswag_is_skipped_with_a_note_for_a_model_that_cannot_read_it(shards, tmp_path, capsys):
    examples = write_jsonl(tmp_path / "hellaswag.jsonl", EXAMPLES)
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "1",
                    "--eval_interval", "1", "--hellaswag", "1", "--hellaswag_path", examples)
    assert "note: skipping HellaSwag: a vocabulary of 256 cannot hold GPT-2's 50257 token ids" in capsys.readouterr().out
    assert [r["step"] for r in records if "val_loss" in r] == [0, 1]
    assert not any("hellaswag_acc_norm" in r for r in records)


def test_hellaswag_that_is_missing_or_cannot_be_downloaded_names_the_trainers_flags(tmp_path, monkeypatch):
    import hellaswag
    notes = []
    cfg = train_gpt2.parse_args(["--hellaswag_path", str(tmp_path / "absent.jsonl")])
    assert hellaswag.load_for_run(cfg.eval, 0, cfg.model, notes.append) is None
    assert "skipping HellaSwag (`python hellaswag.py --download_only` fetches it to" in notes[-1]
    monkeypatch.setattr(hellaswag, "CACHE_DIR", str(tmp_path / "hellaswag"))
    monkeypatch.setenv(hellaswag.URL_ENV, (tmp_path / "unreachable").as_uri())
    cfg = train_gpt2.parse_args([])
    assert hellaswag.load_for_run(cfg.eval, 0, cfg.model, notes.append) is None
    assert "pass --hellaswag_path PATH" in notes[-1] and "--data" not in notes[-1]
    assert os.listdir(tmp_path) == []


def test_short_run_learns(shards, tmp_path):
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "30", "--max_lr", "1e-2",
                    "--eval_interval", "15", "--val_steps", "4")
    losses = [r["train_loss"] for r in train_records(records)]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses) == 30 and len(val) == 3  # steps 0, 15 and the end
    assert losses[0] == pytest.approx(np.log(256), abs=0.3)
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    assert val[-1] < val[0] - 1.0
    assert os.path.exists(tmp_path / "ckpt_000030.pt")


def test_gradient_accumulation_equals_one_big_batch(shards, tmp_path):
    one = train(shards, tmp_path / "one", "--total_batch_size", "256", "-B", "8", "--max_steps", "6")
    four = train(shards, tmp_path / "four", "--total_batch_size", "256", "-B", "2", "--max_steps", "6")
    assert_same_run(one, four)
    for key, tensor in final_weights(tmp_path / "one", 6).items():
        assert torch.allclose(tensor, final_weights(tmp_path / "four", 6)[key], atol=1e-5), key


@pytest.mark.slow
def test_ddp_on_two_processes_equals_one_process(shards, tmp_path):
    # Two micro-steps a step on both sides: the first under no_sync, gradients as bucket views.
    # Val: 2 micro-batches of 4x32 on one process, 2 of 2x32 on each of two ranks: the same 256 tokens.
    evals = ["--eval_interval", "4", "--val_steps", "2"]
    single = train(shards, tmp_path / "single", "--total_batch_size", "256", "-B", "4", "--max_steps", "4", *evals)
    result = run_ranks("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path / "ddp",
                       "--total_batch_size", "256", "-B", "2", "--max_steps", "4", *evals)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in result.stdout
    ddp = read_log(tmp_path / "ddp")
    assert_same_run(single, ddp)
    val = [[(r["step"], r["val_loss"]) for r in log if "val_loss" in r] for log in (single, ddp)]
    assert [step for step, _ in val[1]] == [0, 4]
    assert [loss for _, loss in val[1]] == pytest.approx([loss for _, loss in val[0]], rel=1e-5)
    ddp_weights = final_weights(tmp_path / "ddp", 4)
    for key, tensor in final_weights(tmp_path / "single", 4).items():
        assert torch.allclose(tensor, ddp_weights[key], atol=1e-5), key


def test_ddp_gradients_stay_in_its_buckets_across_steps(shards):
    """With gradient_as_bucket_view, DDP's all-reduce buckets are the gradients: every micro-step
    of every step accumulates into them, never into a second, freshly allocated set."""
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (see distributed.init)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raw_model = GPT(GPTConfig(**TINY_CONFIG))
        model = DDP(raw_model, gradient_as_bucket_view=True)  # as build_trainable wraps it on 2 ranks or more
        t = Trainable(model, raw_model, build_optimizer(raw_model, OptimizerConfig(max_lr=1e-3), "cpu"),
                                 torch.amp.GradScaler("cpu", enabled=False), "cpu", StepConfig(torch.float32, 2 * 2 * 32))
        loader = ShardLoader(list_shards(shards, "train"), 2, 32)
        where = []  # the gradient's storage after each micro-step's accumulation
        raw_model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: where.append(p.grad.data_ptr()))
        for step in range(2):
            assert not train_step(t, loader, 1e-3).skipped
    finally:  # DDP's reducer freed before the group, as the trainer does: freed after, it can hang joining gloo's threads
        model = t = None
        distributed.leave()
    # The first step allocates, and DDP copies into its bucket and keeps the bucket as the gradient.
    assert len(where) == 4 and where[2] == where[3] == raw_model.lm_head.weight.grad.data_ptr() != where[0]


def test_resume_is_exact(shards, tmp_path):
    # 2N steps in one go, then N steps resumed from the checkpoint at N: the same losses.
    full = train(shards, tmp_path / "full", "--total_batch_size", "256", "-B", "8", "--max_steps", "12",
                 "--checkpoint_interval", "6", "--eval_interval", "6", "--val_steps", "2")
    resumed = train(shards, tmp_path / "resumed", "--total_batch_size", "256", "-B", "8", "--max_steps", "12",
                    "--resume", tmp_path / "full" / "ckpt_000006.pt", "--eval_interval", "6", "--val_steps", "2")
    tail = [r for r in train_records(full) if r["step"] >= 6]
    assert [r["train_loss"] for r in train_records(resumed)] == pytest.approx([r["train_loss"] for r in tail], abs=1e-6)
    for key, tensor in final_weights(tmp_path / "full", 12).items():
        assert torch.equal(tensor, final_weights(tmp_path / "resumed", 12)[key]), key


def test_resume_keeps_this_machines_adamw_kernel(shards):
    """A checkpoint saved with fused AdamW (on a GPU) resumed where this run chose otherwise."""
    model = GPT(GPTConfig(**TINY_CONFIG))
    loader = ShardLoader(list_shards(shards, "train"), 2, 32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    fused = model.configure_optimizers(0.1, 1e-3, "cuda", fused=True)
    state = as_checkpoint(parts_of(model, fused, scaler, loader), 3, train_gpt2.parse_args([]).flags())
    optimizer = model.configure_optimizers(0.1, 1e-3, "cpu")
    assert checkpoint.restore_parts(OneFileCheckpoint("ckpt", state), parts_of(model, optimizer, scaler, loader)) == 3
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(False, None)] * 2


def test_resume_auto_truncates_the_log_to_the_checkpoint(shards, tmp_path):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "8", "--checkpoint_interval", "4")
    os.remove(tmp_path / "ckpt_000008.pt")  # as if the run died after step 8's log lines but before its checkpoint
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 9, "tokens": 1, "train_')  # and mid-way through a line
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "8")
    assert [r["step"] for r in train_records(records)] == list(range(8))


@pytest.mark.slow
def test_bad_input_fails_with_one_line(shards, tmp_path, capsys):
    message = one_line_error(run_cli("--data_dir", tmp_path / "empty", "--log_dir", tmp_path / "log"))
    assert "no *_train_*.npy shards" in message and "python fineweb.py" in message
    assert not os.path.lexists(tmp_path / "log")  # a failed start leaves no log_dir holding only its .lock
    os.makedirs(tmp_path / "mine")  # but one it did not make, it leaves as it was
    assert "no *_train_*.npy shards" in error_of(capsys, "--data_dir", tmp_path / "empty", "--log_dir", tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == [".lock"]
    common = ["--data_dir", shards, "--log_dir", tmp_path / "log", "--max_steps", "2"]
    message = error_of(capsys, *common, "--total_batch_size", "1000", "-B", "8")
    assert "not a multiple of B*T*world_size" in message and "try --total_batch_size 1024" in message
    assert "longer than --block_size 64" in error_of(capsys, *common, "-T", "128")
    assert "invalid choice" in error_of(capsys, *common, "--preset", "gpt5")
    assert "--max_steps must not be negative" in error_of(capsys, *common, "--max_steps", "-1")
    assert "--max_steps 0 only evaluates" in error_of(capsys, *common, "--max_steps", "0")
    assert "is not KIND@STEP[:RANK]" in error_of(capsys, *common, "--fault", "nan@x")
    for seed in ("-1", str(2**64)):  # numpy's generators take [0, 2**32): the first epoch boundary would fail
        assert "--seed must be in [0, 2**32)" in error_of(capsys, *common, "--seed", seed)
    if not torch.cuda.is_available():
        assert "--device cuda: device cuda:0 cannot be used here" in error_of(capsys, *common, "--device", "cuda")


def test_resume_across_precisions_and_gpu_counts(shards, tmp_path, monkeypatch):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "2")
    # Saved in float32 (no loss scaler state), resumed with fp16 loss scaling: a fresh scale.
    resumed = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "3", "--dtype", "float16")
    assert [r["step"] for r in train_records(resumed)] == [0, 1, 2]
    # Saved by a process that saw 8 GPUs, resumed where there is one: that one's state only.
    state = load_checkpoint(str(tmp_path / "ckpt_000003.pt")).state
    state["rng"][0]["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    model = GPT(GPTConfig(**TINY_CONFIG))
    loader = ShardLoader(list_shards(shards, "train"), 8, 32)
    step = checkpoint.restore_parts(OneFileCheckpoint("ckpt", state),
                                    parts_of(model, model.configure_optimizers(0.1, 1e-3, "cpu"),
                                             torch.amp.GradScaler("cpu", enabled=False), loader))
    assert step == 3 and len(restored) == 1 and torch.equal(restored[0], state["rng"][0]["cuda"][0])


def test_a_val_loss_that_is_not_finite_names_the_weight_that_overflows_not_the_val_shards(shards, tmp_path, capsys):
    """A checkpoint whose weight of 3e38 (finite) blows the forward pass up: the val loader has
    checked every id it read, so the line names the weight, not the val shards."""
    run = ["--total_batch_size", "256", "-B", "8", "--eval_interval", "2", "--val_steps", "1"]
    train(shards, tmp_path / "run", *run, "--max_steps", "2")
    state = load_checkpoint(str(tmp_path / "run" / "ckpt_000002.pt")).state
    state["model"]["transformer.h.0.mlp.c_fc.weight"][5, 7] = 3e38
    torch.save(state, tmp_path / "blown.pt")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "resumed", *run, "--max_steps", "4",
                       "--resume", tmp_path / "blown.pt")
    assert message == ("error: the val loss at step 2 is nan on val tokens whose ids were each checked: the model's "
                       "forward pass overflows (its largest weight, in transformer.h.0.mlp.c_fc.weight, is 3e+38)")


def test_a_missing_resume_path_is_the_error_before_any_download(shards, tmp_path, capsys, monkeypatch):
    import hellaswag

    def no_download(url, timeout):
        raise AssertionError(f"downloaded {url}")
    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    monkeypatch.setattr(hellaswag, "CACHE_DIR", str(tmp_path / "hellaswag"))
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "log", "--resume", tmp_path / "missing.pt",
                       "--hellaswag", "1", "--eval_interval", "1")
    assert message == f"error: --resume {tmp_path / 'missing.pt'}: no such checkpoint"


def test_resume_of_what_is_not_a_training_checkpoint_or_into_no_log_dir_is_one_line(shards, tmp_path, capsys):
    model_only = save_as_checkpoint(GPT(GPTConfig(**TINY_CONFIG)), tmp_path / "model_only.pt")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "log", "--resume", model_only)
    assert message == f"error: {model_only} holds no optimizer: a model to score or sample, not a run to resume"
    state = torch.load(model_only, weights_only=True)
    del state["step"]  # no step either, as a checkpoint slimmed for sharing is
    torch.save(state, model_only)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "log", "--resume", model_only)
    assert message == f"error: {model_only} holds no optimizer: a model to score or sample, not a run to resume"
    (tmp_path / "file").write_text("")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "file" / "log")
    assert message.startswith(f"error: --log_dir {tmp_path / 'file' / 'log'}: cannot make it")


def test_val_shards_too_small_for_one_batch_are_named(tmp_path, capsys):
    val = write_token_shards(tmp_path, n_val=100)[0]
    message = error_of(capsys, "--data_dir", tmp_path, "--log_dir", tmp_path / "log", "-B", "8")
    assert message == f"error: {val}: 100 tokens, too few for one batch of B*T = 256 tokens on each of 1 rank(s)"


def test_resume_with_another_architecture_is_refused(shards, tmp_path, capsys):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "2")
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path, "--max_steps", "4",
                       "--total_batch_size", "256", "-B", "8", "--n_layer", "3")
    assert "another architecture" in message and "n_layer 2 (this run: 3)" in message
    assert message.endswith("resume it with its model flags, or start over: --resume none (which moves the earlier "
                            "run's files aside), or another --log_dir")


def test_corrupt_shard_is_named_before_training(shards, tmp_path, capsys):
    bad = tmp_path / "bad"
    paths = write_token_shards(bad)
    with open(paths[2], "r+b") as f:
        f.truncate(os.path.getsize(paths[2]) - 10)
    message = error_of(capsys, "--data_dir", bad, "--log_dir", tmp_path / "log", "--max_steps", "2")
    assert paths[2] in message and "truncated" in message
    write_shard(paths[2], np.full(5000, 300))  # ids beyond --vocab_size 256
    message = error_of(capsys, "--data_dir", bad, "--log_dir", tmp_path / "log", "--max_steps", "2")
    assert paths[2] in message and "token id 300" in message and ">= vocab_size 256" in message


def test_a_padding_id_in_a_train_or_val_shard_stops_a_gpt2_vocab_run_before_training(tmp_path, capsys):
    """With GPT-2's padded table of 50304 rows, an id of 50257-50303 is no token: refused in
    either split and either check mode, not trained on (train) or scored as an infinite loss (val)."""
    bad = tmp_path / "bad"
    paths = write_token_shards(bad, n_train=1)
    for path in paths:  # val, then train
        good = np.load(path)
        tokens = good.copy()
        tokens[7] = 50300
        write_shard(path, tokens)
        for mode in ("quick", "full"):
            message = error_of(capsys, "--data_dir", bad, "--log_dir", tmp_path / "log", "--max_steps", "2",
                               "--total_batch_size", "256", "-B", "8", "--vocab_size", "50304", "--check_data", mode)
            assert message.startswith(f"error: {path}: token id 50300 at position 7 is a padding row: ids 50257-50303")
        write_shard(path, good)
    assert not os.path.exists(tmp_path / "log" / "log.jsonl")


def resumed_with_another_weight_decay(shards, log_dir):
    """A 2-step run of --weight_decay 0.1, resumed to step 4 under --weight_decay 0."""
    run = ["--total_batch_size", "256", "-B", "8"]
    train(shards, log_dir, *run, "--max_steps", "2", "--weight_decay", "0.1")
    train(shards, log_dir, *run, "--max_steps", "4", "--weight_decay", "0")


def test_a_resume_trains_with_this_runs_weight_decay_not_the_checkpoints(shards, tmp_path):
    resumed_with_another_weight_decay(shards, tmp_path)
    state = load_checkpoint(str(tmp_path / "ckpt_000004.pt")).state
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.0, 0.0]
    assert checkpoint.recorded_flags(state)["weight_decay"] == 0.0


def test_a_resume_under_changed_hyperparameters_says_which_old_to_new(shards, tmp_path, capsys):
    resumed_with_another_weight_decay(shards, tmp_path)
    assert "this run's flags win over the checkpoint's: decay_steps 2 -> 4, weight_decay 0.1 -> 0.0\n" in \
        capsys.readouterr().out


def test_a_resume_under_another_seq_len_and_seed_says_what_each_changes(shards, tmp_path, capsys):
    run = ["--total_batch_size", "256", "-B", "8"]
    train(shards, tmp_path, *run, "--max_steps", "2")
    capsys.readouterr()
    train(shards, tmp_path, *run, "--max_steps", "4", "-T", "16", "--seed", "7")
    lines = capsys.readouterr().out.splitlines()
    assert [line.partition(":")[0] for line in lines if " wins over the checkpoint's" in line] == [
        "this run's -T wins over the checkpoint's (32 -> 16)",
        "this run's --seed wins over the checkpoint's (1337 -> 7)"]


def test_resume_is_exact_across_several_epochs(tmp_path):
    data = str(tmp_path / "data")
    write_token_shards(data, n_train=3, tokens_per_shard=600, n_val=600)  # 7 steps an epoch
    run = ["--total_batch_size", "256", "-B", "8", "--max_steps", "30"]
    full = train(data, tmp_path / "full", *run, "--checkpoint_interval", "10")
    resumed = train(data, tmp_path / "resumed", *run, "--resume", tmp_path / "full" / "ckpt_000010.pt")
    assert load_checkpoint(str(tmp_path / "full" / "ckpt_000030.pt")).state["train_loader"]["epoch"] == 4
    tail = [r["train_loss"] for r in train_records(full) if r["step"] >= 10]
    assert [r["train_loss"] for r in train_records(resumed)] == pytest.approx(tail, abs=1e-6)
    in_order = train(data, tmp_path / "in_order", *run, "--shuffle", "0")
    losses = [[r["train_loss"] for r in train_records(log)] for log in (full, in_order)]
    assert losses[0][:7] == losses[1][:7] and losses[0][7:] != losses[1][7:]


class FakeWandb:
    """Stands in for the wandb package: keeps what a run logs."""

    def __init__(self):
        self.logged = []

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, data, step):
        self.logged.append({"step": step, **data})


class FakeSummaryWriter:
    scalars = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        pass


def test_wandb_and_tensorboard_record_the_fields_of_log_jsonl(shards, tmp_path, monkeypatch):
    import types
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "3",
                    "--eval_interval", "2", "--val_steps", "1", "--wandb", "--tensorboard")
    assert wandb.logged == records
    assert wandb.init_kwargs["config"]["max_steps"] == 3
    expected = [(k, v, r["step"]) for r in records for k, v in r.items() if k != "step"]
    assert FakeSummaryWriter.scalars == expected


@pytest.mark.parametrize("flag, module", [("--wandb", "wandb"), ("--tensorboard", "torch.utils.tensorboard")])
def test_a_missing_logging_package_is_one_clear_error(shards, tmp_path, monkeypatch, capsys, flag, module):
    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "1", flag)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == f"error: {flag} needs the {flag[2:]} package: pip install {flag[2:]}\n"


@pytest.mark.slow
def test_compiled_ddp_run_equals_eager_evaluates_hellaswag_and_saves_plain_gpt_keys(shards, tmp_path):
    """A 2-process run with --compile 1 and HellaSwag at every eval: torch.compile wraps DDP (so
    dynamo cuts the graph at DDP's buckets and the all-reduce overlaps the backward), the losses are
    the eager run's, the ranks' HellaSwag shares add up, and its checkpoint holds plain GPT keys
    that hellaswag.py scores to the number the run logged."""
    script = tmp_path / "train_compiled.py"
    script.write_text(COMPILED_TRAIN.format(repo=REPO))
    examples = write_jsonl(tmp_path / "hellaswag.jsonl", EXAMPLES)
    flags = [*TINY, "--vocab_size", "50304", "--data_dir", shards, "--total_batch_size", "256", "-B", "4",
             "--max_steps", "2", "--eval_interval", "2", "--val_steps", "1", "--hellaswag", "1", "--hellaswag_path", examples]
    result = run_ranks(script, *flags, "--compile", "1", "--log_dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the step runs through OptimizedModule of DistributedDataParallel" in result.stdout
    eager = run_ranks("train_gpt2.py", *flags, "--log_dir", tmp_path / "eager")
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert_same_run(read_log(tmp_path), read_log(tmp_path / "eager"))
    logged = [r for r in read_log(tmp_path) if "hellaswag_acc_norm" in r]
    assert [(r["step"], r["hellaswag_n"]) for r in logged] == [(0, 5), (2, 5)]
    saved = torch.load(tmp_path / "ckpt_000002.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(GPT(GPTConfig(**TINY_CONFIG)).state_dict())
    hellaswag.main(["-m", str(tmp_path / "ckpt_000002.pt"), "--data", examples, "--json", str(tmp_path / "score.json"),
                    "--device", "cpu"])
    score = json.loads((tmp_path / "score.json").read_text())
    assert (score["acc"], score["acc_norm"]) == (logged[-1]["hellaswag_acc"], logged[-1]["hellaswag_acc_norm"])


def test_checkpoints_with_wrapper_prefixes_still_load(shards, tmp_path):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "2")
    path = tmp_path / "ckpt_000002.pt"
    state = torch.load(path, weights_only=True)
    plain = state["model"]
    state["model"] = {f"module._orig_mod.{k}": v for k, v in plain.items()}  # as an older DDP + compile run wrote it
    torch.save(state, path)
    assert_resumes(shards, tmp_path, plain)


def assert_resumes(shards, log_dir, weights):
    """load_model and --resume both take the newest checkpoint in log_dir, whose model is weights."""
    newest = checkpoint_files.list_checkpoints(str(log_dir))[-1]
    loaded = loading.load_model(newest).state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    records = train(shards, log_dir, "--total_batch_size", "256", "-B", "8", "--max_steps", "3")
    assert [r["step"] for r in train_records(records)][-1] == 2


def test_compile_auto_is_on_for_cuda_only_and_says_why_not_elsewhere(monkeypatch):
    notes = []
    assert devices.resolve_compile("auto", "cuda", notes.append) is (sys.platform != "win32")
    assert devices.resolve_compile("auto", "cpu", notes.append) is False and notes == []
    assert devices.resolve_compile("auto", "mps", notes.append) is False
    assert notes == ["note: --compile auto stays off on MPS"]
    monkeypatch.setattr(train_gpt2.sys, "platform", "win32")
    assert devices.resolve_compile("auto", "cuda", notes.append) is False
    assert notes[-1] == "note: --compile auto stays off on Windows"
    assert devices.resolve_compile("1", "cpu", notes.append) is True


def test_every_param_group_steps_at_the_scheduled_lr(shards, tmp_path, monkeypatch):
    """The lr each optimizer step runs at, in every param group, is the schedule's lr(step)."""
    stepped = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        stepped.append([group["lr"] for group in self.param_groups])
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    flags = ["--total_batch_size", "256", "-B", "8", "--max_steps", "6", "--warmup_steps", "2"]
    records = train(shards, tmp_path, *flags)
    schedule = train_gpt2.parse_args(TINY + flags).schedule
    expected = [schedule.lr(step, 3e-3) for step in range(6)]
    assert len(set(expected)) == 5  # warmup to max_lr at step 2, then cosine
    assert [r["lr"] for r in train_records(records)] == pytest.approx(expected)
    assert stepped == [pytest.approx([lr, lr]) for lr in expected]  # both groups: decayed and not


def test_gradients_are_unscaled_then_clipped_and_the_norm_before_clipping_is_logged():
    model = GPT(GPTConfig(**TINY_CONFIG))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = model(x[:, :-1], x[:, 1:])[1].item()

    def step(grad_clip, scaler):
        # lr 0: the weights stay, so every call sees the same gradients; clipping leaves them in p.grad.
        optimizer = build_optimizer(model, OptimizerConfig(max_lr=1e-3, grad_clip=grad_clip), "cpu")
        t = Trainable(model, model, optimizer, scaler, "cpu",
                                 StepConfig(torch.float32, 2 * 32, optimizer=OptimizerConfig(grad_clip=grad_clip)))
        result = train_step(t, FixedBatches([(x[:, :-1], x[:, 1:])]), lr=0.0)
        assert result.loss == pytest.approx(loss) and not result.skipped
        return result.grad_norm, torch.cat([p.grad.flatten() for p in model.parameters()])

    norm, grads = step(0, torch.amp.GradScaler("cpu", enabled=False))  # --grad_clip 0: no clipping
    assert norm == pytest.approx(grads.norm().item(), rel=1e-5) and norm > 0
    clipped_norm, clipped = step(norm / 4, torch.amp.GradScaler("cpu", enabled=False))
    assert clipped_norm == pytest.approx(norm, rel=1e-5)  # the norm before clipping
    assert torch.allclose(clipped, grads / 4, rtol=1e-4, atol=1e-9)
    # Under fp16 loss scaling: unscaled first, then clipped; the norm is that of the true gradients.
    scaled_norm, unscaled = step(norm / 4, torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert scaled_norm == pytest.approx(norm, rel=1e-4)
    assert torch.allclose(unscaled, grads / 4, rtol=1e-4, atol=1e-9)


def test_keep_last_keeps_the_newest_checkpoints(shards, tmp_path):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "8",
          "--checkpoint_interval", "2", "--keep_last", "2")
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == [
        "ckpt_000006.pt", "ckpt_000008.pt"]
    assert load_checkpoint(str(tmp_path / "ckpt_000008.pt")).state["step"] == 8


def test_bad_steps_must_be_in_a_row_to_stop_the_run(shards, tmp_path):
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "5",
                    "--max_bad_steps", "2", "--fault", "nan@1", "--fault", "nan@3")
    assert [(r["step"], r["bad_steps"]) for r in records if r.get("skipped_step")] == [(1, 1), (3, 1)]
    assert [r["step"] for r in train_records(records)] == [0, 2, 4]


def test_a_checkpoint_records_the_flags_as_asked_not_as_this_machine_settled_them(shards, tmp_path, capsys):
    """--loss auto (masked on a CPU), -B auto (8: the step's sequences), a --val_steps past what the
    val shards hold and samples of a vocabulary that is not GPT-2's are settled for this run, which
    says so; its checkpoint's flags keep what was asked, for a resume elsewhere to settle again."""
    train(shards, tmp_path, "--total_batch_size", "256", "--max_steps", "1", "--loss", "auto", "-B", "auto",
          "--eval_interval", "1", "--val_steps", "1000", "--sample_interval", "1")
    out = capsys.readouterr().out
    assert "micro-batch auto: 8 (" in out and "fewer than --val_steps 1000: using 15" in out and "no samples" in out
    flags = checkpoint.recorded_flags(load_checkpoint(str(tmp_path / "ckpt_000001.pt")).state)
    assert (flags["loss"], flags["micro_batch_size"], flags["val_steps"], flags["sample_interval"]) == \
        ("auto", "auto", 1000, 1)


def test_seed_sets_the_order_of_later_epochs(shards, tmp_path):
    def epoch_1_start(*flags):
        log_dir = tmp_path / str(len(os.listdir(tmp_path)))
        run = train_gpt2.setup(train_gpt2.parse_args(TINY + ["--data_dir", shards, "--log_dir", str(log_dir), "-B", "8",
                                                             *flags]))
        run.log_dir_lock.close()
        loader = run.train_loader
        loader.load_state_dict({"epoch": 1, "index": 0, "tokens_per_index": 8 * 32})
        return loader.next_batch()[0]
    assert torch.equal(epoch_1_start("--seed", "1"), epoch_1_start("--seed", "1"))
    assert not torch.equal(epoch_1_start("--seed", "1"), epoch_1_start("--seed", "2"))
    assert torch.equal(epoch_1_start("--seed", "1", "--shuffle", "0"), epoch_1_start("--seed", "2", "--shuffle", "0"))


def test_training_on_from_the_newest_checkpoint_by_path_in_its_own_log_dir(shards, tmp_path):
    run = ["--total_batch_size", "256", "-B", "8", "--checkpoint_interval", "2"]
    train(shards, tmp_path, *run, "--max_steps", "4")
    records = train(shards, tmp_path, *run, "--max_steps", "6", "--resume", tmp_path / "ckpt_000004.pt")
    assert [r["step"] for r in train_records(records)] == list(range(6))
    assert [os.path.basename(p) for p in checkpoint_files.list_checkpoints(str(tmp_path))] == [
        "ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.pt"]


def test_a_resumed_adamw_holds_its_state_as_this_machines_kernel_does(shards):
    """Optimizer.load_state_dict places each `step` counter by the flags of the groups it loads,
    so a run saved with one AdamW kernel and resumed with another must load under this machine's
    flags: after restore_parts every state tensor has the device and dtype that the same
    optimizer, built fresh here and stepped once, holds. (On a GPU a CPU run's counters would stay
    on the CPU, under the fused kernel; on a CPU the same rule shows in the dtype: stepped with
    float64 as the default dtype, the foreach kernel counts in float64, the fused one in float32.)"""
    loader = ShardLoader(list_shards(shards, "train"), 2, 32)

    def stepped_once(fused, default_dtype=torch.float32):
        model = GPT(GPTConfig(**TINY_CONFIG))
        optimizer = model.configure_optimizers(0.1, 1e-3, "cpu", fused=fused)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        torch.set_default_dtype(default_dtype)  # the moments take their parameter's, float32
        try:
            optimizer.step()
        finally:
            torch.set_default_dtype(torch.float32)
        return model, optimizer

    saved_model, saved_optimizer = stepped_once(fused=False, default_dtype=torch.float64)
    assert saved_optimizer.state[saved_model.lm_head.weight]["step"].dtype == torch.float64
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = as_checkpoint(parts_of(saved_model, saved_optimizer, scaler, loader), 1, train_gpt2.parse_args([]).flags())
    _, fresh = stepped_once(fused=True)
    model = GPT(GPTConfig(**TINY_CONFIG))
    resumed = model.configure_optimizers(0.1, 1e-3, "cpu", fused=True)
    checkpoint.restore_parts(OneFileCheckpoint("ckpt", state), parts_of(model, resumed, scaler, loader))

    def placement(optimizer):
        return [{k: (v.device, v.dtype) for k, v in optimizer.state[p].items()}
                for group in optimizer.param_groups for p in group["params"]]
    assert placement(resumed) == placement(fresh)
    assert placement(fresh)[0]["step"] == (torch.device("cpu"), torch.float32)
    assert [g["fused"] for g in resumed.param_groups] == [True, True]


def test_the_step_returns_once_the_device_has_finished_it(shards, monkeypatch):
    """The loop's clock stops when train_step returns: the device must have run the optimizer
    step by then, or tokens/s and MFU would describe only the queueing of the work."""
    events = []
    monkeypatch.setattr("gpt2repro.training.step.synchronize", lambda device: events.append(("synchronize", device)))
    model = GPT(GPTConfig(**TINY_CONFIG))
    optimizer = build_optimizer(model, OptimizerConfig(max_lr=1e-3), "cpu")
    optimizer.register_step_post_hook(lambda *_: events.append(("optimizer step",)))
    t = Trainable(model, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), "cpu",
                             StepConfig(torch.float32, 2 * 2 * 32))
    train_step(t, ShardLoader(list_shards(shards, "train"), 2, 32), 1e-3)
    assert events == [("optimizer step",), ("synchronize", "cpu")]


def test_a_stop_request_drops_the_step_in_flight_and_rewinds_the_loader(shards):
    """Asked to stop in its third micro-step, train_step returns None having changed nothing:
    the next step (of the resumed run) reads the same batches and gets the same result."""
    def trainable():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY_CONFIG))
        return Trainable(model, model, build_optimizer(model, OptimizerConfig(max_lr=1e-3), "cpu"),
                                    torch.amp.GradScaler("cpu", enabled=False), "cpu", StepConfig(torch.float32, 4 * 2 * 32))
    dropped, plain = trainable(), trainable()
    loaders = [ShardLoader(list_shards(shards, "train"), 2, 32) for _ in range(2)]
    asked = iter([False, False, True])
    assert train_step(dropped, loaders[0], 1e-3, lambda oom: [next(asked), oom]) is None
    assert loaders[0].state_dict() == loaders[1].state_dict()
    assert not dropped.optimizer.state and all(torch.equal(a, b) for a, b in
                                               zip(dropped.step_model.parameters(), plain.step_model.parameters()))
    results = [train_step(t, loader, 1e-3) for t, loader in zip((dropped, plain), loaders)]
    assert results[0] == results[1]


def test_init_from_takes_only_the_weights_of_a_checkpoint_or_a_hugging_face_directory(shards, tmp_path, hf_gpt2_dir,
                                                                                      capsys):
    run = ["--total_batch_size", "256", "-B", "8", "--val_steps", "2"]
    trained = train(shards, tmp_path / "a", *run, "--max_steps", "3", "--eval_interval", "3")
    # From a checkpoint: its weights (the val loss it was logged with), a fresh optimizer and schedule at step 0.
    tuned = train(shards, tmp_path / "b", *run, "--max_steps", "2", "--eval_interval", "2",
                  "--init_from", tmp_path / "a" / "ckpt_000003.pt")
    assert [(r["step"], r["val_loss"]) for r in tuned if "val_loss" in r][0] == next(
        (r["step"] - 3, r["val_loss"]) for r in trained if r["step"] == 3 and "val_loss" in r)
    assert [r["lr"] for r in train_records(tuned)] == [r["lr"] for r in train_records(trained)][:2]
    state = load_checkpoint(str(tmp_path / "b" / "ckpt_000002.pt")).state
    assert state["step"] == 2 and {s["step"].item() for s in state["optimizer"]["state"].values()} == {2.0}
    # From a Hugging Face directory: its architecture, whatever the model flags say, and its loss.
    hf, hf_dir = hf_gpt2_dir
    data = tmp_path / "vocab128"
    write_token_shards(data, vocab=hf.config.vocab_size)
    evaluated = train(str(data), tmp_path / "c", *run, "--max_steps", "0", "--eval_interval", "1", "--init_from", hf_dir)
    val = ShardLoader(list_shards(str(data), "val"), 8, 32, shuffle=False)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
                  for x, y in (val.next_batch() for _ in range(2))]
    assert evaluated[0]["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    missing = tmp_path / "missing.pt"
    capsys.readouterr()
    assert error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "d", "--init_from", missing) == (
        f"error: --init_from: {missing}: no such checkpoint")


def test_init_from_says_what_it_replaces_of_a_presets_model(tmp_path, capsys):
    """--preset gpt2-medium --init_from a small checkpoint trains the checkpoint's model: one line
    says so, with both sizes (here before the missing data stops the run)."""
    model = make_tiny_gpt(block_size=1024)
    small = save_as_checkpoint(model, tmp_path / "small.pt")
    with pytest.raises(SystemExit):
        train_gpt2.main(["--preset", "gpt2-medium", "--init_from", small, "--device", "cpu",
                         "--data_dir", str(tmp_path / "none"), "--log_dir", str(tmp_path / "log")])
    out, err = capsys.readouterr()
    assert err.startswith("error: no *_train_*.npy shards")
    assert (f"note: --init_from {small} replaces the model of --preset gpt2-medium (354,871,296 parameters: 24 "
            f"layers, 16 heads, 1024 wide, context 1024, vocabulary 50304) with its own "
            f"({sum(p.numel() for p in model.parameters()):,} parameters: 2 layers, 4 heads, 32 wide, context 1024, "
            f"vocabulary 50304); the other settings stay") in out.splitlines()
    # Flags that say what the checkpoint is: nothing replaced, whatever --dropout.
    cfg = train_gpt2.parse_args(["--n_layer", "2", "--n_head", "4", "--n_embd", "32", "--dropout", "0.1",
                                 "--init_from", small])
    assert loading.replaced_settings(cfg, model.config) is None


def test_dropout_resumes_exactly_in_one_process(shards, tmp_path):
    """With --dropout 0.1 the masks resume too: a run resumed from its checkpoint gives the
    uninterrupted run's per-step losses bit for bit, and its final weights."""
    run = ["--total_batch_size", "256", "-B", "8", "--max_steps", "8", "--dropout", "0.1"]
    full = train(shards, tmp_path / "full", *run, "--checkpoint_interval", "4")
    resumed = train(shards, tmp_path / "resumed", *run, "--resume", tmp_path / "full" / "ckpt_000004.pt")
    assert load_checkpoint(str(tmp_path / "full" / "ckpt_000004.pt")).state["config"]["dropout"] == 0.1
    assert [r["train_loss"] for r in train_records(resumed)] == [r["train_loss"] for r in train_records(full)][4:]
    for key, tensor in final_weights(tmp_path / "full", 8).items():
        assert torch.equal(tensor, final_weights(tmp_path / "resumed", 8)[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("scale", [[], ["--fsdp", "1"]], ids=["ddp", "fsdp"])
def test_dropout_resumes_exactly_on_2_ranks_each_drawing_its_own_masks(shards, tmp_path, capsys, scale):
    """Under DDP and FSDP on 2 ranks, a run resumed from its checkpoint gives the uninterrupted run's
    per-step losses bit for bit: the checkpoint holds each rank's random state, and the ranks' differ
    (their dropout masks are their own). Resumed in one process it says what is not reproduced."""
    run = [*TINY, "--data_dir", shards, "--total_batch_size", "256", "-B", "4", "--max_steps", "6", "--dropout", "0.1",
           *scale]
    full = run_ranks("train_gpt2.py", *run, "--checkpoint_interval", "3", "--log_dir", tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    saved = checkpoint_files.list_checkpoints(str(tmp_path / "full"))[0]
    resumed = run_ranks("train_gpt2.py", *run, "--resume", saved, "--log_dir", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [[r["train_loss"] for r in train_records(read_log(tmp_path / name))] for name in ("full", "resumed")]
    assert losses[1] == losses[0][3:]
    rng = load_checkpoint(saved).state["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])
    capsys.readouterr()
    one = train(shards, tmp_path / "one", "--total_batch_size", "256", "-B", "8", "--max_steps", "6",
                "--dropout", "0.1", "--resume", saved)
    assert [r["step"] for r in train_records(one)] == [3, 4, 5]
    assert (f"note: {saved} holds the random state of 2 rank(s), this run has 1: the weights, optimizer and data "
            f"resume as saved, but dropout's masks are drawn afresh, so the losses from here are not those of the "
            f"run uninterrupted") in capsys.readouterr().out.splitlines()


def test_dropout_flag_is_the_models_whatever_init_from_recorded(shards, tmp_path, hf_gpt2_dir):
    """--init_from takes the weights: a Hugging Face directory's pdrops (OpenAI's 0.1) and a
    checkpoint's recorded dropout give way to --dropout (default 0)."""
    hf, hf_dir = hf_gpt2_dir
    data = tmp_path / "vocab128"
    write_token_shards(data, vocab=hf.config.vocab_size)
    run = ["--total_batch_size", "256", "-B", "8", "--max_steps", "1"]
    train(str(data), tmp_path / "a", *run, "--init_from", hf_dir)
    assert load_checkpoint(str(tmp_path / "a" / "ckpt_000001.pt")).state["config"]["dropout"] == 0.0
    train(str(data), tmp_path / "b", *run, "--init_from", tmp_path / "a" / "ckpt_000001.pt", "--dropout", "0.2")
    assert load_checkpoint(str(tmp_path / "b" / "ckpt_000001.pt")).state["config"]["dropout"] == 0.2
    train(str(data), tmp_path / "c", *run, "--init_from", tmp_path / "b" / "ckpt_000001.pt")
    assert load_checkpoint(str(tmp_path / "c" / "ckpt_000001.pt")).state["config"]["dropout"] == 0.0


def test_val_loss_hellaswag_and_samples_run_without_dropout(shards, tmp_path):
    """Each runs in evaluation mode, then puts the model back to training: with dropout 0.5 they give
    what the same weights without dropout give."""
    examples = hellaswag.read_examples(write_jsonl(tmp_path / "examples.jsonl", EXAMPLES))
    results = []
    for dropout in (0.5, 0.0):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, dropout=dropout))
        trainable = build_trainable(model, "cpu", StepConfig(torch.float32, 4 * 32))
        loader = ShardLoader(list_shards(shards, "val"), 4, 32, shuffle=False)
        torch.manual_seed(dropout * 10)  # another random state: a mask drawn would differ
        results.append((train_gpt2.estimate_val_loss(trainable, loader, 2),
                        train_gpt2.hellaswag_accuracy(trainable, examples, 0, 1),
                        train_gpt2.sample_texts(trainable, seed=1)))
        assert model.training
    assert results[0] == results[1]


@pytest.mark.parametrize("value", ["-0.1", "1", "nan", "inf"])
def test_a_dropout_that_is_not_a_probability_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.parse_args(["--dropout", value])
    assert exit_info.value.code == 2
    assert re.search(r": error: --dropout must be a (probability in \[0, 1\)|finite number), not ",
                     capsys.readouterr().err.strip().splitlines()[-1])
