"""GPT-2's training loss, computed without slicing off the padded vocabulary: masked (the default)
and chunked (--chunked_loss), each against the sliced reference, loss and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, chunked_cross_entropy, cross_entropy
from tokenizer import N_VOCAB, PADDED_VOCAB

CONFIG = GPTConfig(block_size=64, vocab_size=PADDED_VOCAB, n_layer=2, n_head=2, n_embd=32)


def sliced_loss(model, idx, targets):
    """The reference: the padding columns sliced away before a float32 cross-entropy."""
    logits = F.linear(model.hidden_states(idx), model.lm_head.weight)[..., :N_VOCAB]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)


def loss_and_gradients(model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, N_VOCAB, (2, 40), generator=g)
    targets = torch.randint(0, N_VOCAB, (2, 40), generator=g)
    targets[0, :7] = -1  # ignored positions count in neither the sum nor the mean
    return idx, targets


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("padding_rows", [None, 1e30])
def test_the_loss_and_its_gradients_equal_the_sliced_reference(batch, chunked, padding_rows):
    """In float32 on a CPU within 1e-6, however large the padding rows of the tied weight are:
    they take no part in the softmax, and get no gradient from the head."""
    idx, targets = batch
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected_loss, expected = loss_and_gradients(model, lambda: sliced_loss(model, idx, targets))
    if padding_rows is not None:
        with torch.no_grad():
            model.lm_head.weight[N_VOCAB:] = padding_rows
    loss, grads = loss_and_gradients(model, lambda: model(idx, targets, chunked_loss=chunked)[1])
    assert loss == pytest.approx(expected_loss, rel=1e-6, abs=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)
    assert not grads["transformer.wte.weight"][N_VOCAB:].any()  # the padding rows (tied: wte is lm_head) get no gradient


def test_the_training_forward_returns_no_padding_logits(batch):
    idx, targets = batch
    model = GPT(CONFIG)
    with torch.no_grad():
        model.lm_head.weight[N_VOCAB:] = 100.0  # padding rows would win every argmax
    logits, _ = model(idx, targets)
    assert logits.shape == (2, 40, N_VOCAB)
    assert torch.equal(logits, model(idx)[0])


def test_cross_entropy_masks_only_the_columns_past_n_tokens():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(5, 12, generator=g), torch.randint(0, 9, (5,), generator=g)
    assert torch.equal(cross_entropy(logits, targets, 9), F.cross_entropy(logits[:, :9], targets))
    assert torch.equal(cross_entropy(logits, targets, 12), F.cross_entropy(logits, targets))


@pytest.mark.parametrize("chunk", [16, 80, 1000])  # 5 chunks (the last one short), one exact, one larger
def test_the_chunked_loss_is_the_same_at_any_chunk_size(chunk):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, 8, generator=g, requires_grad=True)
    weight = torch.randn(24, 8, generator=g, requires_grad=True)
    targets = torch.randint(-1, 20, (2, 40), generator=g)
    expected = cross_entropy(x @ weight.T, targets, 20)
    expected_grads = torch.autograd.grad(3 * expected, [x, weight])  # the backward scales by its incoming gradient
    loss = chunked_cross_entropy(x, weight, targets, 20, chunk=chunk)
    grads = torch.autograd.grad(3 * loss, [x, weight])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_chunked_loss_without_gradients_keeps_none():
    """Evaluation: no gradient is computed or kept, and the loss is the same."""
    x, weight = torch.randn(40, 8), torch.randn(24, 8, requires_grad=True)
    targets = torch.randint(0, 20, (40,))
    with torch.no_grad():
        loss = chunked_cross_entropy(x[None], weight, targets[None], 20, chunk=16)
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(cross_entropy(x @ weight.T, targets, 20).item(), rel=1e-6)

