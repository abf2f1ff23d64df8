"""data.py: shard names and splits, the shard loader's windows across shards and ranks, its
epochs and shuffling, resuming it, and the checks of a shard's ids and size."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpt2repro.lm.data import Shard, ShardError, ShardLoader, list_shards, shard_name, write_shard
from helpers import REPO


def stream_loader(tmp_path, sizes, B, T, world_size, rank):
    """Shards whose tokens count up from 0 across files, so a token's value is its position."""
    start, paths = 0, []
    for i, n in enumerate(sizes):
        paths.append(str(tmp_path / shard_name("pos", "train", i + 1)))
        write_shard(paths[-1], np.arange(start, start + n))
        start += n
    return ShardLoader(paths, B, T, rank=rank, world_size=world_size, shuffle=False)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_loader_resized_mid_epoch_reads_the_same_tokens_in_smaller_batches(tmp_path, world_size):
    """What an out-of-memory step halves to (step.train_step_fitting): the step's tokens over all
    ranks, in twice the micro-batches of half the sequences, and the same stream after it."""
    def step_tokens(loaders, micro_steps):
        return torch.cat([loader.next_batch()[0].flatten() for _ in range(micro_steps) for loader in loaders]).sort()[0]
    B, T, sizes = 4, 8, [200, 90, 230]
    whole = [stream_loader(tmp_path, sizes, B, T, world_size, r) for r in range(world_size)]
    halved = [stream_loader(tmp_path, sizes, B, T, world_size, r) for r in range(world_size)]
    assert torch.equal(step_tokens(whole, 2), step_tokens(halved, 2))
    tokens = 2 * world_size * B * T  # a step of two micro-batches
    assert [loader.micro_steps(tokens) for loader in halved] == [2] * world_size
    for loader in halved:
        loader.resize(B // 2)
    assert [loader.micro_steps(tokens) for loader in halved] == [4] * world_size
    for _ in range(2):
        expected = step_tokens(whole, 2)
        assert torch.equal(step_tokens(halved, 4), expected)
        assert torch.equal(expected, torch.arange(expected[0], expected[0] + 2 * world_size * B * T))
    assert halved[0].batches_per_epoch == (sum(sizes) - 1) // (B // 2 * T) // world_size


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
from gpt2repro.lm.data import ShardLoader

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
loader = ShardLoader(sys.argv[1:], B=2, T=8, shuffle=False)
seen = [loader.next_batch()[0].flatten() for _ in range(loader.batches_per_epoch)]
assert torch.equal(torch.cat(seen), torch.arange(loader.batches_per_epoch * 16))
"""


@pytest.mark.slow
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


def test_every_position_a_run_leaves_is_one_its_steps_reach_and_an_epoch_more_or_less_is_not(tmp_path):
    """step_problem, against what the steps imply: the positions of a run through three epochs
    (shuffled from the second) pass, on one grid of micro-batches, after -B auto halved the
    micro-batch mid-epoch, and after a resume on 2 ranks carried the position over by tokens;
    the same position an epoch on or back, or at index 0, does not."""
    T, tokens_per_step, sizes = 8, 64, [200, 90, 230]  # 519 tokens: 8 steps an epoch
    loader = stream_loader(tmp_path, sizes, B=8, T=T, world_size=1, rank=0)
    loader.shuffle = True
    paths = [shard.path for shard in loader.shards]
    for step in range(1, 30):
        for _ in range(loader.micro_steps(tokens_per_step)):
            loader.next_batch()
        if step == 5:
            loader.resize(4)
        if step == 15:
            elastic = ShardLoader(paths, 4, T, rank=0, world_size=2)  # rank 0's view of the same position
            elastic.load_state_dict(loader.state_dict())
            loader = elastic
        state = loader.state_dict()
        assert loader.step_problem(state, step, tokens_per_step, T) is None, (step, state)
        for wrong in ({"epoch": state["epoch"] + 1}, {"epoch": state["epoch"] - 1}, {"index": 0}):
            if wrong.get("epoch", 0) >= 0:
                assert loader.step_problem({**state, **wrong}, step, tokens_per_step, T) is not None, (step, wrong)
    assert loader.epoch == 3


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


def test_gpt2s_padding_ids_are_refused_in_both_check_modes_and_while_reading(tmp_path):
    """Ids 50257-50303 exist only to pad GPT-2's table to 50304 rows: a shard holding one is
    from another tokenizer, or damaged, whichever way it is read."""
    path = str(tmp_path / shard_name("pos", "train", 1))
    write_shard(path, np.r_[np.zeros(40), 50256, np.zeros(40)])  # <|endoftext|>, GPT-2's last real id
    Shard(path).check_ids(50304, full=True)
    write_shard(path, np.r_[np.zeros(40), 50257, np.zeros(40)])
    padding_row = ("token id 50257 at position 40 is a padding row: ids 50257-50303 only pad the embedding "
                   "to 50304 rows, and no GPT-2 tokenizer emits them")
    for full in (False, True):
        with pytest.raises(ShardError, match=f"^{path}: {padding_row}"):
            Shard(path).check_ids(50304, full=full)
    loader = ShardLoader([path], B=2, T=8, shuffle=False, vocab_size=50304)
    loader.next_batch(), loader.next_batch()
    with pytest.raises(ShardError, match=padding_row):
        loader.next_batch()
    with pytest.raises(ShardError, match="token id 50257 at position 40 is >= vocab_size 50257"):
        Shard(path).check_ids(50257)


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
