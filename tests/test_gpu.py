"""What only a GPU shows: the compiled bf16 step against eager under each loss, the attention kernel
a compiled model really runs, each loss as training computes it, FSDP on one GPU, and generation's
KV cache in bf16. Every test is marked cuda: `python -m pytest -m cuda` runs them where CUDA is, and they are
skipped elsewhere. Tolerances are bf16's: about 3 significant digits."""
import pytest
import torch
from torch.nn.attention import SDPBackend

import train_gpt2
from gpt2repro.lm.loss import LOSSES
from gpt2repro.lm.tokenizer import N_VOCAB, PADDED_VOCAB
from gpt2repro.training.step import StepConfig, build_trainable, train_step
from helpers.files import write_token_shards
from helpers.models import FixedBatches
from helpers.processes import run_ranks
from helpers.runs import TINY, read_log, train_records
from model import GPT, GPTConfig

pytestmark = pytest.mark.cuda
CONFIG = GPTConfig(block_size=256, vocab_size=PADDED_VOCAB, n_layer=2, n_head=4, n_embd=128)
ON_CUDA = ["--device", "cuda", "--dtype", "bfloat16"]  # after TINY, whose cpu and float32 they override


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: one process compiles some seven configurations, near
    Dynamo's limit of 8 recompilations of one function, past which it falls back to eager."""
    torch._dynamo.reset()


