"""fsdp.py, through --fsdp 1 on CPU with gloo: FSDP2 training equals one process, the
meta-device init equals the eager one, and sharded checkpoints resume exactly on the same and on
other numbers of ranks."""
import json
import os
import pickle
import shutil

import pytest
import torch

import checkpoint as converter
import hellaswag
from gpt2repro.runs import checkpoint, checkpoint_files, loading
from helpers import REPO
from helpers.files import EXAMPLES, WritesAFile, declare_bytes, listdir, write_jsonl
from helpers.processes import exit_message, run_ranks
from helpers.runs import COMPILED_TRAIN, TINY, assert_same_run, error_of, read_log, train, train_records

RUN = ["--total_batch_size", "256", "--warmup_steps", "2"]


def torchrun(*flags, nproc=2):
    result = run_ranks("train_gpt2.py", *TINY, *RUN, *flags, nproc=nproc, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr  # FSDP's about the logits' view, for one
    return result


def runs_side_by_side(shards, tmp, *flags):
    """(one process, FSDP on 2 ranks), each as (log_dir, records), with the same global batch:
    2 micro-steps of 4 sequences, or on each rank of 2."""
    single = train(shards, tmp / "single", *RUN, *flags, "-B", "4")
    torchrun("--data_dir", shards, *flags, "-B", "2", "--fsdp", "1", "--log_dir", tmp / "fsdp")
    return (tmp / "single", single), (tmp / "fsdp", read_log(tmp / "fsdp"))


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_as_one_process(shards, tmp_path):
    """Sharded from a meta-device build, recomputing attention, with the chunked loss: over 10 steps of 2 micro-steps, the per-step losses and
    grad norms of one process with the same global batch within float32 noise (which also needs
    the same initial weights), the same val loss and the same final weights."""
    (single_dir, single), (fsdp_dir, fsdp) = runs_side_by_side(shards, tmp_path, "--max_steps", "10",
                                                               "--eval_interval", "5", "--val_steps", "2",
                                                               "--recompute", "attn", "--loss", "chunked")
    assert_same_run(single, fsdp)
    assert_same_records(single, fsdp, "val_loss", steps=[0, 5, 10])
    assert sorted(listdir(fsdp_dir)) == ["ckpt_000010", "log.jsonl"]
    sharded = loading.load_model(str(fsdp_dir / "ckpt_000010")).state_dict()
    for key, tensor in loading.load_model(str(single_dir / "ckpt_000010.pt")).state_dict().items():
        assert torch.allclose(sharded[key], tensor, atol=1e-5), key


def assert_same_records(a, b, key, steps):
    a, b = [(r["step"], r[key]) for r in a if key in r], [(r["step"], r[key]) for r in b if key in r]
    assert [step for step, _ in a] == [step for step, _ in b] == steps
    assert [value for _, value in b] == pytest.approx([value for _, value in a], rel=1e-5)


@pytest.fixture(scope="module")
def evaluated_runs(shards, tmp_path_factory):
    """runs_side_by_side with HellaSwag and samples, at GPT-2's padded vocabulary; and the examples."""
    tmp = tmp_path_factory.mktemp("evaluated")
    examples = write_jsonl(tmp / "hellaswag.jsonl", EXAMPLES)
    runs = runs_side_by_side(shards, tmp, "--vocab_size", "50304", "--max_steps", "2", "--eval_interval", "2",
                             "--val_steps", "1", "--hellaswag", "1", "--hellaswag_path", examples, "--sample_interval", "2")
    return (*runs, examples)


@pytest.mark.slow
def test_fsdp_evaluates_hellaswag_and_samples_as_one_process(evaluated_runs):
    """Each rank scores an equal share of HellaSwag (one padded with an uncounted example: every
    forward gathers weights from all ranks), and every rank samples, rank 0 logging."""
    (_, single), (_, fsdp), _ = evaluated_runs
    for key in ("hellaswag_acc_norm", "hellaswag_acc", "hellaswag_n"):
        assert_same_records(single, fsdp, key, steps=[0, 2])
    assert [r["hellaswag_n"] for r in fsdp if "hellaswag_n" in r] == [len(EXAMPLES)] * 2  # 5 examples: 3 + 2
    assert [r["samples"] for r in fsdp if "samples" in r] == [r["samples"] for r in single if "samples" in r]


def test_a_sharded_checkpoint_and_its_one_file_conversion_score_alike(evaluated_runs, tmp_path):
    _, (fsdp_dir, fsdp), examples = evaluated_runs
    converter.main([str(fsdp_dir / "ckpt_000002"), str(tmp_path / "converted.pt")])
    scores = []
    for model in (fsdp_dir / "ckpt_000002", tmp_path / "converted.pt"):
        hellaswag.main(["-m", str(model), "--data", examples, "--json", str(tmp_path / "score.json"), "--device", "cpu"])
        scores.append(json.loads((tmp_path / "score.json").read_text()))
    assert scores[0] == scores[1]
    assert scores[0]["acc_norm"] == [r["hellaswag_acc_norm"] for r in fsdp if "hellaswag_acc_norm" in r][-1]
    state = checkpoint_files.load_checkpoint(str(tmp_path / "converted.pt")).state
    n_params = len(list(loading.load_model(str(tmp_path / "converted.pt")).parameters()))
    assert state["step"] == 2 and len(state["optimizer"]["state"]) == n_params


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_on_2_ranks_or_1_after_a_sigterm(shards, tmp_path):
    common = ["--data_dir", shards, "--max_steps", "8", "--checkpoint_interval", "4", "--fsdp", "1", "-B", "2"]
    torchrun(*common, "--log_dir", tmp_path / "full")
    full = train_records(read_log(tmp_path / "full"))
    # SIGTERM before step 5, checkpoints written in the background: every rank drops step 5, with a
    # complete ckpt_000005/, and the run goes on from there as if never stopped.
    torchrun(*common, "--async_checkpoint", "--fault", "sigterm@5", "--log_dir", tmp_path / "stopped")
    assert sorted(listdir(tmp_path / "stopped")) == ["ckpt_000004", "ckpt_000005", "log.jsonl"]
    for name in listdir(tmp_path / "full" / "ckpt_000004"):  # written in the background: the same files
        assert name in listdir(tmp_path / "stopped" / "ckpt_000004")
    assert_same_weights(tmp_path / "full" / "ckpt_000004", tmp_path / "stopped" / "ckpt_000004", atol=0)
    torchrun(*common, "--async_checkpoint", "--log_dir", tmp_path / "stopped")
    assert_same_run(full, read_log(tmp_path / "stopped"), rel=1e-6)  # the log was cut back to step 5
    assert_same_weights(tmp_path / "full" / "ckpt_000008", tmp_path / "stopped" / "ckpt_000008", atol=1e-6)
    # Resharded: one process, without FSDP, from the checkpoint 2 ranks wrote.
    one = train(shards, tmp_path / "one", *RUN, "--max_steps", "8", "--resume", tmp_path / "full" / "ckpt_000004", "-B", "8")
    assert_same_run([r for r in full if r["step"] >= 4], one)


@pytest.mark.slow
def test_compiled_blocks_under_fsdp_train_as_eager_and_keep_their_names(shards, tmp_path):
    """--compile 1 under FSDP (as on a GPU; dynamo's eager backend here) compiles each Block's
    forward: the losses are the eager run's, and the parameter names are GPT's, for the meta-device
    build that finds each by name and for the sharded checkpoint."""
    script = tmp_path / "train_compiled.py"
    script.write_text(COMPILED_TRAIN.format(repo=REPO))
    flags = [*TINY, *RUN, "--data_dir", shards, "--max_steps", "3", "--fsdp", "1", "-B", "2"]
    result = run_ranks(script, *flags, "--compile", "1", "--log_dir", tmp_path / "compiled", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the step runs through FSDPGPT of NoneType" in result.stdout  # the blocks are compiled, not the root
    torchrun("--data_dir", shards, "--max_steps", "3", "--fsdp", "1", "-B", "2", "--log_dir", tmp_path / "eager")
    assert_same_run(read_log(tmp_path / "eager"), read_log(tmp_path / "compiled"))
    assert_same_weights(tmp_path / "eager" / "ckpt_000003", tmp_path / "compiled" / "ckpt_000003", atol=1e-5)


def assert_same_weights(a, b, atol):
    a, b = loading.load_model(str(a)).state_dict(), loading.load_model(str(b)).state_dict()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


META_INIT = """
import sys
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from gpt2repro.common import distributed
from gpt2repro.training import fsdp
from model import GPT, GPTConfig
dist.init_process_group("gloo")
config = GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=24)  # 100 rows: uneven slices
torch.manual_seed(7)
model, init = fsdp.build_on_meta(config)
fsdp.apply_fsdp(model, torch.float32)
fsdp.materialize(model, init, "cpu")
after = torch.get_rng_state()
torch.manual_seed(7)
eager = GPT(config)
same = all(torch.equal(p.full_tensor(), eager.state_dict()[name]) for name, p in model.named_parameters())
print(f"rank {{dist.get_rank()}}: weights equal {{same}}, generator equal {{torch.equal(after, torch.get_rng_state())}}")
del model, init  # what holds the group goes first: its gloo threads are joined here, not at exit
distributed.leave()
"""


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_gets_the_weights_built_in_one_process(tmp_path):
    script = tmp_path / "meta_init.py"
    script.write_text(META_INIT.format(repo=REPO))
    result = run_ranks(script, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: weights equal True, generator equal True" in result.stdout


def test_sharded_checkpoint_errors_are_one_line_and_run_nothing(evaluated_runs, tmp_path, capsys):
    _, (fsdp_dir, _), _ = evaluated_runs
    assert exit_message(capsys, converter.main, fsdp_dir / "log.jsonl", tmp_path / "x.pt") == (
        f"checkpoint.py: error: {fsdp_dir / 'log.jsonl'}: not a sharded checkpoint (no train_state.pt)")
    crafted = tmp_path / "ckpt_000002"
    shutil.copytree(fsdp_dir / "ckpt_000002", crafted)

    class RunsCode:
        def __reduce__(self):
            return os.system, ("touch " + str(tmp_path / "ran"),)
    (crafted / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(checkpoint.CheckpointError, match=r"refused: its \.metadata is not DCP's plain metadata "
                                                         r"\(it would construct (posix|os)\.system\); nothing in it was run"):
        loading.load_model(str(crafted))
    assert not (tmp_path / "ran").exists()
    os.remove(crafted / ".metadata")
    assert "incomplete sharded checkpoint (no .metadata)" in exit_message(capsys, converter.main, crafted, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_fsdp_needs_torchrun_and_async_checkpoints_need_fsdp(shards, tmp_path, capsys):
    assert "--fsdp 1 shards over the ranks of torchrun" in error_of(capsys, "--data_dir", shards, "--log_dir",
                                                                    tmp_path, "--fsdp", "1")
    assert "--async_checkpoint writes sharded checkpoints: it needs --fsdp 1" in error_of(
        capsys, "--data_dir", shards, "--log_dir", tmp_path, "--async_checkpoint")


@pytest.mark.slow
def test_a_one_file_checkpoint_resumes_under_fsdp(shards, tmp_path):
    """AdamW's state in a one-file checkpoint is keyed by the parameters' order; FSDP's loader
    takes it by their names, each rank keeping its own slices."""
    single = train(shards, tmp_path / "single", *RUN, "--max_steps", "4", "--checkpoint_interval", "2", "-B", "4")
    torchrun("--data_dir", shards, "--max_steps", "4", "--resume", tmp_path / "single" / "ckpt_000002.pt",
             "-B", "2", "--fsdp", "1", "--log_dir", tmp_path / "fsdp")
    assert_same_run([r for r in single if r["step"] >= 2], read_log(tmp_path / "fsdp"))


@pytest.mark.slow
def test_a_crafted_sharded_checkpoint_runs_nothing_when_resumed_under_fsdp(shards, evaluated_runs, tmp_path):
    """Two ranks resume from a checkpoint whose .metadata declares a weight a "bytes" item stored
    in a pickle that would create a file: both refuse it before reading, and the run stops in one line."""
    _, (fsdp_dir, _), _ = evaluated_runs
    crafted = tmp_path / "ckpt_000002"
    shutil.copytree(fsdp_dir / "ckpt_000002", crafted)
    (crafted / "payload.distcp").write_bytes(pickle.dumps(WritesAFile(str(tmp_path / "ran"))))
    declare_bytes(crafted, "model.lm_head.weight", crafted / "payload.distcp")
    result = run_ranks("train_gpt2.py", *TINY, *RUN, "--vocab_size", "50304", "--fsdp", "1", "-B", "2",
                       "--data_dir", shards, "--log_dir", tmp_path / "log",
                       "--resume", crafted, timeout=180)
    assert result.returncode == 1
    assert (f"error: {crafted}: refused: its entry model.lm_head.weight is declared plain data where this model "
            f"holds a tensor; nothing was read") in result.stderr.splitlines()
    assert not (tmp_path / "ran").exists()
