"""GPT-2's training loss computed three ways (loss.py): masked, and the one op with torch's row kernel
(chunked) or Triton's (fused), the latter run by Triton's interpreter on the CPU. Each against the
sliced reference, loss and every gradient: eager, through GPT.forward, compiled, and in the trainer.
bfloat16 is not judged here: the interpreter truncates to it where a GPU rounds (tests/test_gpu.py)."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import train_gpt2
from gpt2repro.lm.loss import chunked_cross_entropy, masked_cross_entropy, pick_loss
from gpt2repro.lm.tokenizer import N_VOCAB, PADDED_VOCAB
from helpers import REPO
from helpers.files import listdir
from helpers.kernels import TRITON, interpreted, needs_triton
from helpers.processes import one_line_error
from helpers.runs import TINY, assert_same_run, read_log, train
from model import GPT, GPTConfig

CONFIG = GPTConfig(block_size=64, vocab_size=PADDED_VOCAB, n_layer=2, n_head=2, n_embd=32)
# Each loss as a pytest parameter: the fused one only where its kernel can run here.
EACH_LOSS = ["masked", "chunked", pytest.param("fused", marks=interpreted)]
ROW_KERNELS = [pytest.param(False, id="torch"), pytest.param(True, id="triton", marks=interpreted)]
# What stops --loss fused on a CPU outside the interpreter: Triton's absence first, else the device.
FUSED_ON_CPU = "--loss fused runs on CUDA, not on cpu" if TRITON else "--loss fused needs Triton (pip install triton)"


@pytest.fixture(autouse=True)
def triton_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # not the user's ~/.triton


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


@pytest.mark.parametrize("loss_kind", EACH_LOSS)
@pytest.mark.parametrize("padding_rows", [None, 1e30])
def test_each_loss_and_its_gradients_equal_the_sliced_reference(batch, loss_kind, padding_rows):
    """In float32 through GPT.forward, within 1e-5, however large the padding rows of the tied weight
    are: they take no part in the softmax, and get no gradient from the head."""
    idx, targets = batch
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected_loss, expected = loss_and_gradients(model, lambda: sliced_loss(model, idx, targets))
    if padding_rows is not None:
        with torch.no_grad():
            model.lm_head.weight[N_VOCAB:] = padding_rows
    loss, grads = loss_and_gradients(model, lambda: model(idx, targets, loss_kind=loss_kind)[1])
    assert loss == pytest.approx(expected_loss, rel=0, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)
    assert not grads["transformer.wte.weight"][N_VOCAB:].any()  # the padding rows (tied: wte is lm_head) get no gradient


def test_the_masked_loss_is_the_sliced_one_to_the_bit_and_returns_no_padding_logits(batch):
    idx, targets = batch
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(5, 12, generator=g), torch.randint(0, 9, (5,), generator=g)
    assert torch.equal(masked_cross_entropy(logits, labels, 9), F.cross_entropy(logits[:, :9], labels))
    assert torch.equal(masked_cross_entropy(logits, labels, 12), F.cross_entropy(logits, labels))
    model = GPT(CONFIG)
    with torch.no_grad():
        model.lm_head.weight[N_VOCAB:] = 100.0  # padding rows would win every argmax
    logits, _ = model(idx, targets)
    assert logits.shape == (2, 40, N_VOCAB)
    assert torch.equal(logits, model(idx)[0])


def op_inputs(dtype=torch.float32, padding_rows=0.0):
    """Hidden states (2, 40, 8), a weight of 24 rows whose last 4 are padding (at padding_rows),
    20 real tokens, targets with ignored positions, in dtype."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, 8, generator=g)
    weight = torch.randn(24, 8, generator=g)
    weight[20:] = padding_rows
    targets = torch.randint(-1, 20, (2, 40), generator=g)
    return x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), targets


@pytest.mark.parametrize("triton", ROW_KERNELS)
@pytest.mark.parametrize("chunk", [16, 80, 1000])  # 5 chunks (the last one short), one exact, one larger
def test_the_op_equals_the_masked_loss_at_any_chunk_size(triton, chunk):
    """Loss and both gradients within 1e-5 in float32, scaled by the incoming gradient; the padding
    rows (at 1e30) and the ignored positions get no gradient."""
    x, weight, targets = op_inputs(padding_rows=1e30)
    expected = masked_cross_entropy(x @ weight[:20].T, targets, 20)
    expected_grads = torch.autograd.grad(3 * expected, [x, weight])
    loss = chunked_cross_entropy(x, weight, targets, 20, triton, chunk=chunk)
    grads = torch.autograd.grad(3 * loss, [x, weight])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=0, abs=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not grads[1][20:].any() and not grads[0][targets == -1].any()


@pytest.mark.parametrize("triton", ROW_KERNELS)
def test_the_op_without_gradients_keeps_none(triton):
    """Evaluation: no gradient is computed or kept, and the loss is the same."""
    x, weight, targets = op_inputs()
    with torch.no_grad():
        loss = chunked_cross_entropy(x, weight, targets, 20, triton, chunk=16)
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(masked_cross_entropy(x @ weight.T, targets, 20).item(), rel=1e-6)


