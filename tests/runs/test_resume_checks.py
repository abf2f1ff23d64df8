"""Every number a resume trusts, checked against what the run that saved it implies: crafted
optimizer states (step counts, what they are keyed by, moments no clipped gradient reaches),
weights (their dtype, the tied head), the loader's position against the recorded step, and the
train shards it read, by content. Each crafted checkpoint here resumed with exit 0 before these
checks; now each is one line naming the checkpoint and the part. A genuine run's checkpoint always
resumes, exactly: under fp16 loss scaling, unclipped, past a skipped step."""
import os
import shutil

import pytest
import torch

from gpt2repro.runs import checkpoint, checkpoint_files, model_weights
from helpers import REPO
from helpers.files import WritesAFile, write_token_shards
from helpers.processes import run_ranks, said_errors
from helpers.runs import (RANK_STOPS, TINY, TINY_CONFIG, assert_same_run, error_of, final_weights, read_log, train,
                          train_records)
from model import GPT, GPTConfig

RUN = ["--total_batch_size", "256", "-B", "8", "--max_steps", "6", "--checkpoint_interval", "4"]
N_PARAMS = 28  # the tiny GPT's parameters: AdamW numbers them 0 to 27
EMBEDDING = 0  # AdamW's number of transformer.wte.weight, the first of its decayed group


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    """(records of a 6-step run, its checkpoint at step 4, one file)."""
    log_dir = tmp_path_factory.mktemp("run")
    records = train(shards, log_dir, *RUN)
    return records, log_dir / "ckpt_000004.pt"


def crafted(run, tmp_path, edit):
    """The run's checkpoint at step 4 as edit(state) leaves it, saved as tmp_path/crafted.pt."""
    state = checkpoint_files.load_checkpoint(str(run[1])).state
    edit(state)
    torch.save(state, tmp_path / "crafted.pt")
    return tmp_path / "crafted.pt"


def resume_error(shards, tmp_path, capsys, ckpt, *flags):
    """The one line with which a resume from ckpt stops, having trained nothing."""
    message = error_of(capsys, "--data_dir", shards, "--log_dir", tmp_path / "resumed", *RUN, "--resume", ckpt, *flags)
    assert not os.path.exists(tmp_path / "resumed" / "log.jsonl") or not train_records(read_log(tmp_path / "resumed"))
    return message


def every_count(value):
    def edit(state):
        for entry in state["optimizer"]["state"].values():
            entry["step"] = torch.tensor(value)
    return edit


def one_count(number, value):
    def edit(state):
        state["optimizer"]["state"][number]["step"] = torch.tensor(value)
    return edit


def rekeyed(key):
    def edit(state):
        adamw = state["optimizer"]["state"]
        state["optimizer"]["state"] = {key(number): entry for number, entry in adamw.items()}
    return edit


