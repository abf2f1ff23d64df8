"""train_gpt2.py: schedule, data windows, accumulation, DDP on gloo, exact resume, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import atomic
import checkpoint
import devices
import distributed
import train_gpt2
from checkpoint import load_checkpoint
from conftest import REPO, listdir, run_script, run_torchrun, save_as_checkpoint, write_token_shards
from model import GPT, GPTConfig
from test_hellaswag import EXAMPLES, write_jsonl
from data import Shard, ShardError, ShardLoader, list_shards, shard_name, write_shard

TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--vocab_size", "256",
        "-T", "32", "--warmup_steps", "2", "--max_lr", "3e-3", "--hellaswag", "0", "--sample_interval", "0",
        "--compile", "0", "--device", "cpu", "--dtype", "float32", "--eval_interval", "0"]
TINY_CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    write_token_shards(directory)
    return str(directory)


def train(data_dir, log_dir, *flags):
    train_gpt2.main(TINY + ["--data_dir", data_dir, "--log_dir", str(log_dir), *map(str, flags)])
    return read_log(log_dir)


def read_log(log_dir):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(records):
    return [r for r in records if "train_loss" in r]


def final_weights(log_dir, step):
    return load_checkpoint(os.path.join(log_dir, f"ckpt_{step:06d}.pt"))["model"]


def assert_same_run(a, b, rel=1e-5):
    a, b = train_records(a), train_records(b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=rel)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=100 * rel)


def test_help_shows_every_flags_default_under_the_chosen_preset(capsys):
    with pytest.raises(SystemExit):
        train_gpt2.parse_args(["--preset", "demo", "--help"])
    out = capsys.readouterr().out
    assert "\n    torchrun --standalone --nproc_per_node=8 train_gpt2.py" in out  # the usage examples as written
    help_text = " ".join(out.split())
    assert "--log_dir LOG_DIR log.jsonl and checkpoints go here (default: log_demo)" in help_text
    assert "(default: None)" not in help_text and help_text.count("(default: max_steps)") == 1
    flags = [a for a in train_gpt2.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in flags if not a.help] == []


def test_lr_schedule_is_gpt2s():
    args = train_gpt2.parse_args([])
    assert train_gpt2.get_lr(0, args) == pytest.approx(6e-4 / 715)
    assert train_gpt2.get_lr(714, args) == pytest.approx(6e-4)
    assert train_gpt2.get_lr(715, args) == pytest.approx(6e-4)
    midway = 715 + (19073 - 715) // 2
    assert train_gpt2.get_lr(midway, args) == pytest.approx(3.3e-4, rel=1e-3)
    assert train_gpt2.get_lr(19072, args) == pytest.approx(6e-5, rel=1e-6)
    assert train_gpt2.get_lr(19073, args) == train_gpt2.get_lr(30000, args) == pytest.approx(6e-5)


def test_defaults_are_the_gpt2_124m_recipe():
    a = train_gpt2.parse_args([])
    assert (a.total_batch_size, a.micro_batch_size, a.seq_len, a.vocab_size) == (524288, 64, 1024, 50304)
    assert (a.n_layer, a.n_head, a.n_embd, a.max_steps, a.warmup_steps) == (12, 12, 768, 19073, 715)
    assert (a.weight_decay, a.grad_clip, a.seed, a.eval_interval, a.checkpoint_interval) == (0.1, 1.0, 1337, 250, 5000)
    demo = train_gpt2.parse_args(["--preset", "demo", "--max_steps", "7"])
    assert demo.max_steps == 7 and demo.data_dir == os.path.join(REPO, "data", "shakespeare")


def test_demo_shards_that_cannot_be_written_are_one_line(tmp_path, monkeypatch, capsys):
    import fineweb

    def disk_full(path, tokens):
        raise OSError(f"{path}: cannot write the shard (No space left on device)")
    monkeypatch.setattr(fineweb, "write_shard", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(["--preset", "demo", "--data_dir", str(tmp_path / "data"), "--log_dir", str(tmp_path / "log")])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'data' / 'shakespeare_val_000000.npy'}: "
                                       f"cannot write the shard (No space left on device)\n")


def test_demo_shards_the_bundled_corpus_trains_and_samples(tmp_path, capsys):
    data_dir = tmp_path / "shakespeare"
    train_gpt2.main(["--preset", "demo", "--data_dir", str(data_dir), "--log_dir", str(tmp_path / "log"),
                     "--max_steps", "3", "--eval_interval", "3", "--sample_interval", "3", "--val_steps", "2",
                     "--hellaswag_path", str(tmp_path / "absent.jsonl")])
    out = capsys.readouterr().out
    assert "skipping HellaSwag" in out
    assert [os.path.basename(p) for p in sorted(os.listdir(data_dir)) if p.endswith(".npy")][:2] == [
        "shakespeare_train_000001.npy", "shakespeare_train_000002.npy"]
    assert len([p for p in os.listdir(data_dir) if p.endswith(".npy")]) == 11  # 338,026 tokens in 32,768s
    records = read_log(tmp_path / "log")
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3]
    samples = next(r["samples"] for r in records if "samples" in r)
    assert len(samples) == 4 and all(s.startswith("Hello, I'm a language model,") for s in samples)
    assert os.path.exists(tmp_path / "log" / "ckpt_000003.pt")


def test_max_steps_0_evaluates_the_starting_point_and_trains_nothing(shards, tmp_path):
    run = ["--total_batch_size", "256", "-B", "8", "--eval_interval", "4", "--val_steps", "2"]
    trained = train(shards, tmp_path / "run", *run, "--max_steps", "4")
    checkpoint_file = tmp_path / "run" / "ckpt_000004.pt"
    before = checkpoint_file.read_bytes()
    # A checkpoint, evaluated from another log_dir: the val loss its own run logged at that step.
    evaluated = train(shards, tmp_path / "eval", *run, "--max_steps", "0", "--resume", checkpoint_file)
    assert evaluated == [r for r in trained if r["step"] == 4 and "val_loss" in r]
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
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
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


def stream_loader(tmp_path, sizes, B, T, world_size, rank):
    """Shards whose tokens count up from 0 across files, so a token's value is its position."""
    start, paths = 0, []
    for i, n in enumerate(sizes):
        paths.append(str(tmp_path / shard_name("pos", "train", i + 1)))
        write_shard(paths[-1], np.arange(start, start + n))
        start += n
    return ShardLoader(paths, B, T, rank=rank, world_size=world_size, shuffle=False)


