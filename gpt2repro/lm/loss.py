"""GPT-2's training loss, the mean cross-entropy over the real vocabulary, computed three ways
(--loss); each gives the same loss and gradients as logits sliced to the 50,257 real columns:

- masked: the padded head's logits whole, the padding columns masked to -inf (masked_cross_entropy).
  The default on a CPU: a compiled GPU step fuses it well, but holds (B*T, vocab) logits.
- chunked and fused: one op (linear_cross_entropy) on llm.c's fused-classifier design. Per chunk of
  positions: one matmul on the whole padded weight into a reused logits buffer; a row kernel that
  computes each row's loss in float32 over the real columns and writes the logits' gradient over
  them in place (0 on the padding columns); two matmuls for the hidden states' gradient and the
  weight's, the latter summed in float32. The gradients are computed in the forward pass, while
  the logits are at hand, and kept for the backward: no (B*T, vocab) tensor is ever whole. The row
  kernel is torch ops (chunked: any device) or one Triton kernel, a program per row (fused: CUDA,
  or Triton's interpreter in the tests). fused is the default on CUDA where Triton imports.

The op is a torch.library custom op, so torch.compile calls it whole rather than tracing it.
(As a torch.autograd.Function, the chunked loss of before trained nothing when compiled on torch
2.11: its output, a zero tensor summed into in place, reached its backward with a zero gradient.)

Written here rather than taken from a library: Liger-Kernel is exact only on a weight sliced to the
real vocabulary (unaligned matmuls) and reads the loss on the host every call; cut-cross-entropy
sums its gradients in 16 bits; quack runs on no CPU; F.linear_cross_entropy is missing from older
torch, is not compiled into the graph, and needs the sliced weight too.
"""
import functools
import importlib.util
import os

import torch
from torch.nn import functional as F

LOSSES = ("masked", "chunked", "fused")  # --loss; auto picks one of them (pick_loss)
CHUNK = 8192  # positions whose logits the buffer holds at once: 824 MB in bf16 at 50304 (untuned)
BLOCK = 8192  # columns a Triton program reads at once, 16 a thread in 16 warps (untuned)


def has_triton():
    """Whether Triton is installed, for the fused loss's kernel."""
    return importlib.util.find_spec("triton") is not None


def pick_loss(requested, device_type, triton=None):
    """The loss --loss names (one of LOSSES, or auto) on device_type: auto is fused on CUDA where
    Triton imports, else masked. ValueError, one line, for a fused loss that cannot run here.
    triton: whether Triton imports (default: has_triton())."""
    triton = has_triton() if triton is None else triton
    if requested == "auto":
        return "fused" if device_type == "cuda" and triton else "masked"
    if requested == "fused":
        if not triton:
            raise ValueError("--loss fused needs Triton (pip install triton); --loss chunked saves the same memory "
                             "without it")
        if device_type != "cuda" and not (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError(f"--loss fused runs on CUDA, not on {device_type} (on a CPU only in Triton's interpreter, "
                             f"TRITON_INTERPRET=1, for the tests); --loss chunked saves the same memory here")
    return requested


# ----------------------------------------------------------------------------- masked

def masked_cross_entropy(logits, targets, n_tokens):
    """The mean cross-entropy of logits (..., vocab_size) against targets (..., -1 ignored) over
    the first n_tokens columns: the rest, the rows padded onto the vocabulary, are masked to -inf,
    so the softmax gives them probability 0 and gradient 0, as a slice would; a slice would make
    the loss read a strided copy and write back a zero-padded gradient (17% of a GPU step)."""
    if logits.size(-1) > n_tokens:
        logits = logits.masked_fill(torch.arange(logits.size(-1), device=logits.device) >= n_tokens, float("-inf"))
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-1)


# ----------------------------------------------------------------------------- chunked and fused