def half_dropped(state):
    adamw = state["optimizer"]["state"]
    state["optimizer"]["state"] = {number: entry for number, entry in adamw.items() if number < N_PARAMS // 2}


def stray_entry(state):
    """An entry of 33 MB under a number no parameter has: torch's load keeps it, and every later save."""
    state["optimizer"]["state"][999] = {"step": torch.tensor(4.0), "exp_avg": torch.zeros(2048, 4096),
                                        "exp_avg_sq": torch.zeros(2048, 4096)}


def moment_at(key, row, value):
    def edit(state):
        state["optimizer"]["state"][EMBEDDING][key][row, 5] = value
    return edit


def moment(key, value):
    return moment_at(key, 3, value)


def weight(name, change):
    def edit(state):
        state["model"][name] = change(state["model"][name])
    return edit


def position(**values):
    def edit(state):
        state["train_loader"].update(values)
    return edit


def recorded_step(step):
    def edit(state):
        state["step"] = step
    return edit


OPTIMIZER = "its optimizer cannot be restored"
LOADER = "its train_loader cannot be restored"
POSITION = "its position, epoch {epoch} and index {index} of 256 tokens, is not where {steps} steps of 256 tokens"


@pytest.mark.parametrize("edit, part, problem", [
    (every_count(1e30), OPTIMIZER, "its step count is 1e+30, past the 4 steps of the run that saved it"),
    (every_count(20.5), OPTIMIZER, "the state of transformer.wte.weight: step is 20.5, not a count of the steps it "
                                   "took (1 or more)"),
    (every_count(0.0), OPTIMIZER, "the state of transformer.wte.weight: step is 0, not a count of the steps it took "
                                  "(1 or more)"),
    (every_count(1e-42), OPTIMIZER, "the state of transformer.wte.weight: step is 1.00053e-42, not a count"),
    (one_count(5, 3.0), OPTIMIZER, "its step counts differ: 4 for transformer.wte.weight, 3 for"),
    (rekeyed(str), OPTIMIZER, "AdamW's state holds an entry keyed '0', which numbers none of its 28 parameters "
                              "(0 to 27)"),
    (rekeyed(lambda number: number + 1), OPTIMIZER, "AdamW's state holds an entry keyed 28, which numbers none"),
    (half_dropped, OPTIMIZER, "it holds no state for transformer.h.0.ln_2.weight, but holds one for "
                              "transformer.wte.weight: every step steps every parameter"),
    (stray_entry, OPTIMIZER, "AdamW's state holds an entry keyed 999, which numbers none of its 28 parameters"),
    (moment("exp_avg_sq", 3e38), OPTIMIZER, "the state of transformer.wte.weight: exp_avg_sq holds 3e+38, past what a "
                                            "running mean of squared gradients clipped at --grad_clip 1.0 "
                                            "reaches: 1"),
    (moment("exp_avg", -1e30), OPTIMIZER, "the state of transformer.wte.weight: exp_avg holds 1e+30, past what a "
                                          "running mean of gradients clipped at --grad_clip 1.0 reaches: 1"),
    (weight("transformer.ln_f.weight", lambda w: w > 0), "its model cannot be restored",
     "transformer.ln_f.weight is torch.bool, not a float dtype"),
    (weight("lm_head.weight", lambda w: w + 1), "its model cannot be restored",
     "lm_head.weight differs from transformer.wte.weight, which GPT-2's head is (one tensor, tied)"),
    (position(epoch=5), LOADER, POSITION.format(epoch=5, index=4, steps=4)),
    (position(epoch=2**62), LOADER, POSITION.format(epoch="4,611,686,018,427,387,904", index=4, steps=4)),
    (position(index=0), LOADER, POSITION.format(epoch=0, index=0, steps=4)),
    (position(index=1000, tokens_per_index=1), LOADER, "its tokens_per_index is 1: not a number of sequences of 32 "
                                                       "tokens (-T) that divides the 256 tokens of its run's step"),
    (recorded_step(0), OPTIMIZER, "its step count is 4, past the 0 steps of the run that saved it"),
    (recorded_step(10**18), LOADER, POSITION.format(epoch=0, index=4, steps="1,000,000,000,000,000,000")),
], ids=["counts of 1e30", "counts of 20.5", "counts of 0", "counts of 1e-42", "mixed counts", "keyed by strings",
        "shifted ids", "half missing", "a stray id's 33 MB", "exp_avg_sq of 3e38", "exp_avg of -1e30",
        "a bool ln_f.weight", "an lm_head that is not wte", "epoch 5", "epoch 2**62", "index 0",
        "tokens_per_index 1", "step 0", "step 10**18"])
def test_a_crafted_state_is_refused_in_one_line_naming_the_checkpoint_and_the_part(run, shards, tmp_path, capsys,
                                                                                    edit, part, problem):
    ckpt = crafted(run, tmp_path, edit)
    message = resume_error(shards, tmp_path, capsys, ckpt)
    assert message.startswith(f"error: {ckpt}: {part} ({problem}"), message


def test_moments_of_a_larger_grad_clip_resume_under_it(run, shards, tmp_path, capsys):
    """A run that lowered --grad_clip on resume keeps the larger clip's gradients in its moments for
    a while: its checkpoint is refused at the lower one it records, and resumes under the larger."""
    ckpt = crafted(run, tmp_path, moment("exp_avg_sq", 3.0))  # a gradient element of 1.7 reaches that
    assert resume_error(shards, tmp_path, capsys, ckpt).endswith(
        "exp_avg_sq holds 3, past what a running mean of squared gradients clipped at --grad_clip 1.0 reaches: 1)")
    records = train(shards, tmp_path / "resumed", *RUN, "--resume", ckpt, "--grad_clip", "2")
    assert [r["step"] for r in train_records(records)] == [4, 5]


def test_a_payload_in_a_crafted_optimizer_state_is_refused_and_never_run(run, shards, tmp_path, capsys):
    """A stray entry whose value would create a file when unpickled by a trusting loader."""
    marker = tmp_path / "ran"
    ckpt = crafted(run, tmp_path, lambda state: state["optimizer"]["state"].update({999: WritesAFile(str(marker))}))
    message = resume_error(shards, tmp_path, capsys, ckpt)
    assert message.startswith(f"error: {ckpt}: refused: not a plain-data checkpoint") and not marker.exists()


def shards_copy(shards, tmp_path, change):
    """A copy of the shards' directory as change(directory) leaves it."""
    directory = tmp_path / "data"
    shutil.copytree(shards, directory)
    change(directory)
    return directory


def swap_first_two(directory):
    first, second = directory / "tiny_train_000001.npy", directory / "tiny_train_000002.npy"
    os.rename(first, directory / "aside")
    os.rename(second, first)
    os.rename(directory / "aside", second)


def other_corpus(directory):
    """Shards of the same names and sizes (write_token_shards sizes them by index) but other tokens."""
    write_token_shards(directory, seed=1)


@pytest.mark.parametrize("change, problem", [
    (swap_first_two, "tiny_train_000001.npy holds what it read as train shard 2, not the shard it read as train shard "
                     "1 of 3: resume it on the shards it trained on"),
    (other_corpus, "tiny_train_000001.npy holds other tokens than the shard it read as train shard 1 of 3 (another "
                   "SHA-256 of its sampled tokens): resume it on the shards it trained on"),
    (lambda directory: os.remove(directory / "tiny_train_000003.npy"),
     "it read 3 train shards, this run's are 2 ("),
], ids=["swapped", "another corpus under the same names", "one fewer"])
def test_train_shards_other_than_those_the_run_read_are_refused_by_content(run, shards, tmp_path, capsys, change,
                                                                           problem):
    data = shards_copy(shards, tmp_path, change)
    message = error_of(capsys, "--data_dir", data, "--log_dir", tmp_path / "resumed", *RUN, "--resume", run[1])
    assert message.startswith(f"error: {run[1]}: {LOADER} (") and problem in message, message


def test_a_checkpoint_from_before_the_shards_record_resumes_with_a_note(run, shards, tmp_path, capsys):
    ckpt = crafted(run, tmp_path, lambda state: state["train_loader"].pop("shards"))
    records = train(shards, tmp_path / "resumed", *RUN, "--resume", ckpt)
    assert (f"note: {ckpt} records no identity of the train shards it read (saved before that record): resuming on "
            f"those of {shards} unchecked") in capsys.readouterr().out
    assert_same_run([r for r in run[0] if r["step"] >= 4], records)


def expanded(state):
    """The embedding's exp_avg as one number expanded to its shape (stride 0: torch.save keeps it
    so), and a LayerNorm's exp_avg and exp_avg_sq as one tensor of zeros: each then updated in place."""
    adamw = state["optimizer"]["state"]
    adamw[EMBEDDING]["exp_avg"] = adamw[EMBEDDING]["exp_avg"][0, :1].expand(adamw[EMBEDDING]["exp_avg"].shape)
    zeros = torch.zeros_like(adamw[N_PARAMS - 1]["exp_avg"])
    adamw[N_PARAMS - 1].update(exp_avg=zeros, exp_avg_sq=zeros)


def materialized(state):
    """expanded's values, each tensor of its own."""
    expanded(state)
    for entry in state["optimizer"]["state"].values():
        entry.update({key: value.clone() for key, value in entry.items()})


def test_state_tensors_that_are_views_or_share_memory_resume_as_tensors_of_their_own(run, shards, tmp_path):
    """An expanded exp_avg failed at the first step, in AdamW's lerp_, with a traceback; moments
    sharing memory would add up each other's updates without a word."""
    views = crafted(run, tmp_path, expanded)
    saved = checkpoint_files.load_checkpoint(str(views)).state["optimizer"]["state"]
    assert saved[EMBEDDING]["exp_avg"].stride() == (0, 0)
    os.rename(views, tmp_path / "views.pt")
    own = crafted(run, tmp_path, materialized)
    from_views = train(shards, tmp_path / "from_views", *RUN, "--resume", tmp_path / "views.pt")
    from_own = train(shards, tmp_path / "from_own", *RUN, "--resume", own)
    assert [r["train_loss"] for r in train_records(from_views)] == [r["train_loss"] for r in train_records(from_own)]
    for key, tensor in final_weights(tmp_path / "from_own", 6).items():
        assert torch.equal(final_weights(tmp_path / "from_views", 6)[key], tensor), key


@pytest.mark.parametrize("flags", [["--dtype", "float16"], ["--grad_clip", "0"]],
                         ids=["fp16 loss scaling", "unclipped"])
def test_a_genuine_checkpoint_resumes_exactly_also_past_a_skipped_step(shards, tmp_path, flags):
    """fp16's loss scaling (its gradients unscaled before the step, its first steps' overflows
    skipped by the scaler) and no clipping: their moments pass the bounds. A step skipped on a NaN
    counts in the run's steps, not in AdamW's, which then counts fewer."""
    full = train(shards, tmp_path / "full", *RUN, *flags, "--fault", "nan@1")
    saved = checkpoint_files.load_checkpoint(str(tmp_path / "full" / "ckpt_000004.pt")).state
    assert max(entry["step"].item() for entry in saved["optimizer"]["state"].values()) <= 3  # of 4 steps
    resumed = train(shards, tmp_path / "resumed", *RUN, *flags, "--resume", tmp_path / "full" / "ckpt_000004.pt")
    assert_same_run([r for r in full if r["step"] >= 4], resumed)


def test_a_sharded_checkpoint_whose_head_is_not_its_embedding_is_refused(tmp_path):
    """Read into the one tensor the head and the embedding share, one would overwrite the other
    unseen: each entry is read apart, and the two compared."""
    saved = GPT(GPTConfig(**TINY_CONFIG))
    saved.lm_head.weight = torch.nn.Parameter(saved.transformer.wte.weight.detach() + 1)  # untied, to save apart
    parts = {"model": model_weights.ModelPart(saved)}
    checkpoint_files.save_dcp(str(tmp_path / "ckpt"), {"model": parts["model"].dcp_state_dict()}, {})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint_files.load_parts(checkpoint_files.ShardedCheckpoint(str(tmp_path / "ckpt"), {}),
                                    {"model": model_weights.ModelPart(GPT(GPTConfig(**TINY_CONFIG)))})
    assert str(e.value) == (f"{tmp_path / 'ckpt'}: its model cannot be restored (lm_head.weight differs from "
                            f"transformer.wte.weight, which GPT-2's head is (one tensor, tied))")


@pytest.mark.slow
def test_a_moment_only_one_fsdp_rank_holds_stops_every_rank_with_one_line(run, shards, tmp_path):
    """Under FSDP each rank checks its own slices of the moments: rank 1's rows of the embedding
    hold the 3e38, and both ranks stop with the same line, none left waiting."""
    ckpt = crafted(run, tmp_path, moment_at("exp_avg_sq", 200, 3e38))
    script = tmp_path / "rank_stops.py"
    script.write_text(RANK_STOPS.format(repo=REPO))
    result = run_ranks(script, *TINY, *RUN, "-B", "4", "--fsdp", "1", "--data_dir", shards,
                       "--log_dir", tmp_path / "log", "--resume", ckpt, timeout=180)
    expected = (f"{ckpt}: its optimizer cannot be restored (the state of transformer.wte.weight: exp_avg_sq holds "
                f"3e+38, past what a running mean of squared gradients clipped at --grad_clip 1.0 reaches: 1)")
    assert sorted(line for line in result.stdout.splitlines() if "stops:" in line) == [
        f"rank 0 stops: {expected}", f"rank 1 stops: {expected}"], result.stdout[-3000:] + result.stderr[-3000:]
    assert said_errors(result.stderr) == [f"error: {expected}"]
