"""Generation with Hugging Face's conventions: sampling, greedy search and beam search, for a
batch of prompts of different lengths at once (left-padded) through the model's KV cache.
GPT.generate, sample.py and bench.py use it.

Each option means what it means in transformers' generate(), and the tests check that the
token ids are GPT2LMHeadModel.generate's:
- the logits of every step go through repetition_penalty, no_repeat_ngram_size and
  min_new_tokens, in that order; sampling then applies temperature, top_k and top_p; beam
  search applies the first three to the log-probabilities instead;
- a row that emits eos_token_id is finished: it is padded with that id, never extended;
- beam search keeps the num_beams best unfinished beams each step, and a beam that ends
  among the best num_beams candidates becomes a hypothesis scored
  sum(log p of its new tokens) / new_length ** length_penalty; early_stopping True stops a
  prompt once it has num_beams hypotheses, False once no running beam can beat the worst of
  them at its current length, "never" (with length_penalty > 0) at the longest length allowed.
"""
import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from gpt2repro.common.distributed import Stopped, never_stop
from gpt2repro.lm.tokenizer import get_encoding

DECODES = ("sampling", "greedy", "beam")
# Bounds past which an option fails in a traceback rather than generate: a prompt's rows (samples
# or beams) each hold a vocabulary's logits every step; a logit divided by a repetition_penalty
# below 0.001 overflows to inf (NaN probabilities); new_length ** length_penalty overflows a float.
# max_new_tokens: beam search holds each prompt's hypotheses at their longest from the start, and
# past the context every new token recomputes the whole window: 64 GPT-2 contexts (minutes on a
# GPU) is more than any use of GPT-2 asks; 10**9 would be a traceback, 2**64 would never end.
MAX_ROWS = 1024
MAX_NEW_TOKENS = 1 << 16
REPETITION_PENALTY = (1e-3, 1e3)
MAX_LENGTH_PENALTY = 10