def chunked_cross_entropy(x, weight, targets, n_tokens, triton=False, chunk=CHUNK):
    """masked_cross_entropy(x @ weight.T, targets, n_tokens) for hidden states x (B, T, C), the
    weight (vocab_size, C) padded or not, and targets (B, T) with -1 ignored, by
    linear_cross_entropy with Triton's row kernel or torch's: the mean loss, computed in autocast's
    dtype under autocast, else in x's. ValueError where Triton's cannot run (pick_loss)."""
    device = x.device.type
    if triton:
        pick_loss("fused", device)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        total, _, _ = linear_cross_entropy(x.flatten(0, 1).to(dtype), weight.to(dtype), targets.flatten().contiguous(),
                                           n_tokens, chunk, with_grads, triton)
    # The mean is taken here, not in the row kernel: the gradient kept in 16 bits is that of the sum,
    # as 1/n_valid (1/65536 at B=64) would push fp16's softmax values below its smallest subnormal.
    return total / (targets != -1).sum()


@torch.library.custom_op("gpt2::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_tokens: int, chunk: int,
                         with_grads: bool, triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of x (N, C) @ weight.T against targets (N,), float32, and its
    gradients for x and (float32) for weight: empty without with_grads. triton: the row kernel."""
    N, V = len(x), len(weight)
    losses = torch.empty(N, dtype=torch.float32, device=x.device)
    grad_x, grad_weight = _gradients(x, weight, with_grads)
    grad_weight.zero_()
    buffer = x.new_empty(min(chunk, N), V)
    rows = triton_rows if triton else torch_rows
    for i in range(0, N, chunk):
        xc = x[i:i + chunk]
        logits = buffer[:len(xc)]
        torch.mm(xc, weight.T, out=logits)
        rows(logits, targets[i:i + chunk], losses[i:i + chunk], n_tokens, with_grads)
        if with_grads:  # logits now holds d(summed loss)/d(logits)
            torch.mm(logits, weight, out=grad_x[i:i + chunk])
            grad_weight += (logits.T @ xc).float()
    return losses.sum(), grad_x, grad_weight


@linear_cross_entropy.register_fake
def _(x, weight, targets, n_tokens, chunk, with_grads, triton):
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
    return grad_x * grad_total.to(grad_x.dtype), (grad_weight * grad_total).to(grad_x.dtype), None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- the row kernels

def torch_rows(logits, targets, losses, n_tokens, with_grads):
    """Each row r of logits (rows, n_cols): its loss against targets[r] into losses[r], 0 for a
    target of -1; with with_grads, the row overwritten by its gradient, softmax minus one-hot over
    the first n_tokens columns and 0 on the rest (all 0 for a target of -1). In float32 over the
    real columns, as triton_rows; a target among the padding columns reads -inf, an infinite loss."""
    real = logits[:, :n_tokens].float()  # a copy in 16 bits, the buffer itself in float32
    lse = real.logsumexp(dim=-1)
    ignored = targets == -1
    index = targets.clamp(0, n_tokens - 1)[:, None]  # an ignored target counts for nothing, a padding one is -inf
    picked = real.gather(1, index).squeeze(1).masked_fill(targets >= n_tokens, float("-inf"))
    losses.copy_((lse - picked).masked_fill(ignored, 0.0))
    if with_grads:
        grad = real.sub_(lse[:, None]).exp_()  # in place: no second (rows, n_tokens) float32 tensor
        grad.scatter_add_(1, index, torch.full_like(picked[:, None], -1.0))
        logits[:, :n_tokens] = grad.masked_fill_(ignored[:, None], 0.0)
        logits[:, n_tokens:] = 0


def triton_rows(logits, targets, losses, n_tokens, with_grads):
    """torch_rows in one Triton kernel, a program per row."""
    _kernel()[(len(logits),)](logits, logits.stride(0), targets, losses, n_tokens, logits.size(1), BLOCK=BLOCK,
                              WITH_GRADS=with_grads, num_warps=16)


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
        """Program r: torch_rows for row r."""
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
        # A target outside the real columns reads -inf, an infinite loss, and nothing out of bounds.
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