def test_a_files_split_is_the_last_split_word_in_its_name(tmp_path):
    names = ["a_train_x_val_000000.npy", "a_train_x_train_000001.npy", "b_val_y_train_000001.npy",
             "c_val_000000.npy", "notes_train.npy", "d_train_000001.npy.tmp"]
    for name in names:
        (tmp_path / name).touch()
    listed = {split: [os.path.basename(p) for p in list_shards(str(tmp_path), split)] for split in ("train", "val")}
    assert listed == {"train": ["a_train_x_train_000001.npy", "b_val_y_train_000001.npy"],
                      "val": ["a_train_x_val_000000.npy", "c_val_000000.npy"]}


def test_loader_windows_are_disjoint_across_ranks_and_cross_shards(tmp_path):
    B, T, sizes = 2, 8, [50, 13, 70]  # 133 tokens: 8 windows of 16, the middle shard smaller than one
    loaders = [stream_loader(tmp_path, sizes, B, T, world_size=2, rank=r) for r in range(2)]
    seen = []
    for _ in range(loaders[0].batches_per_epoch):
        for loader in loaders:
            x, y = loader.next_batch()
            assert x.shape == y.shape == (B, T)
            assert torch.equal(y.flatten(), x.flatten() + 1)  # targets are the next tokens, across boundaries
            seen.append(x.flatten())
    # Ranks interleave window by window; together they read the whole stream once, nothing twice.
    assert torch.equal(torch.cat(seen), torch.arange(8 * B * T))
    # Then the next epoch starts from the beginning.
    assert loaders[1].next_batch()[0].flatten()[0] == B * T
    assert loaders[1].epoch == 1


