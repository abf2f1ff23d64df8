"""model.py against GPT-2's definition and against Hugging Face's implementation."""
import math

import pytest
import torch
import torch.nn.functional as F

from gpt2repro.lm.generate import sample_next_token, truncate_logits
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, get_encoding
from helpers.models import make_hf_gpt2, make_tiny_gpt
from model import GPT, GPTConfig

TINY = dict(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def gpt2_124m():
    torch.manual_seed(0)
    return GPT(GPTConfig())


@pytest.mark.slow
def test_parameter_count_and_weight_tying(gpt2_124m):
    assert sum(p.numel() for p in gpt2_124m.parameters()) == 124_439_808
    assert gpt2_124m.lm_head.weight is gpt2_124m.transformer.wte.weight


def test_init_follows_gpt2(gpt2_124m):
    m = gpt2_124m
    assert m.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert m.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.02)
    block = m.transformer.h[5]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * 12)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert all(not b.any() for name, b in m.named_parameters() if name.endswith("bias"))
    assert block.ln_1.weight.eq(1).all()


def test_loss_at_init_is_uniform(gpt2_124m):
    torch.manual_seed(1)
    idx, targets = torch.randint(0, N_VOCAB, (2, 2, 64))
    with torch.no_grad():
        _, loss = gpt2_124m(idx, targets)
    # Logits of std ~0.55 add ~0.15 above ln(V) in expectation.
    assert abs(loss.item() - math.log(N_VOCAB)) < 0.3


def test_optimizer_groups(gpt2_124m):
    opt = gpt2_124m.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type="cpu")
    decay, no_decay = opt.param_groups
    assert (len(decay["params"]), len(no_decay["params"])) == (50, 98)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_logits_equal_hugging_face(hf_gpt2_dir):
    hf, path = hf_gpt2_dir
    ours = GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 128, (3, 64))
    with torch.no_grad():
        diff = (ours(idx)[0] - hf(idx).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", False), ("layer_norm_epsilon", 1e-6), ("scale_attn_weights", False),
    ("scale_attn_by_inverse_layer_idx", True), ("activation_function", "gelu"), ("n_inner", 64),
])
def test_from_pretrained_refuses_a_config_that_is_not_gpt2s_maths(tmp_path, field, value):
    make_hf_gpt2(**{field: value}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"not a GPT-2 architecture \({field}={value!r}\)$"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_names_the_first_mismatch(tmp_path):
    hf = make_hf_gpt2()
    sd = hf.state_dict()
    del sd["transformer.h.1.mlp.c_fc.bias"]
    model = GPT(GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=32))
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias is missing"):
        model.load_hf_state_dict(sd)
    sd = hf.state_dict()
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:10]
    with pytest.raises(ValueError, match=r"transformer\.wpe\.weight has shape \(10, 32\)"):
        model.load_hf_state_dict(sd)