def batch(B=4, T=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N_VOCAB, (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]  # on the CPU: the loader's batches, which train_step moves


def losses_of(compile_mode, loss="masked", steps=3):
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    step = StepConfig(torch.bfloat16, tokens_per_step=2 * 4 * 256, loss_kind=loss, compile_mode=compile_mode)
    t = build_trainable(model, "cuda", step)
    loader = FixedBatches([batch(seed=i) for i in range(2)])
    return [train_step(t, loader, 1e-3) for _ in range(steps)]


@pytest.mark.parametrize("loss", LOSSES)
def test_the_compiled_bf16_step_matches_eager(loss):
    """Each loss, eager and compiled, against the eager masked loss: the same losses and gradient
    norms within bf16's tolerance, and gradients that are there."""
    eager = losses_of(None)
    for compile_mode in (None, "default"):
        steps = losses_of(compile_mode, loss)
        assert [s.loss for s in steps] == pytest.approx([s.loss for s in eager], rel=1e-2)
        assert [s.grad_norm for s in steps] == pytest.approx([s.grad_norm for s in eager], rel=5e-2)


def attention_kernels(kernels):
    """The names of the GPU kernels that a compiled forward under these SDPA backends ran."""
    model = GPT(CONFIG, attention=kernels).cuda()
    compiled = torch.compile(model)
    idx = batch()[0].cuda()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        compiled(idx)  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(idx)
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_the_attention_kernel_chosen_is_the_one_that_runs_under_compile():
    """A compiled graph picks its kernel when traced: the backends must be set inside the forward."""
    assert any("flash" in name.lower() for name in attention_kernels([SDPBackend.FLASH_ATTENTION]))
    assert not any(word in name.lower() for name in attention_kernels([SDPBackend.MATH])
                   for word in ("flash", "fmha", "attention", "sdpa"))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("compiled", [False, True])
def test_the_bf16_loss_matches_the_sliced_float32_reference(loss, compiled):
    """The loss and every parameter's gradient, in bf16 autocast, eager and compiled, against float32
    logits sliced to the real vocabulary: within bf16's error, and never a gradient of zero."""
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    idx, targets = (t.cuda() for t in batch())

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}

    logits = torch.nn.functional.linear(model.hidden_states(idx), model.lm_head.weight)[..., :N_VOCAB]
    expected_loss, expected = gradients(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    with torch.autocast("cuda", torch.bfloat16):
        loss = (torch.compile(model) if compiled else model)(idx, targets, loss_kind=loss)[1]
    got_loss, grads = gradients(loss)
    assert got_loss == pytest.approx(expected_loss, rel=1e-2)
    for name, grad in expected.items():
        assert grads[name].norm() > 0, name
        assert (grads[name] - grad).norm() <= 2e-2 * grad.norm() + 1e-6, name


@pytest.mark.slow
def test_the_trainer_trains_on_cuda_compiled_and_under_fsdp_on_one_gpu(tmp_path):
    """The trainer's whole path on a GPU, compiled: one process, then FSDP2 on one rank on the
    same GPU, which must give the same losses within bf16's tolerance."""
    write_token_shards(tmp_path / "data")
    flags = [*TINY, *ON_CUDA, "--compile", "1", "--data_dir", tmp_path / "data", "-B", "4",
             "--total_batch_size", "256", "--max_steps", "4"]
    train_gpt2.main([str(f) for f in flags + ["--log_dir", tmp_path / "one"]])
    result = run_ranks("train_gpt2.py", *flags, "--fsdp", "1", "--log_dir", tmp_path / "fsdp", nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    one, fsdp = (train_records(read_log(tmp_path / name)) for name in ("one", "fsdp"))
    assert len(one) == len(fsdp) == 4
    assert [r["train_loss"] for r in fsdp] == pytest.approx([r["train_loss"] for r in one], rel=1e-2)


def test_left_padded_generation_with_the_kv_cache_in_bf16_matches_the_whole_forward():
    """The logits of each new position through the KV cache, in a left-padded batch, against
    the same positions computed with no cache: bf16 on both sides."""
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda().eval()
    idx = batch(B=3, T=40)[0].cuda()
    n_pad = torch.tensor([0, 5, 17], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        whole = model.head(model.hidden_states(idx, n_pad=n_pad)).float()
        kv_cache = [[] for _ in range(CONFIG.n_layer)]
        cached = [model.head(model.hidden_states(idx[:, :30], kv_cache, n_pad)).float()]
        cached += [model.head(model.hidden_states(idx[:, i:i + 1], kv_cache, n_pad)).float() for i in range(30, 40)]
    cached = torch.cat(cached, dim=1)
    for row, pad in enumerate(n_pad.tolist()):
        real = slice(pad, None)  # the padding positions' own logits do not matter
        torch.testing.assert_close(cached[row, real], whole[row, real], rtol=0, atol=0.1)
        assert (cached[row, 30:].argmax(-1) == whole[row, 30:].argmax(-1)).float().mean() > 0.9


def test_core_eval_runs_on_cuda_and_scores_as_on_the_cpu(tmp_path):
    """core_eval.py on the GPU: float32's row scores (through the KV cache and the packed mask) equal
    the CPU's, bf16's within its tolerance; and the script's JSON in float32 is the CPU's, example by example."""
    import json

    import core_eval
    from gpt2repro.evals import core_bundle
    from hellaswag import ScoringConfig
    from helpers.models import make_tiny_gpt
    from helpers.processes import run_script
    from test_core_eval import save_checkpoint, write_bundle
    bundle = write_bundle(tmp_path / "bundle")
    model = make_tiny_gpt(block_size=32)
    loaded = [core_eval.load_task(task, 32) for task in core_bundle.read_bundle(bundle)]
    on_cpu = [core_eval.score_rows(model, task, ScoringConfig("cpu", 4)) for task in loaded]
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        on_gpu = [core_eval.score_rows(model.cuda(), task, ScoringConfig("cuda:0", 4, dtype)) for task in loaded]
        for cpu_task, gpu_task in zip(on_cpu, on_gpu):
            for i, rows in cpu_task.items():
                means = [mean for mean, _ in rows]
                assert [mean for mean, _ in gpu_task[i]] == pytest.approx(means, rel=tolerance, abs=tolerance, nan_ok=True)
    ckpt = save_checkpoint(model.cpu(), tmp_path / "ckpt.pt")
    results = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.json"
        proc = run_script("core_eval.py", "-m", ckpt, "--data", bundle, "--device", device, "--dtype", "float32",
                          "--json", out)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[device] = json.loads(out.read_text())
    assert results["cuda"]["examples"] == results["cpu"]["examples"]