FEW_DESCRIPTORS = """
import resource, sys
import numpy as np, torch
sys.path.insert(0, {repo!r})
from data import ShardLoader

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
loader = ShardLoader(sys.argv[1:], B=2, T=8, shuffle=False)
seen = [loader.next_batch()[0].flatten() for _ in range(loader.batches_per_epoch)]
assert torch.equal(torch.cat(seen), torch.arange(loader.batches_per_epoch * 16))
"""


def test_loader_over_more_shards_than_open_files_allowed(tmp_path):
    paths = []
    for i in range(100):  # 10 tokens each, counting up across files: a token's value is its position
        paths.append(str(tmp_path / shard_name("pos", "train", i + 1)))
        write_shard(paths[-1], np.arange(10 * i, 10 * i + 10))
    result = subprocess.run([sys.executable, "-c", FEW_DESCRIPTORS.format(repo=REPO), *paths],
                            capture_output=True, text=True, timeout=120)  # the limit stays in the child
    assert result.returncode == 0, result.stderr


def test_loader_resumes_at_its_position(tmp_path):
    loader = stream_loader(tmp_path, [100, 100], B=2, T=4, world_size=1, rank=0)
    for _ in range(30):  # past the end of the first epoch
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()[0] for _ in range(5)]
    other = stream_loader(tmp_path, [100, 100], B=2, T=4, world_size=1, rank=0)
    other.load_state_dict(state)
    assert all(torch.equal(a, other.next_batch()[0]) for a in expected)


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