@dataclass
class GenerationConfig:
    decode: str = "sampling"  # sampling, greedy or beam
    max_new_tokens: int = 200
    min_new_tokens: int = 0  # eos_token_id is masked until this many new tokens
    temperature: float = 1.0  # sampling; 0 is greedy
    top_k: int | None = 50  # sampling: only the k most likely ids (None: all)
    top_p: float | None = None  # sampling: only the fewest most likely ids holding this much probability
    repetition_penalty: float = 1.0  # CTRL's: the logit of an id already seen is divided by it (times it if < 0)
    no_repeat_ngram_size: int = 0  # no n-gram of this size twice, the prompt's included (0: off)
    num_beams: int = 1
    length_penalty: float = 1.0  # beam: hypotheses score sum(log p) / new_length ** length_penalty
    early_stopping: bool | str = False  # beam: True, False or "never"
    num_return_sequences: int = 1  # samples per prompt, or its best hypotheses in beam search
    eos_token_id: int | None = None  # ends a row; None: every row runs max_new_tokens
    use_cache: bool = True  # False: every step recomputes every position (slower; the same ids)

    def __post_init__(self):
        """ValueError naming the first field that is out of range (its message starts with the name)."""
        beam = self.decode == "beam"
        checks = [
            (self.decode in DECODES, f"decode must be one of {', '.join(DECODES)}"),
            (1 <= self.max_new_tokens <= MAX_NEW_TOKENS, f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}]"),
            (self.min_new_tokens >= 0, "min_new_tokens must be 0 or more"),
            (self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens {self.min_new_tokens} is more than max_new_tokens {self.max_new_tokens}"),
            (self.temperature >= 0, "temperature must be 0 (greedy) or more"),
            (self.top_k is None or self.top_k >= 1, "top_k must be at least 1"),
            (self.top_p is None or 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1],
             f"repetition_penalty must be in [{REPETITION_PENALTY[0]:g}, {REPETITION_PENALTY[1]:g}]"),
            (self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size must be 0 (off) or more"),
            (abs(self.length_penalty) <= MAX_LENGTH_PENALTY,  # NaN ranks nothing
             f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]"),
            (1 <= self.num_return_sequences <= MAX_ROWS, f"num_return_sequences must be in [1, {MAX_ROWS}]"),
            (self.num_beams <= MAX_ROWS, f"num_beams must be at most {MAX_ROWS}"),
            (self.num_beams >= 2 if beam else self.num_beams == 1,
             "num_beams must be 2 or more for beam search" if beam else "num_beams is for beam search only"),
            (not beam or self.num_return_sequences <= self.num_beams,
             f"num_return_sequences {self.num_return_sequences} is more than num_beams {self.num_beams}"),
            (self.decode != "greedy" or self.num_return_sequences == 1,
             "num_return_sequences must be 1 in greedy search: every sequence would be the same"),
            (self.early_stopping in (True, False, "never"), "early_stopping must be True, False or 'never'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def left_pad(prompts, pad_id, device=None):
    """Lists of ids -> (idx (B, longest), n_pad (B,)): each prompt right-aligned, after n_pad pads."""
    longest = max(map(len, prompts))
    idx = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
    return idx, torch.tensor([longest - len(p) for p in prompts], device=device)


@torch.no_grad()
def generate(model, idx, config, n_pad=None, generator=None, stop_requested=never_stop):
    """Continues each row of idx (B, T), after its n_pad (B,) leading pads, as transformers'
    generate() returns it: (B * num_return_sequences, T + new) ids, each a prompt's row and
    new ids, those of a finished row padded with eos_token_id. generator, stop_requested: see
    generate_stream."""
    outputs = [None] * idx.size(0)
    for i, rows in generate_stream(model, idx, config, n_pad, generator, stop_requested):
        outputs[i] = rows
    rows = [row for prompt in outputs for row in prompt]
    width = max(map(len, rows))
    new = torch.tensor([row + [config.eos_token_id] * (width - len(row)) for row in rows], device=idx.device)
    return torch.cat([idx.repeat_interleave(config.num_return_sequences, dim=0), new], dim=1)


@torch.no_grad()
def generate_stream(model, idx, config, n_pad=None, generator=None, stop_requested=never_stop):
    """Yields (i, outputs) as soon as prompt i (row i of idx) is finished: its
    num_return_sequences lists of new ids, best hypothesis first in beam search, each ending
    with eos_token_id when it stopped there. generator: a torch.Generator that all sampling
    draws from, or a list of one per prompt, so that a prompt's samples are the same in any
    batch as alone (None: torch's default generator). Stopped where stop_requested() is true
    before a new token's forward pass."""
    if isinstance(generator, (list, tuple)) and len(generator) != idx.size(0):
        raise ValueError(f"{len(generator)} generators for {idx.size(0)} prompts: one a prompt")
    if n_pad is not None and not n_pad.any():
        n_pad = None  # no padding: attention stays SDPA's plain causal kernel
    if config.decode == "beam":
        yield from beam_search(model, idx, config, n_pad, stop_requested)
    else:
        yield from greedy_or_sample(model, idx, config, n_pad, generator, stop_requested)


def new_cache(model, config):
    """An empty KV cache (one [] a layer, filled by the model), or None without use_cache."""
    return [[] for _ in model.transformer.h] if config.use_cache else None


def next_logits(model, seqs, n_pad, kv_cache):
    """Float32 logits (N, V) of the id after each row of seqs, feeding the model only what
    kv_cache lacks (everything when kv_cache is None). Past block_size the window slides, as
    in a model without a cache: the cache is emptied and the last block_size positions
    recomputed, their positions counted again from each row's first token in the window. The
    window is each row's own last block_size tokens: padding sits left of a row's tokens, so
    it is in the window only while the row is shorter than the window (and masked there)."""
    block_size = model.config.block_size
    if kv_cache and kv_cache[0] and seqs.size(1) <= block_size:
        new = seqs[:, -1:]
    else:
        for layer in kv_cache or ():
            layer.clear()
        new = seqs[:, -block_size:]
        if n_pad is not None:
            n_pad = (n_pad - (seqs.size(1) - new.size(1))).clamp(min=0)
    return model.head(model.hidden_states(new, kv_cache, n_pad)[:, -1]).float()


def penalize(logits, seqs, n_pad, n_new, config):
    """transformers' repetition_penalty, no_repeat_ngram_size and min_new_tokens, in its order,
    on logits (N, V) (log-probabilities in beam search) after the ids seqs (N, L), of which
    each row's first n_pad are padding and take no part; n_new: ids generated so far."""
    N, V = logits.shape
    real = torch.ones_like(seqs, dtype=torch.bool)
    if n_pad is not None:
        real = torch.arange(seqs.size(1), device=seqs.device) >= n_pad[:, None]
    if config.repetition_penalty != 1.0:
        # Column V collects the padding, then is cut off.
        seen = torch.zeros(N, V + 1, dtype=torch.bool, device=logits.device)
        seen = seen.scatter(1, seqs.masked_fill(~real, V), True)[:, :V]
        penalized = torch.where(logits < 0, logits * config.repetition_penalty, logits / config.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    n = config.no_repeat_ngram_size
    if n and seqs.size(1) >= n:
        # Every earlier n-gram that starts with the last n - 1 ids bans its last id.
        ngrams = seqs.unfold(1, n, 1)  # (N, L - n + 1, n)
        repeats = (ngrams[..., :-1] == seqs[:, seqs.size(1) - n + 1:][:, None]).all(-1) & real[:, : ngrams.size(1)]
        banned = torch.zeros(N, V + 1, dtype=torch.bool, device=logits.device)
        banned = banned.scatter(1, ngrams[..., -1].masked_fill(~repeats, V), True)[:, :V]
        logits = logits.masked_fill(banned, -math.inf)
    if config.eos_token_id is not None and n_new < config.min_new_tokens:
        logits = logits.index_fill(1, torch.tensor([config.eos_token_id], device=logits.device), -math.inf)
    return logits


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, V) -> (B, 1) token ids: greedy at temperature 0, otherwise drawn from
    sampling_probs."""
    # A temperature below float32's normal numbers leaves only the best id any probability
    # (rounded to 0, it would even divide 0 by 0): that is greedy.
    if temperature < torch.finfo(torch.float32).tiny:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), num_samples=1, generator=generator)


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The distribution (B, V) that sampling draws from: logits divided by temperature, then
    only the top_k most likely ids and the top_p nucleus of them, as transformers' warpers."""
    # The best logit is moved to 0 before dividing, so no small temperature makes one overflow
    # to inf, or all of them to -inf (either makes the softmax NaN); the others go at worst to
    # -inf, probability 0.
    logits = logits.float()
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return truncate_logits(logits / temperature, top_k, top_p).softmax(dim=-1)


def truncate_logits(logits, top_k=None, top_p=None):
    """logits (B, V) with every id outside the top_k and outside the top_p nucleus set to -inf."""
    if top_k is not None:
        kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_best, -math.inf)
    # top_p=1 keeps every id, as in transformers, which then skips this step.
    if top_p is not None and top_p < 1:
        # From the least likely id up: drop the ids whose mass, with all below them, is at
        # most 1 - top_p. (The best always stays.)
        sorted_logits, order = torch.sort(logits)
        drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop_sorted[:, -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), -math.inf)
    return logits


