"""The token-shard format and the loader that reads it.

A shard is a 1-D uint16 numpy array in a .npy file (np.save's format) named
`{prefix}_{split}_{index:06d}.npy`, as in build-nanogpt's fineweb.py: shard 0
is `val`, every later one `train`. fineweb.py writes them; train_gpt2.py reads them.
"""
import glob
import hashlib
import os
import re
from functools import cached_property

import numpy as np

from gpt2repro import REPO
from gpt2repro.common.atomic import atomic_open
from gpt2repro.common.inputs import brief
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, get_encoding

TINY_SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare.txt")  # the demo corpus
SHARD_DTYPE = np.dtype("<u2")  # uint16: GPT-2's 50257 ids fit, at two bytes a token
SPLITS = ("train", "val")
MAX_EPOCH = 1 << 63  # a loader's epoch counts up from 0: past a 64-bit count is no run's, but a crafted file's
SAMPLE_TOKENS = 1 << 16  # of a shard, the quick id check and its fingerprint read the first, middle and last this many


class ShardError(ValueError):
    """A shard that cannot be trained on: unreadable, truncated, of the wrong type, or out of range."""


def shard_name(prefix, split, index):
    return f"{prefix}_{split}_{index:06d}.npy"


def split_of(index):
    """Shard 0 of a corpus is its val split, every later shard train."""
    return "val" if index == 0 else "train"