def test_ddp_on_two_processes_equals_one_process(shards, tmp_path):
    # Two micro-steps a step on both sides: the first under no_sync, gradients as bucket views.
    # Val: 2 micro-batches of 4x32 on one process, 2 of 2x32 on each of two ranks: the same 256 tokens.
    evals = ["--eval_interval", "4", "--val_steps", "2"]
    single = train(shards, tmp_path / "single", "--total_batch_size", "256", "-B", "4", "--max_steps", "4", *evals)
    result = run_torchrun("train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir", tmp_path / "ddp",
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


def test_a_cuda_process_sets_its_device(monkeypatch):
    """Each process on CUDA makes its device current before any collective or allocation (on a GPU
    machine this path once failed at its first line: a function-local import had made torch local)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    current = []
    monkeypatch.setattr(distributed, "pick_device", lambda arg, local_rank: "cuda:1")
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert distributed.setup("cuda:1") == (0, 0, 1, "cuda:1") and current == ["cuda:1"]


def test_ddp_gradients_stay_in_its_buckets_across_steps(shards):
    """With gradient_as_bucket_view, DDP's all-reduce buckets are the gradients: every micro-step
    of every step accumulates into them, never into a second, freshly allocated set."""
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (see distributed.setup)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raw_model = GPT(GPTConfig(**TINY_CONFIG))
        model = DDP(raw_model, gradient_as_bucket_view=True)  # as build_trainable wraps it on 2 ranks or more
        t = train_gpt2.Trainable(model, raw_model, raw_model.configure_optimizers(0.1, 1e-3, "cpu"),
                                 torch.amp.GradScaler("cpu", enabled=False), "cpu", torch.float32, 2, 1.0)
        loader = ShardLoader(list_shards(shards, "train"), 2, 32)
        where = []  # the gradient's storage after each micro-step's accumulation
        raw_model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: where.append(p.grad.data_ptr()))
        for step in range(2):
            assert not train_gpt2.train_step(t, loader, 1e-3).skipped
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
    state = checkpoint.training_state(model, fused, scaler, 3, loader, train_gpt2.parse_args([]))
    optimizer = model.configure_optimizers(0.1, 1e-3, "cpu")
    assert checkpoint.restore_training(state, "ckpt", model, optimizer, scaler, loader) == 3
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(False, None)] * 2


def test_resume_auto_truncates_the_log_to_the_checkpoint(shards, tmp_path):
    train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "8", "--checkpoint_interval", "4")
    os.remove(tmp_path / "ckpt_000008.pt")  # as if the run died after step 8's log lines but before its checkpoint
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 9, "tokens": 1, "train_')  # and mid-way through a line
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "8")
    assert [r["step"] for r in train_records(records)] == list(range(8))


def run_cli(*flags):
    return run_script("train_gpt2.py", *TINY, *flags)


def one_line_error(result):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def error_of(capsys, *flags):
    """The one line on stderr with which train_gpt2.main(TINY + flags) exits non-zero, in-process."""
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(TINY + [str(f) for f in flags])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_fails_with_one_line(shards, tmp_path, capsys):
    message = one_line_error(run_cli("--data_dir", tmp_path / "empty", "--log_dir", tmp_path / "log"))
    assert "no *_train_*.npy shards" in message and "python fineweb.py" in message
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
    state = load_checkpoint(str(tmp_path / "ckpt_000003.pt"))
    state["rng"]["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    model = GPT(GPTConfig(**TINY_CONFIG))
    loader = ShardLoader(list_shards(shards, "train"), 8, 32)
    step = checkpoint.restore_training(state, "ckpt", model, model.configure_optimizers(0.1, 1e-3, "cpu"),
                                       torch.amp.GradScaler("cpu", enabled=False), loader)
    assert step == 3 and len(restored) == 1 and torch.equal(restored[0], state["rng"]["cuda"][0])


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


def epoch_windows(loader):
    """The first token of every window one loader reads in its current epoch."""
    epoch = loader.epoch
    firsts = []
    while loader.index < loader.batches_per_epoch:
        firsts.append(int(loader.next_batch()[0][0, 0]))
    assert loader.epoch == epoch
    return firsts


def test_epochs_after_the_first_are_shuffled_the_same_way_on_every_rank(tmp_path):
    sizes, B, T = [96, 160, 64, 129], 2, 8  # 28 windows of 16 tokens, and one token for the last target
    plain = stream_loader(tmp_path, sizes, B, T, world_size=1, rank=0)
    shuffled = [stream_loader(tmp_path, sizes, B, T, world_size=2, rank=r) for r in range(2)]
    for loader in shuffled:
        loader.shuffle = True
        loader.reset()
    first_epoch = sorted(epoch_windows(shuffled[0]) + epoch_windows(shuffled[1]))
    assert first_epoch == epoch_windows(plain)  # the first epoch stays in file order
    for epoch in (1, 2):
        for loader in shuffled + [plain]:
            loader.next_batch()  # crosses into the next epoch
            loader.load_state_dict({**loader.state_dict(), "index": 0})
        ranks = [epoch_windows(loader) for loader in shuffled]
        assert not set(ranks[0]) & set(ranks[1])  # still disjoint across ranks
        together = [w for pair in zip(*ranks) for w in pair]
        assert len(together) == 28 and together != epoch_windows(plain)
        # Windows that start inside one shard stay together: a shard is read before the next.
        shard_of = np.searchsorted(np.cumsum(sizes), together, side="right")
        assert (np.diff(shard_of) != 0).sum() == len(sizes) - 1
    # The order depends on the seed and the epoch only.
    again = stream_loader(tmp_path, sizes, B, T, world_size=2, rank=0)
    again.shuffle = True
    again.load_state_dict({"epoch": 2, "index": 0, "tokens_per_index": 2 * B * T})
    assert epoch_windows(again) == ranks[0]
    again.seed = 7
    again.load_state_dict({"epoch": 2, "index": 0, "tokens_per_index": 2 * B * T})
    assert epoch_windows(again) != ranks[0]


def test_resume_is_exact_across_several_epochs(tmp_path):
    data = str(tmp_path / "data")
    write_token_shards(data, n_train=3, tokens_per_shard=600, n_val=600)  # 7 steps an epoch
    run = ["--total_batch_size", "256", "-B", "8", "--max_steps", "30"]
    full = train(data, tmp_path / "full", *run, "--checkpoint_interval", "10")
    resumed = train(data, tmp_path / "resumed", *run, "--resume", tmp_path / "full" / "ckpt_000010.pt")
    assert load_checkpoint(str(tmp_path / "full" / "ckpt_000030.pt"))["train_loader"]["epoch"] == 4
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
    print(f"the step runs through {{type(t.model).__name__}} of {{type(getattr(t.model, '_orig_mod', None)).__name__}}")
    return t
train_gpt2.build_trainable = build_trainable
train_gpt2.main()
"""


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
    result = run_torchrun(script, *flags, "--compile", "1", "--log_dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the step runs through OptimizedModule of DistributedDataParallel" in result.stdout
    eager = run_torchrun("train_gpt2.py", *flags, "--log_dir", tmp_path / "eager")
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert_same_run(read_log(tmp_path), read_log(tmp_path / "eager"))
    logged = [r for r in read_log(tmp_path) if "hellaswag_acc_norm" in r]
    assert [(r["step"], r["hellaswag_n"]) for r in logged] == [(0, 5), (2, 5)]
    saved = torch.load(tmp_path / "ckpt_000002.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(GPT(GPTConfig(**TINY_CONFIG)).state_dict())
    scored = run_script("hellaswag.py", "-m", tmp_path / "ckpt_000002.pt", "--data", examples,
                        "--json", tmp_path / "score.json", "--device", "cpu")
    assert scored.returncode == 0, scored.stderr
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
    newest = checkpoint.list_checkpoints(str(log_dir))[-1]
    loaded = checkpoint.load_model(newest).state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    records = train(shards, log_dir, "--total_batch_size", "256", "-B", "8", "--max_steps", "3")
    assert [r["step"] for r in train_records(records)][-1] == 2


def test_dtype_auto_is_bf16_only_on_gpus_with_bf16_tensor_cores(monkeypatch):
    from devices import pick_dtype
    for capability, dtype in [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)]:  # V100, T4: bf16 is only emulated there
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert pick_dtype("auto", "cuda") == dtype
    assert pick_dtype("auto", "cpu") == pick_dtype("auto", "mps") == torch.float32
    assert pick_dtype("float16", "cpu") == torch.float16


def test_compile_auto_is_on_for_cuda_only_and_says_why_not_elsewhere(monkeypatch):
    notes = []
    assert train_gpt2.resolve_compile("auto", "cuda", notes.append) is (sys.platform != "win32")
    assert train_gpt2.resolve_compile("auto", "cpu", notes.append) is False and notes == []
    assert train_gpt2.resolve_compile("auto", "mps", notes.append) is False
    assert notes == ["note: --compile auto stays off on MPS"]
    monkeypatch.setattr(train_gpt2.sys, "platform", "win32")
    assert train_gpt2.resolve_compile("auto", "cuda", notes.append) is False
    assert notes[-1] == "note: --compile auto stays off on Windows"
    assert train_gpt2.resolve_compile("1", "cpu", notes.append) is True


def test_mfu_peak_is_the_named_gpus_and_unknown_gpus_have_none(monkeypatch):
    from devices import peak_flops
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
             "NVIDIA L4": 121e12, "NVIDIA A10": 125e12, "NVIDIA GeForce RTX 4090": 165e12,
             "NVIDIA RTX A1000": None, "NVIDIA A10G": None, "Tesla V100-SXM2-16GB": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert peak_flops("cuda:0") == peak, name
    assert peak_flops("cpu") is None


def test_every_param_group_steps_at_the_scheduled_lr(shards, tmp_path, monkeypatch):
    """The lr each optimizer step runs at, in every param group, is get_lr(step)."""
    stepped = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        stepped.append([group["lr"] for group in self.param_groups])
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    flags = ["--total_batch_size", "256", "-B", "8", "--max_steps", "6", "--warmup_steps", "2"]
    records = train(shards, tmp_path, *flags)
    args = train_gpt2.parse_args(TINY + flags)
    expected = [train_gpt2.get_lr(step, args) for step in range(6)]
    assert len(set(expected)) == 5  # warmup to max_lr at step 2, then cosine
    assert [r["lr"] for r in train_records(records)] == pytest.approx(expected)
    assert stepped == [pytest.approx([lr, lr]) for lr in expected]  # both groups: decayed and not


class OneBatch:
    """A loader that gives the same batch every time."""
    def __init__(self, x, y):
        self.batch = x, y

    def next_batch(self):
        return self.batch

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_gradients_are_unscaled_then_clipped_and_the_norm_before_clipping_is_logged():
    model = GPT(GPTConfig(**TINY_CONFIG))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = model(x[:, :-1], x[:, 1:])[1].item()

    def step(grad_clip, scaler):
        # lr 0: the weights stay, so every call sees the same gradients; clipping leaves them in p.grad.
        t = train_gpt2.Trainable(model, model, model.configure_optimizers(0.1, 1e-3, "cpu"), scaler, "cpu",
                                 torch.float32, 1, grad_clip)
        result = train_gpt2.train_step(t, OneBatch(x[:, :-1], x[:, 1:]), lr=0.0)
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
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "ckpt_000006.pt", "ckpt_000008.pt"]
    assert load_checkpoint(str(tmp_path / "ckpt_000008.pt"))["step"] == 8


def test_loader_resumes_by_tokens_read_under_another_world_size_or_batch(tmp_path):
    one = stream_loader(tmp_path, [100, 100], B=2, T=4, world_size=1, rank=0)
    for _ in range(6):  # 6 windows of 8 tokens: 48 tokens read
        one.next_batch()
    state = one.state_dict()
    ranks = [stream_loader(tmp_path, [100, 100], B=2, T=4, world_size=2, rank=r) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    assert [int(loader.next_batch()[0][0, 0]) for loader in ranks] == [48, 56]
    assert ranks[0].state_dict() == {"epoch": 0, "index": 4, "tokens_per_index": 16}
    wider = stream_loader(tmp_path, [100, 100], B=4, T=4, world_size=1, rank=0)
    wider.load_state_dict(state)
    assert int(wider.next_batch()[0][0, 0]) == 48


def test_ranks_leave_the_leftover_window_and_start_the_next_epoch_together(tmp_path):
    B, T = 2, 4  # 57 tokens: 7 windows of 8; two ranks read 3 each, and window 6 is left over
    loaders = [stream_loader(tmp_path, [57], B, T, world_size=2, rank=r) for r in range(2)]
    assert [loader.batches_per_epoch for loader in loaders] == [3, 3]
    firsts = [[int(loader.next_batch()[0][0, 0]) for _ in range(4)] for loader in loaders]
    assert firsts == [[0, 16, 32, 0], [8, 24, 40, 8]]
    assert [loader.epoch for loader in loaders] == [1, 1]


def test_each_epoch_is_shuffled_anew(tmp_path):
    loader = stream_loader(tmp_path, [96, 160, 64, 129], B=2, T=8, world_size=1, rank=0)
    loader.shuffle = True
    orders = []
    for epoch in (1, 2, 3):
        loader.load_state_dict({"epoch": epoch, "index": 0, "tokens_per_index": 16})
        orders.append(epoch_windows(loader))
    assert [len(order) for order in orders] == [28, 28, 28]
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]


def test_a_token_id_equal_to_vocab_size_is_out_of_range(tmp_path):
    path = str(tmp_path / shard_name("pos", "train", 1))
    write_shard(path, np.r_[np.arange(100), 256, np.arange(100)])
    Shard(path).check_ids(257)
    with pytest.raises(ShardError, match="token id 256 at position 100 is >= vocab_size 256"):
        Shard(path).check_ids(256)


def test_the_loader_checks_the_ids_it_reads(tmp_path):
    """A bad id the quick check sampled past stops training when a batch reaches it."""
    path = str(tmp_path / shard_name("pos", "train", 1))
    write_shard(path, np.r_[np.zeros(40), 999, np.zeros(40)])
    loader = ShardLoader([path], B=2, T=8, shuffle=False, vocab_size=256)
    loader.next_batch()  # tokens 0..16
    loader.next_batch()  # 16..32
    with pytest.raises(ShardError, match="token id 999 at position 40"):
        loader.next_batch()  # 32..48


def test_the_quick_check_reads_the_middle_and_the_end(tmp_path):
    path = str(tmp_path / shard_name("pos", "train", 1))
    for position in (150_000, 299_999):
        tokens = np.zeros(300_000)
        tokens[position] = 999
        write_shard(path, tokens)
        with pytest.raises(ShardError, match=f"at position {position} "):
            Shard(path).check_ids(256)


def test_write_shard_refuses_ids_outside_uint16(tmp_path):
    path = str(tmp_path / "x_train_000001.npy")
    for bad in ([1, 65536], [-1, 5]):
        with pytest.raises(ValueError, match="does not fit in uint16"):
            write_shard(path, np.array(bad))
        assert not os.path.exists(path)
    write_shard(path, np.array([0, 65535]))
    assert np.load(path).tolist() == [0, 65535]


def test_a_padded_shard_is_refused(tmp_path):
    path = str(tmp_path / "x_train_000001.npy")
    write_shard(path, np.arange(10))
    with open(path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ShardError, match="truncated or padded"):
        Shard(path)


def test_bad_steps_must_be_in_a_row_to_stop_the_run(shards, tmp_path):
    records = train(shards, tmp_path, "--total_batch_size", "256", "-B", "8", "--max_steps", "5",
                    "--max_bad_steps", "2", "--fault", "nan@1", "--fault", "nan@3")
    assert [(r["step"], r["bad_steps"]) for r in records if r.get("skipped_step")] == [(1, 1), (3, 1)]
    assert [r["step"] for r in train_records(records)] == [0, 2, 4]


def test_under_torchrun_each_process_takes_its_own_gpu_and_no_other(monkeypatch):
    tried = []
    monkeypatch.setattr(devices.torch, "empty", lambda *shape, device: tried.append(device))
    assert devices.pick_device("cuda", local_rank=3) == "cuda:3" and tried == ["cuda:3"]
    assert devices.pick_device("cuda:3", local_rank=3) == "cuda:3"
    with pytest.raises(ValueError, match=r"under torchrun each process takes cuda:LOCAL_RANK \(here cuda:3\)"):
        devices.pick_device("cuda:1", local_rank=3)
    assert devices.pick_device("cuda:1") == "cuda:1" and devices.pick_device("cuda") == "cuda:0"  # one process: any


def test_atomic_open_syncs_the_file_before_renaming_it(tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append((os.fstat(fd).st_size, os.path.exists(path)))
        real_fsync(fd)
    monkeypatch.setattr(atomic.os, "fsync", fsync)
    with atomic.atomic_open(path) as f:
        f.write(b"12345")
    assert synced == [(5, False)] and os.listdir(tmp_path) == ["f.bin"]


def test_check_writable_leaves_nothing_behind(tmp_path):
    path = tmp_path / "new" / "out.json"
    atomic.check_writable(str(path))
    assert os.listdir(tmp_path / "new") == []
    with pytest.raises(IsADirectoryError):
        atomic.check_writable(str(tmp_path / "new"))


def test_seed_sets_the_order_of_later_epochs(shards):
    def epoch_1_start(*flags):
        args = train_gpt2.parse_args(TINY + ["--data_dir", shards, "-B", "8", *flags])
        loader = train_gpt2.build_loaders(args, 0, 1, args.vocab_size, print)[0]
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
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.pt"]


def test_a_resumed_adamw_holds_its_state_as_this_machines_kernel_does(shards):
    """Optimizer.load_state_dict places each `step` counter by the flags of the groups it loads,
    so a run saved with one AdamW kernel and resumed with another must load under this machine's
    flags: after restore_training every state tensor has the device and dtype that the same
    optimizer, built fresh here and stepped once, holds. (On a GPU a CPU run's counters would stay
    on the CPU, under the fused kernel; on a CPU the same rule shows in the dtype: with float64 as
    the default dtype the foreach kernel counts in float64, the fused one in float32.)"""
    loader = ShardLoader(list_shards(shards, "train"), 2, 32)

    def stepped_once(fused):
        model = GPT(GPTConfig(**TINY_CONFIG))
        optimizer = model.configure_optimizers(0.1, 1e-3, "cpu", fused=fused)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        return model, optimizer

    torch.set_default_dtype(torch.float64)
    try:
        saved_model, saved_optimizer = stepped_once(fused=False)
    finally:
        torch.set_default_dtype(torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = checkpoint.training_state(saved_model, saved_optimizer, scaler, 1, loader, train_gpt2.parse_args([]))
    _, fresh = stepped_once(fused=True)
    model = GPT(GPTConfig(**TINY_CONFIG))
    resumed = model.configure_optimizers(0.1, 1e-3, "cpu", fused=True)
    checkpoint.restore_training(state, "ckpt", model, resumed, scaler, loader)

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
    monkeypatch.setattr(train_gpt2, "synchronize", lambda device: events.append(("synchronize", device)))
    model = GPT(GPTConfig(**TINY_CONFIG))
    optimizer = model.configure_optimizers(0.1, 1e-3, "cpu")
    optimizer.register_step_post_hook(lambda *_: events.append(("optimizer step",)))
    t = train_gpt2.Trainable(model, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), "cpu",
                             torch.float32, 2, 1.0)
    train_gpt2.train_step(t, ShardLoader(list_shards(shards, "train"), 2, 32), 1e-3)
    assert events == [("optimizer step",), ("synchronize", "cpu")]


def test_a_stop_request_drops_the_step_in_flight_and_rewinds_the_loader(shards):
    """Asked to stop before its third micro-step, train_step returns None having changed nothing:
    the next step (of the resumed run) reads the same batches and gets the same result."""
    def trainable():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY_CONFIG))
        return train_gpt2.Trainable(model, model, model.configure_optimizers(0.1, 1e-3, "cpu"),
                                    torch.amp.GradScaler("cpu", enabled=False), "cpu", torch.float32, 4, 1.0)
    dropped, plain = trainable(), trainable()
    loaders = [ShardLoader(list_shards(shards, "train"), 2, 32) for _ in range(2)]
    asked = iter([False, False, True])
    assert train_gpt2.train_step(dropped, loaders[0], 1e-3, lambda: next(asked)) is None
    assert loaders[0].state_dict() == loaders[1].state_dict()
    assert not dropped.optimizer.state and all(torch.equal(a, b) for a, b in
                                               zip(dropped.model.parameters(), plain.model.parameters()))
    results = [train_gpt2.train_step(t, loader, 1e-3) for t, loader in zip((dropped, plain), loaders)]
    assert results[0] == results[1]


