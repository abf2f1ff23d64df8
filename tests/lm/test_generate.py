"""generate.py: greedy, beam search and sampling give transformers' token ids, batched (left
padding) as alone, through the KV cache and past block_size."""
import re

import pytest
import torch
from transformers import GPT2LMHeadModel
from transformers.generation.logits_process import (
    LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import export_hf
from gpt2repro.lm import generate
from gpt2repro.lm.generate import GenerationConfig, left_pad
from gpt2repro.lm.tokenizer import EOT
from helpers.models import make_eot_gpt, make_tiny_gpt, save_as_checkpoint

LENGTHS = (5, 9, 2, 7)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, transformers' GPT2LMHeadModel of its export_hf.py export): a model whose beams
    finish at many lengths, so that length_penalty and early_stopping matter."""
    tmp = tmp_path_factory.mktemp("generate")
    model = make_eot_gpt()
    export_hf.main([save_as_checkpoint(model, tmp / "ckpt.pt"), str(tmp / "hf")])
    return model, GPT2LMHeadModel.from_pretrained(tmp / "hf").eval()


def make_prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOT, (n,), generator=g).tolist() for n in lengths]


def ours(model, prompts, generator=None, **options):
    """Our ids of the left-padded batch of prompts, as transformers returns them."""
    idx, n_pad = left_pad(prompts, EOT)
    return generate.generate(model, idx, GenerationConfig(eos_token_id=EOT, **options), n_pad, generator)


def theirs(hf, prompts, decode, **options):
    """transformers' ids for the same batch."""
    idx, n_pad = left_pad(prompts, EOT)
    mask = (torch.arange(idx.size(1)) >= n_pad[:, None]).long()
    if options.get("top_k", 50) is None:
        options = {**options, "top_k": 0}  # transformers' "all"
    options["do_sample"] = decode == "sampling"
    return hf.generate(idx, attention_mask=mask, pad_token_id=EOT, eos_token_id=EOT, **options)


def outputs(ids, prompt_length):
    """Each row's new ids up to its <|endoftext|>."""
    return [generate.until_eos(row, EOT) for row in ids[:, prompt_length:].tolist()]


SEARCHES = [
    dict(decode="greedy"),
    dict(decode="greedy", repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4),
    dict(decode="beam", num_beams=3, length_penalty=1.0, early_stopping=True, num_return_sequences=3),
    dict(decode="beam", num_beams=3, length_penalty=1.0, early_stopping=False, num_return_sequences=3),
    dict(decode="beam", num_beams=3, length_penalty=1.0, early_stopping="never", num_return_sequences=3),
    dict(decode="beam", num_beams=3, length_penalty=2.0, early_stopping="never", num_return_sequences=2),
    dict(decode="beam", num_beams=3, length_penalty=-1.0, num_return_sequences=2, min_new_tokens=3),
    dict(decode="beam", num_beams=4, length_penalty=0.0, early_stopping=True, repetition_penalty=1.5,
         no_repeat_ngram_size=2),
]


@pytest.mark.slow
def test_greedy_and_beam_search_give_transformers_ids_batched_and_alone(models):
    model, hf = models
    prompts = make_prompts()
    results = []
    for options in SEARCHES:
        batched = ours(model, prompts, max_new_tokens=8, **options)
        assert torch.equal(batched, theirs(hf, prompts, max_new_tokens=8, **options)), options
        n = options.get("num_return_sequences", 1)
        rows = outputs(batched, max(LENGTHS))
        for i, prompt in enumerate(prompts):
            assert outputs(ours(model, [prompt], max_new_tokens=8, **options), len(prompt)) == rows[i * n: (i + 1) * n]
        results.append(rows)
    # Every option changed the ids: each case above tests something.
    assert all(results[i] != results[j] for i in range(len(results)) for j in range(i))
    assert any(row[-1] == EOT for rows in results for row in rows)  # texts end early, and are padded


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_k=None, top_p=0.8),
    dict(temperature=0.9, top_k=100, top_p=0.95, repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=5),
])
def test_sampling_with_one_generator_draws_transformers_ids(models, options):
    # transformers draws from torch's global generator, the whole batch at once: so does a
    # single generator here (sample.py gives each prompt its own instead, tested below).
    model, hf = models
    prompts = make_prompts()
    torch.manual_seed(3)
    expected = theirs(hf, prompts, "sampling", max_new_tokens=12, num_return_sequences=2, **options)
    got = ours(model, prompts, torch.Generator().manual_seed(3), max_new_tokens=12, num_return_sequences=2, **options)
    assert torch.equal(got, expected)