def greedy_or_sample(model, idx, config, n_pad, generator, stop_requested):
    """Greedy search and sampling: num_return_sequences rows a prompt, each a token a step."""
    n, eos = config.num_return_sequences, config.eos_token_id
    seqs = idx.repeat_interleave(n, dim=0)
    n_pad = n_pad.repeat_interleave(n) if n_pad is not None else None
    finished = torch.zeros(seqs.size(0), dtype=torch.bool, device=idx.device)
    reported = torch.zeros(idx.size(0), dtype=torch.bool)
    kv_cache = new_cache(model, config)
    for step in range(config.max_new_tokens):
        if stop_requested():
            raise Stopped
        logits = penalize(next_logits(model, seqs, n_pad, kv_cache), seqs, n_pad, step, config)
        if config.decode == "greedy":
            token = logits.argmax(dim=-1, keepdim=True)
        elif isinstance(generator, (list, tuple)):  # a prompt's rows from its own generator
            token = torch.cat([sample_next_token(rows, config.temperature, config.top_k, config.top_p, g)
                               for rows, g in zip(logits.split(n), generator)])
        else:
            token = sample_next_token(logits, config.temperature, config.top_k, config.top_p, generator)
        if eos is not None:  # (what a finished row draws after its eos is never read)
            finished |= token[:, 0] == eos
        seqs = torch.cat([seqs, token], dim=1)
        done = finished.view(-1, n).all(dim=1).cpu() | (step + 1 == config.max_new_tokens)
        for i in (done & ~reported).nonzero().flatten().tolist():
            yield i, [until_eos(row, eos) for row in seqs[i * n: (i + 1) * n, idx.size(1):].tolist()]
        reported |= done
        if reported.all():
            return


