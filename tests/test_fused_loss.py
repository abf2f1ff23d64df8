"""The fused classifier (fused_loss.py) on the CPU, its Triton kernel run by Triton's interpreter:
loss and both gradients against the sliced reference in float32 and float16, through GPT.forward
and under torch.compile; and the kernel compiled for a Hopper GPU. bfloat16 is not judged here:
the interpreter truncates to it where a GPU rounds, so its error says nothing of a GPU's."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import memory
from fused_loss import fused_cross_entropy
from helpers import assert_same_run, train
from model import GPT, cross_entropy
from test_loss import CONFIG, loss_and_gradients
from test_memory import CONFIG as SMALL_CONFIG, saved_for_backward
from tokenizer import N_VOCAB, PADDED_VOCAB

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton)")
# Triton's interpreter, which runs the kernel on CPU tensors, is on where there is no GPU (conftest.py).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter is off: conftest.py sets it only where there is no GPU")


@pytest.fixture(autouse=True)
def triton_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # not the user's ~/.triton


def head_batch(dtype, padding_rows=0.0):
    """Hidden states (2, 12, 16), the padded head weight with its padding rows at padding_rows,
    and targets with 7 positions ignored, in dtype."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 16, generator=g)
    weight = torch.randn(PADDED_VOCAB, 16, generator=g)
    weight[N_VOCAB:] = padding_rows
    targets = torch.randint(0, N_VOCAB, (2, 12), generator=g)
    targets[0, :5] = targets[1, -2:] = -1
    return x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), targets


def sliced_reference(x, weight, targets):
    """The mean cross-entropy in float32, the weight's padding rows sliced away."""
    logits = x.float() @ weight[:N_VOCAB].float().T
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def errors(loss_fn, x, weight, targets):
    """The largest errors of loss_fn's loss, x gradient and weight gradient against the sliced reference's."""
    expected = sliced_reference(x, weight, targets)
    expected_grads = torch.autograd.grad(expected, [x, weight])
    loss = loss_fn(x, weight, targets)
    grads = torch.autograd.grad(loss, [x, weight])
    return [(loss.float() - expected).abs().item()] + [(g.float() - e.float()).abs().max().item()
                                                       for g, e in zip(grads, expected_grads)]


@needs_triton
@interpreted
@pytest.mark.slow
def test_the_loss_and_its_gradients_equal_the_sliced_reference_in_float32():
    """Within 1e-5, in chunks of 10 rows (the last one short), with padding rows of 1e30: they take
    no part in the loss and get no gradient; nor do the ignored positions."""
    x, weight, targets = head_batch(torch.float32, padding_rows=1e30)
    expected = sliced_reference(x, weight, targets)
    expected_grads = torch.autograd.grad(3 * expected, [x, weight])
    loss = fused_cross_entropy(x, weight, targets, N_VOCAB, chunk=10)
    grads = torch.autograd.grad(3 * loss, [x, weight])  # the backward scales by its incoming gradient
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=0, abs=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not grads[1][N_VOCAB:].any()
    assert not grads[0][targets == -1].any()


@needs_triton
@interpreted
@pytest.mark.slow
def test_in_float16_the_fused_loss_errs_no_more_than_the_masked_loss():
    """Against the float32 reference on the same float16 inputs, the fused loss's errors (loss, x
    and weight gradients) are at most twice the masked loss's: both round the logits and their
    gradient to float16 and compute the rest in float32, so only summation order and where the
    gradient is scaled should differ (the fused one rounds the unscaled gradient, the masked one
    the gradient of the mean, smaller and less precise in float16)."""
    x, weight, targets = head_batch(torch.float16)
    masked = errors(lambda x, w, t: cross_entropy(x @ w.T, t, N_VOCAB), x, weight, targets)
    fused = errors(lambda x, w, t: fused_cross_entropy(x, w, t, N_VOCAB, chunk=10), x, weight, targets)
    for name, got, bound in zip(("loss", "x gradient", "weight gradient"), fused, masked):
        assert got <= 2 * bound, f"{name}: {got:.2e}, the masked loss's {bound:.2e}"