def errors(loss_fn, x, weight, targets):
    """The largest errors of loss_fn's loss, x gradient and weight gradient against float32's masked loss."""
    xf, wf = (t.detach().float().requires_grad_() for t in (x, weight))
    expected = masked_cross_entropy(xf @ wf.T, targets, 20)
    expected_grads = torch.autograd.grad(expected, [xf, wf])
    loss = loss_fn(x, weight, targets)
    grads = torch.autograd.grad(loss, [x, weight])
    return [(loss.float() - expected).abs().item()] + [(g.float() - e).abs().max().item()
                                                       for g, e in zip(grads, expected_grads)]


@pytest.mark.parametrize("triton", ROW_KERNELS)
def test_in_float16_the_op_errs_no_more_than_the_masked_loss(triton):
    """Against float32 on the same float16 inputs, the op's errors (loss, x and weight gradients) are
    at most twice the masked loss's: both round the logits and their gradient to float16 and compute
    the rest in float32, so only summation order and where the gradient is scaled should differ (the
    op rounds the unscaled gradient, the masked loss the gradient of the mean, less precise in float16)."""
    x, weight, targets = op_inputs(torch.float16)
    masked = errors(lambda x, w, t: masked_cross_entropy(x @ w.T, t, 20), x, weight, targets)
    chunked = errors(lambda x, w, t: chunked_cross_entropy(x, w, t, 20, triton, chunk=16), x, weight, targets)
    for name, got, bound in zip(("loss", "x gradient", "weight gradient"), chunked, masked):
        assert got <= 2 * bound, f"{name}: {got:.2e}, the masked loss's {bound:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("loss_kind", EACH_LOSS[1:])