def test_a_prompts_samples_are_the_same_in_a_batch_as_alone(models):
    model, _ = models
    prompts = make_prompts()
    options = dict(max_new_tokens=12, num_return_sequences=3, temperature=1.5, top_k=None)
    batched = outputs(ours(model, prompts, [torch.Generator().manual_seed(10 + i) for i in range(4)], **options),
                      max(LENGTHS))
    for i, prompt in enumerate(prompts):
        alone = ours(model, [prompt], [torch.Generator().manual_seed(10 + i)], **options)
        assert outputs(alone, len(prompt)) == batched[3 * i: 3 * i + 3]
    assert len({str(rows) for rows in batched}) == len(batched)  # samples, not copies
    with pytest.raises(ValueError, match="^3 generators for 4 prompts: one a prompt"):
        ours(model, prompts, [torch.Generator()] * 3, **options)


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=3),
    dict(min_new_tokens=5),
    dict(temperature=0.6, top_k=300, top_p=0.7),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5, temperature=1.5, top_k=40, top_p=0.9),
])
def test_the_filtered_distributions_are_transformers_processors(options):
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, EOT + 1, generator=g)
    seqs = torch.randint(0, 6, (6, 12), generator=g) * 97  # few ids: n-grams repeat
    config = GenerationConfig(**{"top_k": None, "eos_token_id": EOT, **options})
    processors = LogitsProcessorList()
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(10, config.min_new_tokens, EOT))
    if config.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None:
        processors.append(TopPLogitsWarper(config.top_p))
    expected = processors(seqs, logits.clone()).softmax(dim=-1)
    # Ours: 2 new tokens after a prompt of 10, as for the MinNewTokens above.
    penalized = generate.penalize(logits, seqs, None, 2, config)
    got = generate.sampling_probs(penalized, config.temperature, config.top_k, config.top_p)
    assert torch.equal(got > 0, expected > 0) and torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, logits.softmax(dim=-1), rtol=1e-3, atol=0)  # the options did change it
    # Left padding takes no part: not its ids (penalized, banned if counted), nor its n-grams,
    # which here continue each row's last ids with new ones.
    padding = torch.cat([seqs[:2, -2:], torch.tensor([[1000, 1001]] * 2)], dim=1)
    padded = generate.penalize(logits[:2], torch.cat([padding, seqs[:2]], dim=1), torch.tensor([4, 4]), 2, config)
    assert torch.equal(padded, penalized[:2])


@pytest.mark.parametrize("options", [
    dict(decode="greedy", repetition_penalty=1.2),
    dict(decode="sampling", top_k=None, num_return_sequences=2),
    dict(decode="beam", num_beams=3, num_return_sequences=2, length_penalty=0.5),
])
def test_past_block_size_the_window_slides_batched_and_alone(options):
    # Block of 16: the 12-token prompt slides after 4 new tokens, the 3-token one after 13.
    model = make_tiny_gpt(vocab_size=50304, block_size=16)
    prompts = make_prompts((12, 3))
    kw = dict(max_new_tokens=20, **options)

    def generators():
        return [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    batched = outputs(ours(model, prompts, generators(), **kw), 12)
    n = options.get("num_return_sequences", 1)
    for i, prompt in enumerate(prompts):
        assert outputs(ours(model, [prompt], generators()[i:i + 1], **kw), len(prompt)) == batched[i * n: (i + 1) * n]
    assert all(len(prompts[i // n]) + len(row) > 16 for i, row in enumerate(batched))  # every row slid
    # The cache (reordered by beam search, dropped when the window slides) changes nothing.
    assert outputs(ours(model, prompts, generators(), use_cache=False, **kw), 12) == batched


def test_a_finished_row_is_padded_not_extended(models):
    model, _ = models
    prompts = make_prompts()
    idx, n_pad = left_pad(prompts, EOT)

    def sampled(eos):
        config = GenerationConfig(max_new_tokens=10, temperature=0.7, top_k=20, eos_token_id=eos)
        return generate.generate(model, idx, config, n_pad, torch.Generator().manual_seed(0))[:, max(LENGTHS):].tolist()
    out, rows = sampled(EOT), outputs(torch.tensor(sampled(EOT)), 0)
    assert any(len(row) < 10 for row in rows)  # some row ended early
    for row, ids in zip(rows, out):
        assert EOT not in row[:-1] and ids == row + [EOT] * (10 - len(row))
    # Without an end-of-text id, the same rows run on, past <|endoftext|>.
    longer = sampled(None)
    assert all(ids[: len(row)] == row for row, ids in zip(rows, longer))
    assert any(set(ids[len(row):]) != {EOT} for row, ids in zip(rows, longer) if len(row) < 10)


@pytest.mark.parametrize("options, message", [
    (dict(decode="beam"), "num_beams must be 2 or more for beam search"),
    (dict(num_beams=4), "num_beams is for beam search only"),
    (dict(decode="beam", num_beams=2, num_return_sequences=3), "num_return_sequences 3 is more than num_beams 2"),
    (dict(decode="greedy", num_return_sequences=2), "num_return_sequences must be 1 in greedy search"),
    (dict(decode="beam", num_beams=2, early_stopping="always"), "early_stopping must be True, False or 'never'"),
    (dict(decode="nucleus"), "decode must be one of sampling, greedy, beam"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.001, 1000]"),
    (dict(repetition_penalty=1e-308), "repetition_penalty must be in [0.001, 1000]"),  # NaN probabilities
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be in [0.001, 1000]"),
    (dict(decode="beam", num_beams=4, length_penalty=1e308), "length_penalty must be in [-10, 10]"),  # overflow
    (dict(decode="beam", num_beams=10**12), "num_beams must be at most 1024"),  # no memory holds its rows
    (dict(num_return_sequences=10**12), "num_return_sequences must be in [1, 1024]"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be 0 (off) or more"),
    (dict(min_new_tokens=-1), "min_new_tokens must be 0 or more"),
    (dict(min_new_tokens=9, max_new_tokens=8), "min_new_tokens 9 is more than max_new_tokens 8"),
    (dict(decode="beam", num_beams=2, length_penalty=float("nan")), "length_penalty must be in [-10, 10]"),
    (dict(decode="beam", num_beams=2, length_penalty=float("-inf")), "length_penalty must be in [-10, 10]"),
    (dict(top_k=0), "top_k must be at least 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be in [1, 65536]"),
    (dict(decode="beam", num_beams=2, max_new_tokens=65537), "max_new_tokens must be in [1, 65536]"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        GenerationConfig(**options)