@needs_triton
@interpreted
@pytest.mark.slow
def test_gpt_forward_with_the_fused_loss_equals_the_masked_loss():
    """The loss and every parameter's gradient within 1e-5 in float32; and without gradients
    (evaluation) the same loss."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, N_VOCAB, (2, 12), generator=g)
    targets = torch.randint(0, N_VOCAB, (2, 12), generator=g)
    targets[0, :3] = -1
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected_loss, expected = loss_and_gradients(model, lambda: model(idx, targets)[1])
    loss, grads = loss_and_gradients(model, lambda: model(idx, targets, fused_loss=True)[1])
    assert loss == pytest.approx(expected_loss, rel=0, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():
        logits, loss = model(idx, targets, fused_loss=True)
    assert logits is None and loss.item() == pytest.approx(expected_loss, rel=0, abs=1e-5)


@needs_triton
@interpreted
@pytest.mark.slow
def test_the_trainer_under_fused_loss_trains_as_under_the_masked_loss(shards, tmp_path):
    """--fused_loss 1 reaches the step and the val loss: the same per-step losses, norms and val
    losses as the default masked loss, within float32's summation order."""
    flags = ["--total_batch_size", "256", "-B", "4", "--max_steps", "3", "--eval_interval", "3", "--val_steps", "2"]
    masked = train(shards, tmp_path / "masked", *flags)
    fused = train(shards, tmp_path / "fused", *flags, "--fused_loss", "1")
    assert_same_run(masked, fused)
    assert [r["val_loss"] for r in fused if "val_loss" in r] == \
        pytest.approx([r["val_loss"] for r in masked if "val_loss" in r], rel=1e-5)


@needs_triton
@interpreted
@pytest.mark.slow
def test_the_fused_loss_compiles_into_the_models_graph_whole():
    """A custom op: torch.compile traces the model with it in one graph (fullgraph=True raises at a
    break), and the compiled step has the eager masked loss's loss and gradients. aot_eager
    runs what inductor's graph would (fake tensors, the op's registered backward) in seconds."""
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, N_VOCAB, (2, 1, 12), generator=g)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected_loss, expected = loss_and_gradients(model, lambda: model(idx, targets)[1])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    loss, grads = loss_and_gradients(model, lambda: compiled(idx, targets, fused_loss=True)[1])
    assert counter.frame_count == 1
    assert loss == pytest.approx(expected_loss, rel=0, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)


@needs_triton
@interpreted
def test_the_fused_loss_keeps_what_the_memory_plan_counts():
    """For the backward, the head's input gradient in the place of its input, and the head's
    float32 weight gradient (memory.head_gradient_bytes)."""
    model = GPT(SMALL_CONFIG).train()
    B, T = 2, 24
    measured = saved_for_backward(model, torch.randint(0, SMALL_CONFIG.vocab_size, (B, T)), fused_loss=True)
    estimate = memory.activation_bytes(SMALL_CONFIG, B, T, a=4) + memory.head_gradient_bytes(SMALL_CONFIG)
    assert estimate == pytest.approx(measured, rel=0.02)  # exact but for a few scalars and int64 ids


def test_the_chunked_and_the_fused_loss_are_not_both_taken():
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="choose one"):
        GPT(CONFIG)(idx, idx, chunked_loss=True, fused_loss=True)


@needs_triton
def test_on_a_cpu_without_the_interpreter_the_fused_loss_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, targets = head_batch(torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_cross_entropy(x, weight, targets, N_VOCAB)


@pytest.mark.slow
def test_without_triton_the_model_imports_and_the_fused_loss_says_so():
    code = ("import sys; sys.modules['triton'] = None\n"  # import triton now fails, as where it is not installed
            "import torch, model\n"
            "x = torch.zeros(1, 2, 8)\n"
            "try:\n"
            "    model.fused_cross_entropy(x, torch.zeros(10, 8), torch.zeros(1, 2, dtype=torch.long), 9)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "the fused loss needs Triton: pip install triton\n"


@needs_triton
@pytest.mark.slow
def test_the_kernel_compiles_for_a_hopper_gpu():
    """What the interpreter does not check: Triton's compiler takes the kernel, for sm_90, in
    training (bf16, fp16) and in evaluation (float32, no gradients). Run without a GPU, in a
    process of its own: Triton decides at import whether its functions are interpreted or compiled."""
    code = ("import triton, fused_loss\n"
            "from triton.backends.compiler import GPUTarget\n"
            "from triton.compiler import ASTSource\n"
            "for dtype, with_grads in (('*bf16', True), ('*fp16', True), ('*fp32', False)):\n"
            "    signature = dict(logits_ptr=dtype, stride='i32', targets_ptr='*i64', losses_ptr='*fp32',\n"
            "                     n_tokens='i32', n_cols='i32', BLOCK='constexpr', WITH_GRADS='constexpr')\n"
            "    source = ASTSource(fused_loss._kernel(), signature,\n"
            "                       constexprs=dict(BLOCK=fused_loss.BLOCK, WITH_GRADS=with_grads))\n"
            "    kernel = triton.compile(source, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=16))\n"
            "    assert kernel.asm['cubin'], dtype\n"
            "print('compiled')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "compiled\n"