def write_shard(path, tokens):
    """Saves tokens as a shard atomically: a crash leaves the old file or none, never half a shard.
    A failed write (a full disk, a quota) raises OSError naming the shard and the cause."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(SHARD_DTYPE).max):
        raise ValueError(f"{path}: token id {tokens.max()} does not fit in uint16")
    tokens = tokens.astype(SHARD_DTYPE, order="C", copy=False)
    try:
        with atomic_open(path) as f:
            # np.save's bytes, but written by Python's file rather than numpy's tofile: on a full
            # disk tofile raises "N requested and M written", without the errno, or when the
            # shard fits in its stdio buffer, nothing at all, leaving the shard truncated.
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(tokens))
            f.write(tokens.data)
    except OSError as e:
        raise OSError(f"{path}: cannot write the shard ({e.strerror or e})") from e


def text_tokens(n):
    """n tokens of Tiny Shakespeare, repeated: text whose loss falls within a few steps, for
    benchmarks whose timed runs must show that they train (bench.py, peers.py)."""
    with open(TINY_SHAKESPEARE, encoding="utf-8") as f:
        tokens = np.array([EOT] + get_encoding().encode_ordinary(f.read()), dtype=SHARD_DTYPE)
    return np.resize(tokens, n)


def list_shards(data_dir, split):
    """The shards of one split in data_dir, in index order. A file's split is the last _train_ or
    _val_ in its name, so each file is in one split even when the prefix holds a split's name
    (shakes_train_x_val_000000.npy is val)."""
    names = glob.glob(os.path.join(glob.escape(data_dir), "*.npy"))
    return sorted(path for path in names if split_in_name(os.path.basename(path)) == split)


def split_in_name(name):
    match = re.match(rf".*_({'|'.join(SPLITS)})_", name)  # greedy: the last split word wins
    return match and match.group(1)


class Shard:
    """One shard on disk, read by positioned reads: memory stays a window, whatever its size.
    The file is open only during a read: a loader over FineWeb-Edu 100B's ~1000 shards would
    otherwise hold ~1000 descriptors and fail under the common `ulimit -n 1024`. A batch is one
    or two reads, so opening the file each time costs next to nothing."""

    def __init__(self, path):
        self.path = path
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO's open() would wait for a writer forever
            raise ShardError(f"{path}: not a regular file")
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran_order, dtype = read_header(f)
                self.offset, size = f.tell(), os.fstat(f.fileno()).st_size
        except (OSError, ValueError) as e:
            raise ShardError(f"{path}: not a readable .npy shard ({e})") from None
        if dtype != SHARD_DTYPE or len(shape) != 1 or fortran_order:
            raise ShardError(f"{path}: expected a 1-D uint16 array, found {dtype} of shape {shape}")
        self.n_tokens = shape[0]
        if self.n_tokens == 0:
            raise ShardError(f"{path}: empty shard")
        if size != self.offset + 2 * self.n_tokens:
            raise ShardError(f"{path}: truncated or padded: {size} bytes on disk, "
                             f"{self.offset + 2 * self.n_tokens} expected for {self.n_tokens} tokens")

    def read(self, start, count):
        with open(self.path, "rb") as f:
            f.seek(self.offset + 2 * start)
            tokens = np.fromfile(f, dtype=SHARD_DTYPE, count=count)
        if len(tokens) != count:  # the file shrank since it was checked: truncated by hand, or a full disk
            raise ShardError(f"{self.path}: truncated while training: {len(tokens)} of {count} tokens at position "
                             f"{start}; restore the shard and rerun to resume")
        return tokens

    def check_ids(self, vocab_size, full=False):
        """Raises ShardError naming the shard if an id is not one a model of vocab_size trains on
        (see check_ids). The quick check reads the first, middle and last 64K tokens; full=True
        reads every token."""
        chunk = 1 << 24 if full else SAMPLE_TOKENS
        for start in range(0, self.n_tokens, chunk) if full else self.sample_starts():
            check_ids(self.path, self.read(start, min(chunk, self.n_tokens - start)), start, vocab_size)

    def sample_starts(self):
        """Where the quick check's reads of SAMPLE_TOKENS start: the first, middle and last."""
        chunk = SAMPLE_TOKENS
        return sorted({0, max(0, self.n_tokens // 2 - chunk // 2), max(0, self.n_tokens - chunk)})

    def fingerprint(self):
        """The SHA-256 of the tokens the quick check reads, which tells this shard from another of
        its size (another cut of the corpus, another corpus, a shard swapped for its neighbour) at
        the cost of that check, all but free once it has run (the reads are cached): an edit
        between the samples passes."""
        digest = hashlib.sha256()
        for start in self.sample_starts():
            digest.update(self.read(start, min(SAMPLE_TOKENS, self.n_tokens - start)).tobytes())
        return digest.hexdigest()


def check_ids(path, tokens, start, vocab_size):
    """Raises ShardError if tokens, read from path at position start, hold an id that is not one
    of the tokenizer's: shards hold GPT-2's N_VOCAB ids, so a model of vocab_size trains on the
    ids below min(vocab_size, N_VOCAB). The rows of a padded table above N_VOCAB exist for speed
    alone: no tokenizer emits their ids, so one in a shard means another tokenizer or damage."""
    bound = min(vocab_size, N_VOCAB)
    if tokens.max() >= bound:
        bad = int(np.argmax(tokens >= bound))
        token = int(tokens[bad])
        why = (f"is >= vocab_size {vocab_size}" if token >= vocab_size else
               f"is a padding row: ids {N_VOCAB}-{vocab_size - 1} only pad the embedding to {vocab_size} rows, "
               f"and no GPT-2 tokenizer emits them (a shard of another tokenizer, or a damaged one)")
        raise ShardError(f"{path}: token id {token} at position {start + bad} {why}")


class ShardLoader:
    """Batches of B×T tokens (and the next-token targets) from a list of shards.

    The shards are one stream, in file order, cut into windows of B*T tokens; a window
    reads one token past its end for the targets and may cross into the next shard, so no
    token is dropped at a shard boundary. With W ranks, the i-th call of rank r returns
    window i*W + r: ranks read disjoint windows, and one process with W times the
    gradient accumulation reads the same windows in the same steps. At the end of the
    data an epoch ends and the next begins. From the second epoch on (when shuffle is on)
    the shard order and the order of the windows within each shard are permuted, by a
    permutation that depends only on seed and the epoch, so every rank derives the same one.
    Given vocab_size, every window read has its ids checked as Shard.check_ids does.
    """

    def __init__(self, paths, B, T, rank=0, world_size=1, seed=1337, shuffle=True, vocab_size=None):
        if not paths:
            raise ShardError("no shards given")
        self.shards = [Shard(p) for p in paths]
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.seed, self.shuffle, self.vocab_size = seed, shuffle, vocab_size
        self.n_tokens = sum(s.n_tokens for s in self.shards)
        self._cut_windows()
        if self.batches_per_epoch == 0:
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            raise ShardError(f"{paths[0]}{more}: {self.n_tokens} tokens, too few for one "
                             f"batch of B*T = {B * T} tokens on each of {world_size} rank(s)")
        self.epoch, self.index = 0, 0
        self._plan_epoch()

    def _cut_windows(self):
        self.n_windows = (self.n_tokens - 1) // (self.B * self.T)
        self.batches_per_epoch = self.n_windows // self.world_size

    def resize(self, B):
        """Batches of B sequences from here on, from the same position in tokens (load_state_dict):
        in an epoch in file order, B halved reads the same tokens in twice the batches."""
        state = self.state_dict()
        self.B = B
        self._cut_windows()
        self.load_state_dict(state)

    def _plan_epoch(self):
        """Shard order, where each shard starts in the stream, and the order of the windows."""
        n = len(self.shards)
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle and self.epoch > 0 else None
        self.order = rng.permutation(n) if rng is not None else np.arange(n)
        sizes = np.array([self.shards[i].n_tokens for i in self.order], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        window_starts = np.arange(self.n_windows, dtype=np.int64) * (self.B * self.T)
        if rng is None:
            self.windows = np.arange(self.n_windows)
            return
        # Permute the windows that begin in each shard among themselves: the epoch still
        # reads one shard at a time, which keeps reads local.
        owner = np.searchsorted(self.starts, window_starts, side="right") - 1
        self.windows = np.concatenate([rng.permutation(np.flatnonzero(owner == k)) for k in range(n)])

    def _read(self, start, count):
        """count tokens of this epoch's stream from position start, across shard boundaries."""
        pieces = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while count > 0:
            shard = self.shards[self.order[k]]
            offset = start - self.starts[k]
            n = min(count, shard.n_tokens - offset)
            pieces.append(shard.read(offset, n))
            if self.vocab_size is not None:
                check_ids(shard.path, pieces[-1], offset, self.vocab_size)
            start, count, k = start + n, count - n, k + 1
        return np.concatenate(pieces)

    def next_batch(self):
        """(x, y): int64 tensors of shape (B, T), y being x shifted by one token."""
        import torch  # here, not at the top: fineweb.py and its spawned workers need only the shard format

        if self.index >= self.batches_per_epoch:  # the leftover windows would leave ranks unequal
            self.epoch, self.index = self.epoch + 1, 0
            self._plan_epoch()
        window = self.windows[self.index * self.world_size + self.rank]
        self.index += 1
        buf = torch.from_numpy(self._read(int(window) * self.B * self.T, self.B * self.T + 1).astype(np.int64))
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "tokens_per_index": self.tokens_per_index}

    @property
    def tokens_per_index(self):
        """Tokens all ranks together read per call of next_batch."""
        return self.world_size * self.B * self.T

    def micro_steps(self, tokens_per_step):
        """Calls of next_batch, each rank's forward-backward passes, that make an optimizer step of
        tokens_per_step tokens over all ranks: the step's gradient accumulation at this B."""
        return tokens_per_step // self.tokens_per_index

    def position_problem(self, state):
        """Why state, a state_dict() to load, is not a position of this loader, or None: its
        epoch, index and tokens_per_index integers (not bools), the epoch a count below
        MAX_EPOCH, and the position they record, index calls of tokens_per_index tokens (1 or
        more) into the epoch, one that a loader over these shards reaches: before their end."""
        if not isinstance(state, dict):
            return f"it is {brief(state)}, not a dict"
        for key in ("epoch", "index", "tokens_per_index"):
            if type(state.get(key)) is not int:
                return f"its {key} is {brief(state.get(key))}, not an integer" if key in state else f"it holds no {key}"
        epoch, index, tokens = state["epoch"], state["index"], state["tokens_per_index"]
        if not 0 <= epoch < MAX_EPOCH:
            return f"its epoch is {brief(epoch)}, not a count of 0 or more below 2**63"
        if not 0 < tokens <= self.n_tokens:
            return f"its tokens_per_index is {brief(tokens)}, not 1 to {self.n_tokens:,}, what this run's shards hold"
        if not 0 <= index * tokens < self.n_tokens:
            return (f"its index is {brief(index)}, of {tokens:,} tokens each: a position outside this run's shards "
                    f"({self.n_tokens:,} tokens)")
        return None

    @cached_property
    def identity(self):
        """What tells these shards, in their order, from others under the same names: each one's
        size in tokens and fingerprint (Shard.fingerprint). A checkpoint records it beside the
        position, which means something of these shards alone."""
        return {"tokens": [int(shard.n_tokens) for shard in self.shards],
                "sha256": [shard.fingerprint() for shard in self.shards]}

    def identity_problem(self, saved):
        """Why saved, the identity of the shards a run read, is not these shards', or None, naming
        the first shard that differs and, where it holds the tokens of another of those, which."""
        if not (isinstance(saved, dict) and isinstance(saved.get("tokens"), list)
                and isinstance(saved.get("sha256"), list) and len(saved["tokens"]) == len(saved["sha256"])):
            return f"its record of the shards it read is {brief(saved)}, not each one's tokens and SHA-256"
        ours, n = self.identity, len(saved["tokens"])
        if n != len(self.shards):
            return (f"it read {n:,} train shards, this run's are {len(self.shards):,} ({self.shards[0].path}, ...): "
                    f"resume it on the shards it trained on")
        for k, shard in enumerate(self.shards):
            if ours["tokens"][k] == saved["tokens"][k] and ours["sha256"][k] == saved["sha256"][k]:
                continue
            read_there = f"the shard it read as train shard {k + 1} of {n}"
            if ours["sha256"][k] in saved["sha256"]:
                other = saved["sha256"].index(ours["sha256"][k]) + 1
                what = f"holds what it read as train shard {other}, not {read_there}"
            elif ours["tokens"][k] != saved["tokens"][k]:
                what = f"holds {ours['tokens'][k]:,} tokens, {read_there} held {brief(saved['tokens'][k])}"
            else:
                what = f"holds other tokens than {read_there} (another SHA-256 of its sampled tokens)"
            return f"{shard.path} {what}: resume it on the shards it trained on"
        return None

    def step_problem(self, state, steps, tokens_per_step, seq_len):
        """Why state (a position that position_problem passes) is not one that a run of steps
        steps of tokens_per_step tokens, in micro-batches of sequences of seq_len, leaves this
        loader at, or None. Its tokens_per_index is a whole number of sequences that divides a
        step, its index 1 or more (a step reads at least one micro-batch past the epoch's start),
        and its epoch and index account for the steps' tokens: exactly so where the micro-batch
        never changed (epochs of batches_per_epoch calls); where it did (an elastic resume, -B
        auto halving it), an epoch read from n_tokens - tokens_per_step (or half of n_tokens)
        to n_tokens - 1 tokens, and the index counts at most the tokens read since."""
        epoch, index, tokens = state["epoch"], state["index"], state["tokens_per_index"]
        if tokens % seq_len or tokens_per_step % tokens:
            return (f"its tokens_per_index is {tokens:,}: not a number of sequences of {seq_len} tokens (-T) that "
                    f"divides the {tokens_per_step:,} tokens of its run's step (--total_batch_size)")
        read, n = steps * tokens_per_step, self.n_tokens
        shortest_epoch = max(n - tokens_per_step, (n - 1) // 2 + 1)
        if index >= 1 and epoch * shortest_epoch + index * tokens <= read <= (epoch + 1) * (n - 1):
            return None
        return (f"its position, epoch {epoch:,} and index {index:,} of {tokens:,} tokens, is not where {steps:,} "
                f"steps of {tokens_per_step:,} tokens ({read:,}, {read / (n - 1):.3g} passes over these shards' "
                f"{n:,}) leave it")

    def load_state_dict(self, state):
        """Continues where state left off. Saved under another world size or batch shape (an
        elastic restart), the position is carried over by tokens read: the windows then lie
        on a new grid, so the rest of that epoch is only approximately the unseen data."""
        self.epoch = int(state["epoch"])
        self.index = int(state["index"]) * int(state["tokens_per_index"]) // self.tokens_per_index
        self._plan_epoch()

    def reset(self):
        self.epoch, self.index = 0, 0
        self._plan_epoch()

