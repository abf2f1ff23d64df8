"""The fused classifier, opt-in (GPT.forward(..., fused_loss=True)): the head's matmul and GPT-2's
cross-entropy with its gradients, a chunk of positions at a time, on llm.c's design. Per chunk: one
matmul on the whole padded weight into a reused logits buffer; one Triton kernel, a program per
row, that computes the row's max, sum of exponentials and loss in float32 over the real columns
only and writes the logits' gradient over them in place (0 on the padding columns); two matmuls
for the hidden states' gradient and the weight's, the latter summed in float32. As with
model.LinearCrossEntropy, the gradients are computed in the forward pass and kept for the backward.

Written here rather than taken from a library: Liger-Kernel is exact only on a weight sliced to
the real vocabulary (unaligned matmuls) and reads the loss on the host every call; cut-cross-entropy
sums its gradients in 16 bits; quack runs on no CPU; F.linear_cross_entropy is missing from older
torch, is not compiled into the graph, and needs the sliced weight too.

Triton is optional: without it this module imports, and the loss raises one clear error. On a CPU
the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1), slowly: that is for the tests.
"""
import functools
import importlib.util
import os

import torch

CHUNK = 8192  # positions whose logits the buffer holds at once: 824 MB in bf16 at 50304 (untuned: no GPU run)
BLOCK = 8192  # columns a program reads at once, 16 a thread in 16 warps (untuned)


def fused_cross_entropy(x, weight, targets, n_tokens, chunk=CHUNK):
    """model.cross_entropy(x @ weight.T, targets, n_tokens) for hidden states x (B, T, C), the
    weight (vocab_size, C) padded or not, and targets (B, T) with -1 ignored: the mean loss,
    computed in autocast's dtype under autocast, else in x's."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("the fused loss needs Triton: pip install triton")
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the fused loss runs on a GPU; on a CPU only under TRITON_INTERPRET=1 (the tests)")
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        total, _, _ = linear_cross_entropy(x.flatten(0, 1).to(dtype), weight.to(dtype), targets.flatten().contiguous(),
                                           n_tokens, chunk, with_grads)
    # The mean is taken here, not in the kernel: the gradient kept in 16 bits is that of the sum, as
    # 1/n_valid (1/65536 at B=64) would push fp16's softmax values below its smallest subnormal.
    return total / (targets != -1).sum()


@torch.library.custom_op("fused_loss::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_tokens: int, chunk: int,
                         with_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of x (N, C) @ weight.T against targets (N,), float32, and its
    gradients for x and (float32) for weight: empty without with_grads. A custom op, so that
    torch.compile calls it whole instead of tracing the kernel."""
    N, V = len(x), len(weight)
    losses = torch.empty(N, dtype=torch.float32, device=x.device)
    grad_x, grad_weight = _gradients(x, weight, with_grads)
    grad_weight.zero_()
    buffer = x.new_empty(min(chunk, N), V)
    for i in range(0, N, chunk):
        xc = x[i:i + chunk]
        logits = buffer[:len(xc)]
        torch.mm(xc, weight.T, out=logits)
        _kernel()[(len(xc),)](
            logits, logits.stride(0), targets[i:i + chunk], losses[i:i + chunk], n_tokens, V,
            BLOCK=BLOCK, WITH_GRADS=with_grads, num_warps=16)
        if with_grads:  # logits now holds d(summed loss)/d(logits)
            torch.mm(logits, weight, out=grad_x[i:i + chunk])
            grad_weight += (logits.T @ xc).float()
    return losses.sum(), grad_x, grad_weight


@linear_cross_entropy.register_fake
def _(x, weight, targets, n_tokens, chunk, with_grads):
    return (x.new_empty((), dtype=torch.float32), *_gradients(x, weight, with_grads))


def _gradients(x, weight, with_grads):
    """Uninitialized tensors for the gradients of x and (float32) weight, empty without with_grads."""
    if not with_grads:
        return x.new_empty(0), x.new_empty(0, dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(weight, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    _, grad_x, grad_weight = output
    ctx.mark_non_differentiable(grad_x, grad_weight)
    ctx.save_for_backward(grad_x, grad_weight)


def _backward(ctx, grad_total, *_):
    grad_x, grad_weight = ctx.saved_tensors
    return grad_x * grad_total.to(grad_x.dtype), (grad_weight * grad_total).to(grad_x.dtype), None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


@functools.cache
def _kernel():
    """The kernel, built on first use, as Triton is imported: every script imports model, few run
    this loss. Triton builds it for the interpreter if TRITON_INTERPRET=1 was set before it was
    imported (tests/conftest.py), else for the GPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_rows(logits_ptr, stride, targets_ptr, losses_ptr, n_tokens, n_cols,
                           BLOCK: tl.constexpr, WITH_GRADS: tl.constexpr):
        """Program r: the loss of logits row r against its target into losses[r], 0 for a target
        of -1; with WITH_GRADS, the row overwritten by its gradient, softmax minus one-hot over the
        first n_tokens columns and 0 on the rest up to n_cols (all 0 for a target of -1)."""
        row = logits_ptr + tl.program_id(0).to(tl.int64) * stride  # 64-bit: large chunks pass 2**31 elements
        target = tl.load(targets_ptr + tl.program_id(0))
        # Pass 1: each lane's running max and its sum of exponentials below it, over the real columns; the
        # lanes combined once at the end. A finite floor, not -inf: a lane that never sees a real column keeps
        # a sum of 0, where exp(-inf - -inf) would be NaN.
        m = tl.full((BLOCK,), -3.4e38, tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n_tokens, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(row + cols, mask=cols < n_tokens, other=float("-inf")).to(tl.float32)
            m_next = tl.maximum(m, v)
            s = s * tl.exp(m - m_next) + tl.exp(v - m_next)
            m = m_next
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
        real = target != -1
        # A target outside the real columns reads -inf, an infinite loss (the masked loss's for a padding
        # column; it raises beyond them), and nothing out of bounds.
        target_logit = tl.load(row + target, mask=(target >= 0) & (target < n_tokens), other=float("-inf"))
        tl.store(losses_ptr + tl.program_id(0), tl.where(real, lse - target_logit.to(tl.float32), 0.0))
        if WITH_GRADS:  # Pass 2: each block read again and overwritten by its gradient.
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(row + cols, mask=cols < n_tokens, other=float("-inf")).to(tl.float32)
                grad = tl.exp(v - lse) - (cols == target).to(tl.float32)
                grad = tl.where(real, grad, 0.0)
                tl.store(row + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)

    return cross_entropy_rows
