"""Scoring the end of token rows (the answers of a question), many rows a forward pass, the start
that rows share computed once: core_eval.py's engine.

A row is (tokens, start): the model reads its tokens and is scored on predicting tokens[start:],
by their mean cross-entropy and by how many of them greedy decoding misses. Rows of one example
that begin alike (a 10-shot prompt and its four answers) form a Unit: the shared start (its prefix)
runs once and fills the KV cache; each row's own tokens (a Branch) run after it in a second pass,
all of a unit's branches packed into one sequence whose mask keeps each branch to the prefix and
to its own earlier tokens, at the positions it would have in its row. Each row's scores are those
of the row run alone, up to float rounding.
"""
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from gpt2repro.common.devices import autocast

PAD_ID = 0  # any valid id: no real token attends to padding
# Float32 logits computed at once when scoring (here and in hellaswag.py): on a CPU 16 MB, which
# stays in its caches; on a GPU 1 GiB (1,300 positions a matmul at GPT-2's vocabulary), or less
# where memory is short.
LOGITS_BYTES = {"cpu": 1 << 24, "gpu": 1 << 30}


@dataclass(frozen=True)
class Branch:
    """A row's own tokens after its unit's prefix: what the model reads (inputs) and, from
    inputs[first] on, the tokens it is scored on predicting (targets)."""
    row: int  # the row's index in its example
    inputs: torch.Tensor
    first: int
    targets: torch.Tensor


@dataclass(frozen=True)
class Unit:
    """Rows of one example that begin alike: the prefix they share, and each one's Branch."""
    example: int  # the caller's number for the example
    prefix: torch.Tensor
    branches: tuple


def common_start(rows):
    """How many first tokens every row shares."""
    n = min(map(len, rows))
    return next((i for i in range(n) if any(row[i] != rows[0][i] for row in rows)), n)


def units_of(example, rows, block_size):
    """The Units of an example's rows [(tokens, start)]: a row longer than block_size keeps its last
    tokens (ValueError if that cuts into its scored ones, or the token that predicts the first),
    and rows cut alike share their common start. A row with nothing to score (start == its length:
    it is the start of another) has no branch."""
    groups = {}
    for r, (tokens, start) in enumerate(rows):
        cut = max(0, len(tokens) - block_size)
        if start - cut < 1:
            raise ValueError(f"an answer of {len(tokens) - start} tokens does not fit block_size {block_size}")
        groups.setdefault(cut, []).append((r, tokens[cut:], start - cut))
    units = []
    for group in groups.values():
        scored = [(r, tokens, start) for r, tokens, start in group if start < len(tokens)]
        if not scored:
            continue
        # The prefix ends before the token that predicts a row's first scored one: every scored
        # position is in a branch, whose logits are the only ones computed.
        split = min(common_start([tokens for _, tokens, _ in scored]), *(start - 1 for _, _, start in scored))
        branches = tuple(Branch(r, ids(tokens[split:-1]), start - 1 - split, ids(tokens[start:]))
                         for r, tokens, start in scored)
        units.append(Unit(example, ids(scored[0][1][:split]), branches))
    return units


def ids(tokens):
    return torch.tensor(tokens, dtype=torch.int32)  # half of int64's memory: a run keeps its units for every eval


def packed(units, device):
    """The two passes' inputs for units: their prefixes, right-padded (B, P); their branches packed
    one after another per unit (B, T), with the positions they continue from and a mask (B, 1, T,
    P + T) that lets each branch see its own prefix and its own earlier tokens; and, per packed
    token, its branch's number over all units (-1: padding) and its target (-1: not scored)."""
    B, P = len(units), max(1, *(len(u.prefix) for u in units))
    T = max(sum(len(b.inputs) for b in u.branches) for u in units)
    prefixes = torch.full((B, P), PAD_ID, dtype=torch.long)
    ids_, positions = torch.full((B, T), PAD_ID, dtype=torch.long), torch.zeros((B, T), dtype=torch.long)
    branch, targets = torch.full((B, T), -1, dtype=torch.long), torch.full((B, T), -1, dtype=torch.long)
    k = 0
    for u, unit in enumerate(units):
        prefixes[u, : len(unit.prefix)] = unit.prefix
        t = 0
        for b in unit.branches:
            n = len(b.inputs)
            ids_[u, t: t + n], branch[u, t: t + n] = b.inputs, k
            positions[u, t: t + n] = torch.arange(len(unit.prefix), len(unit.prefix) + n)
            targets[u, t + b.first: t + n] = b.targets
            t, k = t + n, k + 1
    real = branch >= 0
    own = (branch[:, :, None] == branch[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril() & real[:, :, None]
    own |= torch.eye(T, dtype=torch.bool)  # padding attends to itself: no softmax row is empty
    lengths = torch.tensor([len(u.prefix) for u in units])
    context = (torch.arange(P) < lengths[:, None])[:, None, :] & real[:, :, None]
    mask = torch.cat([context, own], dim=2)[:, None]
    return [x.to(device) for x in (prefixes, ids_, positions, mask, branch, targets)]


@torch.no_grad()
def branch_scores(model, units, device, dtype=torch.float32):
    """(mean loss, greedy misses) of each branch of units, in order: float32 and int64 CPU tensors.
    model: a GPT in evaluation mode on device; dtype: autocast's for the transformer. The head
    runs in float32 (GPT-2's logits lie near -60, where bfloat16's steps are 0.25), a chunk of
    positions at a time, at the scored positions only."""
    prefixes, inputs, positions, mask, branch, targets = packed(units, device)
    scored = targets != -1
    cache = [[] for _ in model.transformer.h]
    with autocast(torch.device(device).type, dtype):
        model.hidden_states(prefixes, cache)
        hidden = model.hidden_states(inputs, cache, layout=(positions, mask))[scored].float()
    chunk = max(1, logits_per_chunk(hidden.device) // model.config.vocab_size)
    losses, misses = [], []
    for h, t in zip(hidden.split(chunk), targets[scored].split(chunk)):
        logits = model.head(h)
        losses.append(F.cross_entropy(logits, t, reduction="none"))
        misses.append(logits.argmax(dim=-1) != t)
    n = sum(len(u.branches) for u in units)
    index = branch[scored]
    total = torch.zeros(n, device=hidden.device).index_add_(0, index, torch.cat(losses))
    count = torch.zeros(n, device=hidden.device).index_add_(0, index, torch.ones_like(total[index]))
    missed = torch.zeros(n, dtype=torch.long, device=hidden.device).index_add_(0, index, torch.cat(misses).long())
    return (total / count).cpu(), missed.cpu()


def logits_per_chunk(device):
    """How many float32 logits a scorer computes at once on device (see LOGITS_BYTES)."""
    if device.type != "cuda":
        return LOGITS_BYTES["cpu"] // 4
    free, _ = torch.cuda.mem_get_info(device)
    # Up to an eighth of what is free: the cross-entropy makes a copy or two of them.
    return min(LOGITS_BYTES["gpu"], free // 8) // 4