NON_FINITE_ON_RANK_1 = """
import math, os, sys
sys.path.insert(0, {repo!r})
import torch
import checkpoint
import train_gpt2
real_save = checkpoint.Checkpointer.save


def save(self, step, t, train_loader, args):  # as if rank 1 alone had found its weights no longer finite
    if os.environ["RANK"] == "1":
        with torch.no_grad():
            t.raw_model.lm_head.weight[0, 0] = math.inf
    real_save(self, step, t, train_loader, args)
checkpoint.Checkpointer.save = save
train_gpt2.main()
"""


def test_a_refusal_on_one_rank_stops_every_rank_at_once(shards, tmp_path):
    """Non-finite weights found by one rank at checkpoint time: every rank stops with the same
    one-line error, rank 0 writes nothing, and no rank is left waiting for a collective."""
    script = tmp_path / "non_finite.py"
    script.write_text(NON_FINITE_ON_RANK_1.format(repo=REPO))
    result = run_torchrun(script, *TINY, "--data_dir", shards, "--log_dir", tmp_path / "log",
                          "--total_batch_size", "128", "-B", "2", "--max_steps", "4", "--checkpoint_interval", "2",
                          timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("error: the weights at step 2 are not finite: not checkpointing them") == 1
    assert "exitcode  : 1" in result.stderr and checkpoint.list_checkpoints(str(tmp_path / "log")) == []


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
    state = load_checkpoint(str(tmp_path / "b" / "ckpt_000002.pt"))
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