def test_the_op_compiles_into_the_models_graph_whole(batch, loss_kind):
    """A custom op: torch.compile traces the model with it in one graph (fullgraph=True raises at a
    break), and the compiled model has the eager masked loss's loss and every gradient. aot_eager
    runs what inductor's graph would (fake tensors, the op's registered backward) in seconds."""
    idx, targets = batch
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected_loss, expected = loss_and_gradients(model, lambda: model(idx, targets)[1])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    loss, grads = loss_and_gradients(model, lambda: compiled(idx, targets, loss_kind=loss_kind)[1])
    assert counter.frame_count == 1
    assert loss == pytest.approx(expected_loss, rel=0, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_the_chunked_loss_compiled_by_inductor_gives_every_gradient(batch):
    """Inductor, the GPU's compiler, on the CPU: every parameter's gradient norm equals eager's. The
    chunked loss of before (an autograd.Function) failed exactly this on torch 2.11, on any device:
    every gradient 0.0."""
    idx, targets = batch
    torch.manual_seed(0)
    model = GPT(CONFIG)
    _, eager = loss_and_gradients(model, lambda: model(idx, targets, loss_kind="chunked")[1])
    torch._dynamo.reset()
    compiled = torch.compile(model)
    _, grads = loss_and_gradients(model, lambda: compiled(idx, targets, loss_kind="chunked")[1])
    for name, grad in eager.items():
        assert grad.norm() > 0, name
        assert grads[name].norm().item() == pytest.approx(grad.norm().item(), rel=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("loss_kind", EACH_LOSS[1:])
def test_the_trainer_under_each_loss_trains_as_under_the_masked_loss(shards, tmp_path, loss_kind):
    """--loss chunked and --loss fused reach the step and the val loss: the same per-step losses,
    norms and val losses as the masked loss, within float32's summation order."""
    flags = ["--total_batch_size", "256", "-B", "4", "--max_steps", "3", "--eval_interval", "3", "--val_steps", "2"]
    masked = train(shards, tmp_path / "masked", *flags, "--loss", "masked")
    other = train(shards, tmp_path / loss_kind, *flags, "--loss", loss_kind)
    assert_same_run(masked, other)
    assert [r["val_loss"] for r in other if "val_loss" in r] == \
        pytest.approx([r["val_loss"] for r in masked if "val_loss" in r], rel=1e-5)


def test_auto_is_the_fused_loss_on_cuda_with_triton_and_the_masked_loss_elsewhere():
    assert pick_loss("auto", "cuda", triton=True) == "fused"
    assert pick_loss("auto", "cuda", triton=False) == "masked"
    assert pick_loss("auto", "cpu", triton=True) == "masked"
    assert pick_loss("auto", "mps", triton=True) == "masked"
    for kind in ("masked", "chunked"):
        assert pick_loss(kind, "mps", triton=False) == kind


def test_a_fused_loss_that_cannot_run_here_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"--loss fused needs Triton \(pip install triton\)"):
        pick_loss("fused", "cuda", triton=False)
    for device_type in ("cpu", "mps"):
        with pytest.raises(ValueError, match=f"--loss fused runs on CUDA, not on {device_type}"):
            pick_loss("fused", device_type, triton=True)
    x, weight, targets = op_inputs()
    with pytest.raises(ValueError, match=re.escape(FUSED_ON_CPU)):  # called directly, as well as at start
        chunked_cross_entropy(x, weight, targets, 20, triton=True)


@pytest.mark.slow
def test_the_trainer_refuses_a_loss_that_cannot_run_before_it_makes_its_log_dir(shards, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "train_gpt2.py", *TINY, "--data_dir", shards, "--log_dir",
                             str(tmp_path / "log"), "--loss", "fused"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert one_line_error(result).startswith(f"error: {FUSED_ON_CPU}")
    assert not (tmp_path / "log").exists()


@pytest.mark.slow
def test_without_triton_the_model_imports_and_the_fused_loss_says_so():
    code = ("import sys; sys.modules['triton'] = None\n"  # import triton now fails, as where it is not installed
            "import torch, model\n"
            "try:\n"
            "    model.GPT(model.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4))(\n"
            "        torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), loss_kind='fused')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("--loss fused needs Triton (pip install triton)")


@pytest.mark.parametrize("flag", ["chunked_loss", "fused_loss"])
def test_the_flags_that_loss_replaced_are_one_line_naming_it(tmp_path, flag, capsys):
    """On the command line, with a value or none, and in a config file: a usage error that says what to use."""
    config = tmp_path / "old.toml"
    config.write_text(f"{flag} = 1\n")
    meant = f"--{flag} 1 was --loss {flag.split('_')[0]}"
    for argv in ([f"--{flag}", "1"], [f"--{flag}"], ["--config", str(config)]):
        with pytest.raises(SystemExit) as exit_info:
            train_gpt2.parse_args(argv)
        assert exit_info.value.code == 2
        message = capsys.readouterr().err.strip()
        assert "\n" not in message and meant in message and "--loss auto|masked|chunked|fused" in message
        assert f"--{flag} is gone" in message


@pytest.mark.slow
def test_a_checkpoint_that_records_the_flags_loss_replaced_resumes(shards, tmp_path):
    """Written before --loss, its record says --chunked_loss 1: the run resumes, under its own --loss,
    to the losses of the run uninterrupted."""
    flags = ["--total_batch_size", "256", "-B", "4", "--max_steps", "4"]
    whole = train(shards, tmp_path / "whole", *flags)
    train(shards, tmp_path / "log", *flags[:-1], "2")
    path = tmp_path / "log" / "ckpt_000002.pt"
    state = torch.load(path, weights_only=True)
    state["args"] = state.pop("flags")  # as checkpoints of that time named the record
    del state["args"]["loss"]
    state["args"].update(chunked_loss=1, fused_loss=0)
    torch.save(state, path)
    resumed = train(shards, tmp_path / "log", *flags, "--resume", "auto", "--loss", "masked")
    assert_same_run(resumed, whole, rel=0)


def test_a_step_without_gradient_is_refused_before_the_optimizer_steps(shards, tmp_path, monkeypatch, capsys):
    """A loss whose graph is cut: every gradient None, norm exactly 0 at a finite loss. The run stops
    at its first step in one line naming the loss; no checkpoint of untrained weights is written."""
    forward = GPT.forward

    def cut(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        return logits, None if loss is None else loss.detach().requires_grad_()
    monkeypatch.setattr(GPT, "forward", cut)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(TINY + ["--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--total_batch_size", "256",
                                "-B", "4", "--max_steps", "3", "--loss", "chunked"])
    assert exit_info.value.code == 1
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: no parameter received a gradient (the gradient norm is exactly 0 at loss ")
    assert message.endswith("under --loss chunked: this configuration trains nothing")
    assert not [r for r in read_log(tmp_path / "log") if "train_loss" in r]
    assert not [name for name in listdir(tmp_path / "log") if name.startswith("ckpt_")]


@needs_triton
@pytest.mark.slow
def test_the_kernel_compiles_for_a_hopper_gpu():
    """What the interpreter does not check: Triton's compiler takes the kernel, for sm_90, in
    training (bf16, fp16) and in evaluation (float32, no gradients). Run without a GPU, in a
    process of its own: Triton decides at import whether its functions are interpreted or compiled."""
    code = ("import triton\nfrom gpt2repro.lm import loss\n"
            "from triton.backends.compiler import GPUTarget\n"
            "from triton.compiler import ASTSource\n"
            "for dtype, with_grads in (('*bf16', True), ('*fp16', True), ('*fp32', False)):\n"
            "    signature = dict(logits_ptr=dtype, stride='i32', targets_ptr='*i64', losses_ptr='*fp32',\n"
            "                     n_tokens='i32', n_cols='i32', BLOCK='constexpr', WITH_GRADS='constexpr')\n"
            "    source = ASTSource(loss._kernel(), signature, constexprs=dict(BLOCK=loss.BLOCK, WITH_GRADS=with_grads))\n"
            "    kernel = triton.compile(source, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=16))\n"
            "    assert kernel.asm['cubin'], dtype\n"
            "print('compiled')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "compiled\n"