def reference_attention(attn, x):
    """Causal self-attention the long way: explicit T x T mask and softmax."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in (q, k, v))
    att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


def test_sdpa_attention_equals_masked_softmax():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 32, 32)
    with torch.no_grad():
        assert torch.allclose(attn(x), reference_attention(attn, x), atol=1e-5)


def greedy_without_cache(model, idx, n):
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def test_kv_cache_generation_equals_cache_free():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    prompt = torch.randint(0, 128, (2, 5))
    # 40 new tokens on a block of 32: the window starts sliding half way.
    expected = greedy_without_cache(model, prompt, 40)
    assert torch.equal(model.generate(prompt, 40, temperature=0), expected)
    # With the cache the logits match too, not only their argmax.
    cache = [[] for _ in model.transformer.h]
    with torch.no_grad():
        model(expected[:, :20], kv_cache=cache)
        stepped, _ = model(expected[:, 20:21], kv_cache=cache)
        full, _ = model(expected[:, :21])
    assert torch.allclose(stepped[:, -1], full[:, -1], atol=1e-5)


def test_sampling_is_seeded_and_stays_in_the_top_k():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    prompt = torch.randint(0, 128, (4, 3))
    runs = [model.generate(prompt, 8, top_k=5, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    logits = torch.randn(64, 128)
    top5 = logits.topk(5).indices
    picked = sample_next_token(logits, top_k=5, generator=torch.Generator().manual_seed(0))
    assert (picked == top5).any(dim=1).all()


def test_top_p_keeps_the_smallest_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two ids only.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    picked = sample_next_token(logits, top_p=0.7, generator=torch.Generator().manual_seed(0)).flatten()
    counts = torch.bincount(picked, minlength=4)
    assert counts[2:].sum() == 0 and counts[0] > counts[1] > 0
    assert torch.equal(sample_next_token(logits[:1], temperature=0), torch.tensor([[0]]))


@pytest.mark.parametrize("temperature", [1e-37, 1e-46])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    # Logits of GPT-2's size divided by 1e-37 overflow float32; 1e-46 is 0 in float32.
    logits = 100 * torch.randn(4, N_VOCAB, generator=torch.Generator().manual_seed(0))
    picked = sample_next_token(logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(picked, logits.argmax(dim=-1, keepdim=True))


def test_top_p_1_keeps_every_id():
    # Peaked logits over GPT-2's vocabulary: the float32 cumulative sum reaches 1 long before the last id.
    logits = 6 * torch.randn(4, N_VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(truncate_logits(logits, top_p=1.0), logits)
    assert torch.equal(truncate_logits(logits, top_k=50, top_p=1.0), truncate_logits(logits, top_k=50))


def test_padded_vocabulary_never_reaches_loss_or_samples():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        model.lm_head.weight[N_VOCAB:] = 100.0  # padding rows would win every argmax
    idx = torch.randint(0, N_VOCAB, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, N_VOCAB)
    expected = F.cross_entropy(model.lm_head(model.transformer.ln_f(
        model.transformer.h[0](model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16)))
    ))[..., :N_VOCAB].flatten(0, 1), idx.flatten())
    assert torch.allclose(loss, expected)
    assert model.generate(idx[:, :4], 8, temperature=1.0, top_k=None).max() < N_VOCAB


def test_a_sequence_longer_than_block_size_is_a_clear_error():
    # Token ids are checked where they are read (data.ShardLoader, tokenizer.gpt2_vocab_problem), not here.
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="longer than block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_tokenizer_gives_gpt2_ids():
    enc = get_encoding()
    assert enc.encode_ordinary("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = enc.encode_ordinary(text)
    assert ids == [5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13]
    assert enc.decode(ids) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert enc.n_vocab == N_VOCAB == 50257


def test_truncation_keeps_the_nucleus_of_the_top_k_in_any_id_order():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # ids by likelihood: 1, 3, 0, 2 (not sorted)

    def kept(**kw):
        out = truncate_logits(logits, **kw)
        assert torch.equal(out[out.isfinite()], logits[out.isfinite()])  # kept logits unchanged
        return out[0].isfinite().nonzero().flatten().tolist()

    assert kept(top_k=2) == [1, 3] and kept(top_k=10) == [0, 1, 2, 3]  # top_k beyond the vocabulary keeps all
    assert kept(top_p=0.7) == [1, 3] and kept(top_p=0.85) == [0, 1, 3]
    # The nucleus is of the top_k, renormalized (as in Hugging Face): of 0.5, 0.3, 0.15 the
    # first two hold 0.84 > 0.83 (of all four ids they would hold only 0.8).
    assert kept(top_k=3, top_p=0.83) == [1, 3]


def test_temperature_divides_the_logits_before_the_nucleus():
    # Temperature 2 flattens p = 0.15, 0.5, 0.05, 0.3 to sqrt(p) / sum = 0.207, 0.379, 0.120, 0.294,
    # whose 0.7 nucleus is ids 1, 3 and 0 (untempered it is ids 1 and 3 only).
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log().repeat(4000, 1)
    picked = sample_next_token(logits, temperature=2.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(picked.flatten(), minlength=4) / 4000
    expected = torch.tensor([0.207, 0.379, 0.0, 0.294]) / 0.880
    assert freq[2] == 0 and (freq - expected).abs().max() < 0.03


def test_flops_per_token_is_palms(gpt2_124m):
    # 6 * (parameters less wpe's 1024 x 768) + 12 * layers * heads * head_size * T
    assert gpt2_124m.flops_per_token(1024) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 12 * 64 * 1024


@pytest.mark.parametrize("field, value", [("activation_function", "gelu_pytorch_tanh"), ("n_inner", 128)])
def test_from_pretrained_accepts_gpt2s_maths_spelled_otherwise(tmp_path, field, value):
    hf = make_hf_gpt2(**{field: value})  # n_embd 32: n_inner 128 is GPT-2's 4 * n_embd
    hf.save_pretrained(tmp_path)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (GPT.from_pretrained(str(tmp_path))(idx)[0] - hf(idx).logits).abs().max() < 1e-4


def test_a_target_of_minus_1_is_left_out_of_the_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 128, (2, 8))
    targets = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        logits, loss = model(idx, targets.masked_fill(torch.arange(8) < 3, -1))
    assert torch.allclose(loss, F.cross_entropy(logits[:, 3:].flatten(0, 1), targets[:, 3:].flatten()))


def test_training_mode_computes_what_eval_mode_does():
    """This GPT has no dropout: nothing in its forward pass depends on the mode."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(model.train()(idx)[0], model.eval()(idx)[0])