def until_eos(ids, eos):
    """ids up to and including the first eos (all of them if there is none)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def beam_search(model, idx, config, n_pad, stop_requested):
    """transformers' beam search, a prompt's num_beams beams side by side in the batch."""
    B, T = idx.shape
    beams, eos, V = config.num_beams, config.eos_token_id, model.n_tokens
    K = 2 * beams  # candidates a step: at most `beams` of them (one a beam) end with eos
    seqs = idx.repeat_interleave(beams, dim=0)
    n_pad = n_pad.repeat_interleave(beams) if n_pad is not None else None
    # The beams start as copies of the prompt: only the first one's continuations count.
    running = torch.full((B, beams), -1e9, device=idx.device)
    running[:, 0] = 0.0
    # Finished hypotheses, best first; an empty place scores -inf.
    fill = eos if eos is not None else 0  # after a hypothesis's end
    hyps = torch.full((B, beams, T + config.max_new_tokens), fill, device=idx.device)
    hyp_scores = torch.full((B, beams), -math.inf, device=idx.device)
    reported = torch.zeros(B, dtype=torch.bool)
    kv_cache = new_cache(model, config)
    for step in range(config.max_new_tokens):
        if stop_requested():
            raise Stopped
        log_probs = F.log_softmax(next_logits(model, seqs, n_pad, kv_cache), dim=-1)
        log_probs = penalize(log_probs, seqs, n_pad, step, config)
        scores, top = (log_probs.view(B, beams, V) + running[..., None]).view(B, beams * V).topk(K)
        beam, token = top // V, top % V
        L = seqs.size(1)
        candidates = torch.cat([seqs.view(B, beams, L).gather(1, beam[..., None].expand(B, K, L)), token[..., None]], 2)
        ends = torch.full_like(token, step + 1 == config.max_new_tokens, dtype=torch.bool)
        if eos is not None:
            ends |= token == eos

        # The best candidates that go on are the next beams, and the cache follows them.
        running, keep = (scores - 1e9 * ends).topk(beams)
        seqs = candidates.gather(1, keep[..., None].expand(B, beams, L + 1)).flatten(0, 1)
        rows = (beam.gather(1, keep) + beams * torch.arange(B, device=idx.device)[:, None]).flatten()
        for layer in kv_cache or ():
            layer[:] = [t[rows] for t in layer]

        # Candidates that end among the best `beams` become hypotheses; the best `beams` are kept.
        joins = ends & (torch.arange(K, device=idx.device) < beams)
        new_scores = torch.where(joins, scores / (step + 1) ** config.length_penalty, -math.inf)
        hyp_scores, pick = torch.cat([hyp_scores, new_scores], dim=1).topk(beams)
        hyps = torch.cat([hyps, F.pad(candidates, (0, hyps.size(2) - L - 1), value=fill)], dim=1)
        hyps = hyps.gather(1, pick[..., None].expand(B, beams, hyps.size(2)))

        # A prompt with `beams` hypotheses is done: at once with early_stopping True, otherwise
        # once its best running beam cannot beat the worst of them at its current length (with
        # "never" and a length_penalty that favours length: at the longest length allowed).
        longest = config.early_stopping == "never" and config.length_penalty > 0
        new_length = config.max_new_tokens if longest else step + 1
        best_possible = running[:, 0] / new_length ** config.length_penalty
        worst = hyp_scores[:, -1]
        done = (worst > -math.inf) & ((config.early_stopping is True) | (best_possible <= worst))
        done = done.cpu() | (step + 1 == config.max_new_tokens)
        for i in (done & ~reported).nonzero().flatten().tolist():
            yield i, [until_eos(row, eos) for row in hyps[i, : config.num_return_sequences, T:].tolist()]
        reported |= done
        if reported.all():
            return


@torch.no_grad()
def preview(model, prompt, seed, device, stop_requested=never_stop, num_samples=4, max_new_tokens=32):
    """num_samples texts continuing prompt (text), top-k 50, from model, a GPT on device in
    evaluation mode (a training run's preview; the caller holds its autocast). Every token's
    forward pass asks stop_requested first (generate_stream): every rank runs as many."""
    enc = get_encoding()
    ids = torch.tensor(enc.encode_ordinary(prompt), device=device).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, ids, GenerationConfig(max_new_tokens=max_new_tokens, top_k=50), generator=generator,
                   stop_requested=stop_requested)
    return [enc.decode(row) for row in out.tolist()]