def test_kv_cache_sampling_equals_cache_free_past_the_window():
    # Greedy decoding of a tiny model soon repeats one token whatever the window holds;
    # sampling does not, so a window that slides wrong (a position short, a stale cache) shows.
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    prompt = torch.randint(0, 128, (2, 5))
    idx, generator = prompt, torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(40):  # 45 tokens on a block of 32
            logits, _ = model(idx[:, -32:])
            idx = torch.cat([idx, sample_next_token(logits[:, -1], generator=generator)], dim=1)
    assert torch.equal(model.generate(prompt, 40, top_k=None, generator=torch.Generator().manual_seed(0)), idx)


def test_left_padding_gives_each_row_its_own_logits_through_the_cache():
    # Rows of 3 and 8 tokens, the first after 5 pads (id 0), then one new token each through the
    # cache: every real position's logits are its row's alone.
    model = make_tiny_gpt(vocab_size=50304)
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    idx, n_pad = torch.tensor([[0] * 5 + prompts[0], prompts[1]]), torch.tensor([5, 0])
    cache = [[] for _ in model.transformer.h]
    with torch.no_grad():
        padded, _ = model(idx, kv_cache=cache, n_pad=n_pad)
        step, _ = model(torch.tensor([[21], [22]]), kv_cache=cache, n_pad=n_pad)
        for row, prompt in enumerate(prompts):
            alone, _ = model(torch.tensor([prompt + [21 + row]]))
            assert torch.allclose(padded[row, n_pad[row]:], alone[0, :-1], atol=1e-5)
            assert torch.allclose(step[row, -1], alone[0, -1], atol=1e-5)
        # No padding at all: the mask's path and the plain causal one agree.
        assert torch.allclose(model(idx, n_pad=torch.zeros(2, dtype=torch.long))[0], model(idx)[0], atol=1e-5)


def forward_backward(model, idx):
    """(logits, loss, gradients) of one forward and backward pass of model on idx."""
    model.zero_grad()
    logits, loss = model(idx, idx.roll(1))
    loss.backward()
    return logits.detach(), loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_dropout_0_changes_nothing_in_training_mode_and_draws_no_random_number():
    """At the default 0.0 a training-mode pass is bit for bit the evaluation-mode pass (where no
    dropout runs), and leaves the random state as it found it: a run without dropout is the run of
    a GPT that has none."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    assert model.config.dropout == 0.0
    idx = torch.randint(0, 128, (3, 32))
    before = torch.get_rng_state()
    trained = forward_backward(model.train(), idx)
    assert torch.equal(torch.get_rng_state(), before)
    evaluated = forward_backward(model.eval(), idx)
    assert torch.equal(trained[0], evaluated[0]) and torch.equal(trained[1], evaluated[1])
    for name, grad in evaluated[2].items():
        assert torch.equal(trained[2][name], grad), name


@pytest.mark.parametrize("config", [dict(dropout=-0.1), dict(dropout=1.0), dict(dropout=math.nan),
                                    dict(dropout=math.inf), dict(dropout=True), dict(dropout="0.1")])
def test_a_dropout_that_is_not_a_probability_is_refused(config):
    with pytest.raises(ValueError, match=r"^dropout must be a probability in \[0, 1\), not "):
        GPTConfig(**TINY, **config)


def test_dropout_is_hugging_faces_in_training_and_evaluation(hf_gpt2_dir):
    """GPT-2's three dropouts at one rate, where Hugging Face applies them: with the same seed a
    training-mode pass draws the same masks and gives its logits; in evaluation mode, those of the
    same weights without dropout. The directory's pdrops (OpenAI's 0.1) are not read."""
    hf, path = hf_gpt2_dir
    assert (hf.config.resid_pdrop, hf.config.embd_pdrop, hf.config.attn_pdrop) == (0.1, 0.1, 0.1)
    assert GPT.from_pretrained(path).config.dropout == 0.0
    ours = GPT.from_pretrained(path, dropout=0.1)
    assert ours.config.dropout == 0.1
    idx = torch.randint(0, 128, (3, 64))
    hf.train()
    ours.train()
    torch.manual_seed(5)
    expected = hf(idx).logits
    torch.manual_seed(5)
    got = ours(idx)[0]
    assert (got - expected).abs().max().item() < 1e-4
    assert (got - ours.eval()(idx)[0]).abs().max().item() > 0.1  # the masks made a difference
    with torch.no_grad():
        assert (ours(idx)[0] - hf.eval()(idx).logits).abs().max().item() < 1e-4
        assert torch.equal(ours(idx)[0], GPT.from_pretrained(path).eval()(idx)[0])
