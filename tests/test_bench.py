"""bench.py in its tiny configuration: a complete table and JSON, never a speed."""
import gzip
import json
import os
import re
import shlex
import signal
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import bench
from gpt2repro.benchmark import step_profile
from gpt2repro.lm import loss
from helpers.limits import disk_full, file_size_limit
from helpers.processes import exit_message, run_script
from model import ATTENTION_KERNELS, GPT, GPTConfig, n_params

FIGURES = {"matmul": ["flops_per_sec"], "copy": ["bytes_per_sec"], "train": ["tokens_per_sec", "ms_per_step"], "tokenize": ["tokens_per_sec"],
           "loader": ["batches_per_sec", "rss_bytes"], "hellaswag": ["examples_per_sec", "flops_per_sec"],
           "core": ["examples_per_sec"], "generate": ["tokens_per_sec"]}
VARIANTS = {"matmul": {"ceiling"}, "copy": {"ceiling"}, "train": {"project", "baseline"}, "tokenize": {"project", "baseline"},
            "loader": {"project", "baseline"}, "hellaswag": {"batched", "unbatched", "baseline"},
            "core": {"batched", "unbatched", "baseline"}, "generate": {"batched", "unbatched"}}


@pytest.mark.slow
def test_quick_bench_writes_every_part_and_variant(tmp_path):
    out = tmp_path / "bench.json"
    result = run_script("bench.py", "--quick", "--levers", "--json", out)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"device", "torch", "command", "date"} <= report.keys() and "--quick" in report["command"]
    for name, variants in VARIANTS.items():
        rows = [r for r in report["results"] if r["name"] == name]
        assert {r["variant"] for r in rows} == variants, name
        for row in rows:
            assert all(isinstance(row[key], (int, float)) and row[key] >= 0 for key in FIGURES[name]), row
    # On a CPU nothing is compiled and AdamW is not fused: the levers left to switch off.
    levers = [(r["name"], r["lever"]) for r in report["results"] if "lever" in r]
    assert levers == [("train", "-padded_vocab"), ("train", "-flash_attention"), ("train", "+chunked_loss"),
                      ("train", "+recompute_full"), ("train", "+recompute_attn"), ("train", "+recompute_core_attn"),
                      ("generate", "-kv_cache"), ("generate", "-kv_cache")]  # batched and unbatched without it
    table = result.stdout.splitlines()
    assert table[0].startswith(report["device"]) and table[1].split()[:2] == ["part", "variant"]
    assert len(table) == 2 + len(report["results"])
    assert "project -padded_vocab" in result.stdout


def attention_of(model):
    """The --attention flag whose SDPA backends model was built with."""
    kernels = model.transformer.h[0].attn.kernels
    return next(name for name, allowed in ATTENTION_KERNELS.items() if allowed == kernels)


@pytest.mark.slow
@pytest.mark.parametrize("failure, recorded", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB"), {"out_of_memory": True}),
    (RuntimeError("backend compiler failed\n(a long trace)"), {"error": "RuntimeError: backend compiler failed"})])
def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, failure, recorded):
    real_build = bench.build_trainable

    def fail_the_project(model, *args, **kwargs):  # the baseline runs the math attention
        if attention_of(model) != "math":
            raise failure
        return real_build(model, *args, **kwargs)
    monkeypatch.setattr(bench, "build_trainable", fail_the_project)
    results = []
    bench.bench_train(bench.parse_args(["--quick", "-B", "2,3"]), "cpu", str(tmp_path), results.append)
    assert [(r["variant"], r["config"].split()[2]) for r in results] == [
        ("project", "B2"), ("baseline", "B2"), ("project", "B3"), ("baseline", "B3")]
    for r in results:
        if r["variant"] == "project":
            assert recorded.items() <= r.items() and "tokens_per_sec" not in r
        else:
            assert r["tokens_per_sec"] > 0 and not {"out_of_memory", "error"} & r.keys()


@pytest.mark.slow
def test_a_timed_run_that_trains_nothing_is_reported_wrong_without_a_speed(tmp_path, monkeypatch, capsys):
    """The chunked loss's lever with its graph cut (every gradient None): the trainer's step refuses
    it, and the run is a row that says so, with no tokens/s. A lever whose gradient points the wrong
    way (the loss's value kept, its gradient negated: the loss rises) is wrong too."""
    forward = bench.GPT.forward

    def broken(self, idx, targets=None, loss_kind="masked", **kwargs):
        if loss_kind == "chunked":  # the graph cut
            logits, loss = forward(self, idx, targets, loss_kind=loss_kind, **kwargs)
            return logits, loss.detach().requires_grad_()
        logits, loss = forward(self, idx, targets, loss_kind=loss_kind, **kwargs)
        if self.transformer.h[0].recompute == "full":  # the same value, the gradient negated
            loss = 2 * loss.detach() - loss
        return logits, loss
    monkeypatch.setattr(bench.GPT, "forward", broken)
    results = []
    bench.bench_train(bench.parse_args(["--quick", "--baseline", "0", "--steps", "4", "--levers",
                                        "chunked_loss,recompute_full,recompute_attn"]), "cpu", str(tmp_path),
                      results.append)
    project, chunked, other, attn = results
    assert chunked["wrong"].startswith("no parameter received a gradient") and "losses" not in chunked
    assert other["wrong"].startswith("its loss fell -") and len(other["losses"]) == 5
    assert not {"tokens_per_sec", "ms_per_step", "mfu"} & (chunked.keys() | other.keys())
    assert "wrong" not in project and "wrong" not in attn and attn["tokens_per_sec"] > 0
    bench.print_table(results)
    row = capsys.readouterr().out.splitlines()[2]
    assert "+chunked_loss" in row and ": wrong, no parameter received a gradient" in row


REAL_TIME_TRAIN_RUN = bench.time_train_run


def breaking_run(sizes, B, levers, *args):
    """bench.time_train_run, where two levers break in the process that runs them: +recompute_full
    crashes it, +chunked_loss raises a CUDA error inside its run (as max-autotune did on an H100)."""
    if levers["recompute"] == "full":
        os.kill(os.getpid(), signal.SIGSEGV)
    if levers["loss"] == "chunked":
        bench.build_trainable = raise_a_cuda_error  # in this process only: each run has its own (--isolate 1)
    return REAL_TIME_TRAIN_RUN(sizes, B, levers, *args)


def raise_a_cuda_error(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA")


@pytest.mark.slow
def test_a_lever_that_breaks_its_process_is_a_failed_row_and_the_next_lever_runs(tmp_path, monkeypatch, capsys):
    """Under --isolate (the default on CUDA, where an error can spoil the process's CUDA context) each
    run has a process of its own: a crash or an error there is that lever's row, and the next trains."""
    monkeypatch.setattr(bench, "time_train_run", breaking_run)
    results = []
    bench.bench_train(bench.parse_args(["--quick", "--device", "cpu", "--baseline", "0", "--isolate", "1", "--levers",
                                        "chunked_loss,recompute_full,recompute_attn"]), "cpu", str(tmp_path),
                      results.append)
    assert [r.get("lever") for r in results] == [None, "+chunked_loss", "+recompute_full", "+recompute_attn"]
    project, chunked, crashed, attn = results
    assert chunked["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert crashed["error"] == "its process died (signal SIGSEGV)"
    for r in (project, attn):
        assert r["tokens_per_sec"] > 0 and not {"error", "wrong"} & r.keys()
    assert attn["losses"] == project["losses"]  # recomputing changes no number
    assert "warning: breaking_run: its process died (signal SIGSEGV)" in capsys.readouterr().err
    bench.print_table(results)
    rows = capsys.readouterr().out.splitlines()[1:]  # under the header
    assert "+recompute_full" in rows[2] and ": failed, its process died (signal SIGSEGV)" in rows[2]
    assert bench.parse_args(["--quick", "--device", "cpu"]).isolate is False  # auto: on CUDA only


@pytest.mark.parametrize("losses, grad_norms, reference, follow, problem", [
    ([11.0, 10.0, 9.0], [1.0, 1.0, 1.0], None, False, None),
    ([11.0, 11.0, 11.0], [1.0, 1.0, 1.0], None, False,
     "its loss fell 0 over 3 steps (11.0000 to 11.0000), less than 0.0220"),
    # The crafted runs of #58 that a judge of the first and last loss alone passed: a loss that went up and came
    # back, a gradient norm that grew to 1e12 while the loss fell 0.1, a loss that fell 1e-6.
    ([10.9, 35.0, 80.0, 10.8], [1.0, 1.0, 1.0, 1.0], None, False, "its loss rose to 35.0000 at step 1, from 10.9000"),
    ([10.9, 35.0, 80.0, 10.8], [1.0, 1.0, 1.0, 1.0], [10.9, 10.0, 9.5, 9.0], False,
     "its loss rose to 35.0000 at step 1, from 10.9000"),
    ([11.0, 10.95, 10.9], [1.0, 1e6, 1e12], None, False,
     "its gradient norm at step 1 is 1e+06, over 100x the first step's"),
    ([11.0, 10.95, 10.9], [1.0, 2.0, 1e12], None, False,
     "its gradient norm at step 2 is 1e+12, over 100x the first step's"),
    ([11.0, 10.9999995, 10.999999], [1.0, 1.0, 1.0], None, False,
     "its loss fell 1e-06 over 3 steps (11.0000 to 11.0000), less than 0.0220"),
    # What real runs do passes: a spike of the first steps' norm, a loss a little up at first, --quick's fall over 2 steps.
    ([10.95, 11.3, 9.5, 8.7], [2.0, 9.0, 3.0, 150.0], None, False, None),
    ([10.8207, 10.7614], [2.45, 2.08], None, False, None),
    ([11.0, 10.0, 9.0], [1.0, 0.0, 1.0], None, False, "its gradient norm at step 1 is 0.0"),
    ([11.0, float("nan"), 9.0], [1.0, 1.0, 1.0], None, False, "its loss at step 1 is nan"),
    ([11.0, 10.9, 10.8], [1.0, 1.0, 1.0], [11.0, 10.0, 9.0], False, "its loss fell 0.2000 over 3 steps, the project's 2.0000"),
    ([11.0, 10.4, 9.1], [1.0, 1.0, 1.0], [11.0, 10.0, 9.0], True, None),  # bf16's noise: within a quarter of the fall
    ([11.0, 9.0, 8.0], [1.0, 1.0, 1.0], [11.0, 10.0, 9.0], True,
     "its losses strayed 1.0000 from the project's, more than a quarter of its fall (2.0000)"),
    ([11.0, 9.0, 8.0], [1.0, 1.0, 1.0], [11.0, 10.0, 9.0], False, None),  # a peer: another init, the fall alone
    ([11.0, 10.0, 9.0], [1.0, 1.0, 1.0], [11.0, 11.0, 11.0], True, None),  # a reference that did not train: alone
    # The crafted runs of #65 that the judge of #58 passed: a gradient norm that grew 1e6 -> 1e8 (100x, at the bound),
    # a first loss of 1e30 that fell 0.2%, a loss flat at 0, a flat run against a NaN reference (alone, as
    # against any reference that did not train), swings between 10.9 and 1, and a tiny fall against a tiny fall.
    ([11.0, 10.0, 9.0], [1e6, 1e7, 1e8], None, False, "its gradient norm at step 0 is 1e+06, over 10000: a fresh GPT-2's is tens"),
    ([1e30, 9.99e29, 9.98e29], [1.0, 1.0, 1.0], None, False,
     "its first loss is 1e+30, not a fresh model's: ln(50257) = 10.82, give or take 1"),
    ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], None, False, "its loss at step 0 is 0.0"),
    ([10.9, 0.0, 0.0], [1.0, 1.0, 1.0], [10.9, 10.0, 9.0], False, "its loss at step 1 is 0.0"),
    ([11.0, 11.0, 11.0], [1.0, 1.0, 1.0], [11.0, float("nan"), 9.0], False,
     "its loss fell 0 over 3 steps (11.0000 to 11.0000), less than 0.0220"),
    ([11.0, 10.9, 10.8], [1.0, 1.0, 1.0], [float("nan")] * 3, True, None),  # alone, it fell far enough
    ([10.9, 1.0, 10.8, 1.0, 10.0], [1.0, 1.0, 1.0, 1.0, 1.0], None, False, "its loss rose to 10.8000 at step 2, from 1.0000"),
    ([10.9, 1.0, 10.8, 1.0, 10.0], [1.0, 1.0, 1.0, 1.0, 1.0], [10.9, 9.5, 8.9, 8.5, 8.0], False,
     "its loss rose to 10.8000 at step 2, from 1.0000"),
    ([11.0, 10.9999995, 10.999999], [1.0, 1.0, 1.0], [11.0, 10.999999, 10.999998], False,
     "its loss fell 1e-06 over 3 steps (11.0000 to 11.0000), less than 0.0220"),
    # Real runs pass: GPT-2 (124M)'s first steps on an H100 (bench/results/h100-2026-11-25/trainer-124m-final.log),
    # up 0.34 at its fourth; --quick's tiny model's first eleven on a CPU, falling 0.07 a step at most, with noise.
    ([10.939285, 9.544287, 8.887721, 9.230620], [27.0243, 5.6131, 3.3559, 16.0839], None, False, None),
    ([10.8207, 10.7614, 10.6932, 10.726, 10.6206, 10.5643, 10.5307, 10.4989, 10.5054, 10.4344, 10.4352],
     [2.452, 2.08, 2.104, 1.801, 1.634, 1.443, 1.367, 1.269, 1.258, 1.251, 1.189], None, False, None),
    ([10.8331, 10.7644, 10.6732, 10.6819, 10.5909, 10.5326, 10.4913, 10.4499, 10.457, 10.3865, 10.3956],
     [2.176, 2.102, 2.082, 1.893, 1.581, 1.454, 1.377, 1.264, 1.258, 1.248, 1.182],
     [10.8207, 10.7614, 10.6932, 10.726, 10.6206, 10.5643, 10.5307, 10.4989, 10.5054, 10.4344, 10.4352], True, None),
])
def test_whether_a_timed_run_trained(losses, grad_norms, reference, follow, problem):
    assert bench.training_problem(losses, grad_norms, reference, follow) == problem


def test_the_json_keeps_the_results_of_a_run_cut_short(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_loader", interrupted)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--quick", "--parts", "matmul,loader", "--json", str(out)])
    assert [(r["name"], r["variant"]) for r in json.loads(out.read_text())["results"]] == [("matmul", "ceiling"),
                                                                                          ("copy", "ceiling")]


@pytest.mark.slow
def test_a_json_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "atomic_open", disk_full)
    bench.main(["--quick", "--parts", "matmul,loader", "--json", str(tmp_path / "bench.json")])
    out, err = capsys.readouterr()
    parts = [line.split()[0] for line in out.splitlines()[2:]]  # the table's rows: every result
    assert parts[:2] == ["matmul", "copy"] and set(parts[2:]) == {"loader"}
    assert err.count("warning: could not write") == len(parts)  # once after each result


def test_bad_arguments_stop_with_one_line_before_anything_is_timed(tmp_path, capsys):
    missing_device = "mps" if torch.cuda.is_available() else "cuda"
    cases = [(["--n_head", "3", "--n_embd", "64"], "--n_embd 64 is not divisible by --n_head 3"),
             (["--n_head", "3"], "--n_embd 64 is not divisible by --n_head 3"),  # the size's default n_embd
             (["--device", missing_device], f"--device: device {missing_device}"),
             (["--json", str(tmp_path)], "cannot write there (a directory, not a regular file)"),
             (["--json", str(tmp_path / "file" / "x.json")], "cannot write there"),
             (["--parts", "train,foo"], "unknown part(s) foo"),
             (["-B", "64,0"], "-B/--micro_batch_size: '0' is not a positive integer"),
             (["--warmup", "-1"], "--warmup must be 0 or more"),
             (["--levers", "recompute_full,foo"], "unknown lever(s) foo"),
             (["--levers", "max_autotune", "--device", "cpu"], "--levers: max_autotune: not a lever of the project on cpu"),
             (["--total_batch_size", "100"], "--total_batch_size 100 is not a multiple of B*T*world_size = 2*64*1 = 128; "
                                             "try --total_batch_size 128 or another -B"),
             (["-B", "2,3", "--total_batch_size", "256"], "not a multiple of B*T*world_size = 3*64*1 = 192"),
             (["--profile", "--parts", "matmul"], "--profile profiles train's step: --parts must include train")]
    (tmp_path / "file").write_text("")
    for flags, message in cases:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--quick", *flags])
        assert e.value.code == (1 if flags[0] == "--json" else 2), flags  # a path: not a usage error
        error = capsys.readouterr().err.splitlines()[-1]
        assert "error: " in error and message in error, (flags, error)
    assert os.listdir(tmp_path) == ["file"]


def quick_gpt(n_layer=2, n_embd=64, block_size=64):
    """The model --quick trains, as the trainer's size check names it."""
    config = GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=block_size, vocab_size=bench.PADDED_VOCAB)
    return f"a GPT of {n_params(config):,} parameters needs"


@pytest.mark.parametrize("flags, expected", [
    (["--n_embd", 10**6], quick_gpt(n_embd=10**6)), (["--n_layer", 10**12], quick_gpt(n_layer=10**12)),
    (["-T", 10**12], quick_gpt(block_size=10**12)), (["--n_embd", 10**400], "a GPT of these sizes needs more than"),
    (["-B", f"2,{10**12}"],
     f"train's random tokens, (--steps 2 + --warmup 1 + 1) x 2 micro-steps x -B {10**12} x -T 64, do not fit"),
    (["--total_batch_size", 128 * 10**12],
     f"train's random tokens, (--steps 2 + --warmup 1 + 1) x --total_batch_size {128 * 10**12}, do not fit"),
    (["--steps", 10**12],
     f"train's random tokens, (--steps {10**12} + --warmup 1 + 1) x 2 micro-steps x -B 2 x -T 64, do not fit"),
    (["--warmup", 10**12],
     f"train's random tokens, (--steps 2 + --warmup {10**12} + 1) x 2 micro-steps x -B 2 x -T 64, do not fit")],
    ids=["n_embd", "n_layer", "seq_len", "past_a_float", "micro_batch_size", "total_batch_size", "steps", "warmup"])
def test_train_sizes_the_machine_cannot_hold_stop_with_one_line_before_anything_is_allocated(tmp_path, capsys, flags,
                                                                                             expected):
    """The model as the trainer checks it (memory.fit_problem), and the shard of random tokens that
    train writes first; not even --json's directory is made."""
    argv = ["--quick", "--device", "cpu", *flags, "--json", tmp_path / "out" / "x.json"]
    assert exit_message(capsys, bench.parse_args, *argv).startswith(f"bench.py: error: {expected}")
    assert not os.listdir(tmp_path)
    bench.parse_args(["--quick", "--device", "cpu", *map(str, flags), "--parts", "matmul"])  # train's sizes unused


def test_levers_named_are_timed_in_the_tables_order(monkeypatch):
    args = bench.parse_args(["--quick", "--device", "cpu", "--levers", "recompute_full,chunked_loss,padded_vocab"])
    assert bench.train_runs(args, compile_model=False, device_type="cpu") == [
        ("project", None), ("baseline", None), ("project", "-padded_vocab"), ("project", "+chunked_loss"),
        ("project", "+recompute_full")]
    cuda_levers = ["-compile", "-fused_adamw", "-padded_vocab", "-flash_attention", "+masked_loss", "+chunked_loss",
                   "+recompute_full", "+recompute_attn", "+recompute_core_attn", "+cudnn_attention", "+max_autotune",
                   "+cuda_graphs", "+coordinate_descent"]
    for triton in (True, False):  # CUDA's torch brings Triton; without it the project's loss is the masked one
        monkeypatch.setattr(loss, "has_triton", lambda: triton)
        monkeypatch.setattr(bench, "has_triton", lambda: triton)
        on_cuda = bench.train_runs(bench.parse_args(["--quick", "--device", "cpu", "--levers"]), True, "cuda")
        expected = cuda_levers if triton else [lever for lever in cuda_levers if lever != "+masked_loss"]
        assert [lever for _, lever in on_cuda[2:]] == expected  # never +fused_loss: it is the default, or cannot run


def test_coordinate_descent_tuning_is_on_for_its_run_only(tmp_path, monkeypatch):
    """Inductor reads its settings when it compiles, at the first step: the lever's setting holds
    for the whole run, and is as it was once the run is over, whether it succeeded or failed."""
    import torch._inductor.config as inductor

    seen = []

    def step(t, loader, lr, **kwargs):
        seen.append(inductor.coordinate_descent_tuning)
        raise RuntimeError("a lever that breaks")
    monkeypatch.setattr(bench, "train_step_fitting", step)
    cfg = bench.train_sizes(bench.parse_args(["--quick", "--device", "cpu"]), "cpu")
    shard = str(tmp_path / "shard.npy")
    bench.write_shard(shard, np.zeros(4096, dtype=np.uint16))
    for lever in ("+coordinate_descent", None):
        levers = bench.train_levers("project", lever, compile_model=False)
        assert "error" in bench.time_train_run(cfg, 2, levers, False, shard, "cpu", torch.float32)
    assert seen == [True, False] and inductor.coordinate_descent_tuning is False


def test_each_timed_step_waits_for_an_asynchronous_device(monkeypatch):
    """On MPS, as on CUDA, a step returns before the device has run it: the timer must wait."""
    waits = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waits.append("mps"))
    bench.time_steps(lambda: None, n_warmup=2, n_steps=3, device="mps")
    assert waits == ["mps"] * 5


@pytest.mark.parametrize("seconds_of_a_call", [
    lambda threads, k: (1.0, 1.0, 1e-3)[k % 3],  # other processes slow two calls of three
    lambda threads, k: 1.0 if threads > 1 else 1e-3,  # every call on two threads waits for a busy core; one thread's not
])
def test_a_ceiling_is_the_devices_best_call_however_busy_the_cpu(monkeypatch, seconds_of_a_call):
    """The matmul ceiling and the copy's are each the fastest call, on all the threads or on one: not
    the median, which a busy CPU's slowed calls make absurd (0.001 TFLOP/s)."""
    clock, calls = [0.0], []

    def call_ends(device):  # each timed call waits for the device: here, its clock moves on
        clock[0] += seconds_of_a_call(torch.get_num_threads(), len(calls))
        calls.append(device)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench, "synchronize", call_ends)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ceilings = bench.device_ceilings.__wrapped__("cpu", torch.float32, True)
    finally:
        torch.set_num_threads(threads)
    n, copy_bytes = bench.ceiling_sizes("cpu", True)
    assert ceilings == pytest.approx({step_profile.FLOPS: 2 * n**3 / 1e-3, step_profile.BYTES: 2 * copy_bytes / 1e-3})
    assert torch.get_num_threads() == threads


def test_a_load_above_the_cores_is_a_warning_and_in_the_json(tmp_path, monkeypatch, capsys):
    for load, warned in ((13.5, True), (1.9, False), (None, False)):  # None: a system that keeps no load average
        monkeypatch.setattr(bench, "load_average", lambda: load)
        monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
        bench.main(["--quick", "--parts", "matmul", "--json", str(tmp_path / "bench.json")])
        err = capsys.readouterr().err
        assert ("warning: the load average (13.5) is above this machine's 2 cores: other processes share them, and "
                "the rates measured now read low" in err) == warned, err
        assert json.loads((tmp_path / "bench.json").read_text())["load_average"] == load


@pytest.mark.slow
def test_the_baseline_and_the_project_time_the_trainers_own_step(tmp_path, monkeypatch):
    """bench.py has no step of its own: each run is step.train_step on a Trainable that
    step.build_trainable made, with the levers of the variant; the baseline, at a micro-batch
    too large for the device, halves it and accumulates twice as often: the same tokens per step
    (--quick's default: two micro-batches of -B), halved as the trainer halves it (train_step_fitting)."""
    from gpt2repro.training.step import StepOutOfMemory, build_trainable, no_stop, train_step

    built, stepped, flash = [], [], []

    def build(model, *args, **kwargs):
        built.append(((model, *args), dict(kwargs, attention=attention_of(model),
                                           recompute=model.transformer.h[0].recompute)))
        return build_trainable(model, *args, **kwargs)
    monkeypatch.setattr(bench, "build_trainable", build)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):  # what SDPA is allowed to run, seen where it runs
        flash.append((built[-1][1]["attention"], torch.backends.cuda.flash_sdp_enabled()))
        return real_sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    def step(t, loader, lr, stop_requested=no_stop):
        stepped.append((loader.micro_steps(t.step_config.tokens_per_step), loader.B))
        if t.raw_model.config.vocab_size == 50257 and built[-1][1]["attention"] == "math" and loader.B > 2:
            raise StepOutOfMemory  # the baseline does not fit: as the step says on a device too small
        return train_step(t, loader, lr, stop_requested)
    monkeypatch.setattr("gpt2repro.training.step.train_step", step)
    results = []
    bench.bench_train(bench.parse_args(["--quick", "-B", "8", "--levers"]), "cpu", str(tmp_path), results.append)
    batch = [r["config"].split(" float32")[0].split(" ", 2)[2] for r in results]
    assert [(r["variant"], r.get("lever"), b) for r, b in zip(results, batch)] == [
        ("project", None, "B8 T64 accum=2"), ("baseline", None, "B2 (halved from 8) T64 accum=8"),
        *[("project", lever, "B8 T64 accum=2") for lever in ("-padded_vocab", "-flash_attention", "+chunked_loss",
                                                             "+recompute_full", "+recompute_attn",
                                                             "+recompute_core_attn")]]
    assert {r["total_batch_size"] for r in results} == {2 * 8 * 64}
    assert all(r["tokens_per_sec"] > 0 for r in results)
    levers = [(kw["attention"], step.optimizer.fused_adamw, step.compile_mode, model.config.vocab_size,
               step.loss_kind, kw["recompute"]) for (model, _, step), kw in built]
    # --loss auto as the trainer settles it on a CPU: masked.
    project, baseline = ("auto", None, None, 50304, "masked", "none"), ("math", False, None, 50257, "masked", "none")
    assert levers == [project, baseline, ("auto", None, None, 50257, "masked", "none"),
                      ("math", None, None, 50304, "masked", "none"), ("auto", None, None, 50304, "chunked", "none"),
                      *[("auto", None, None, 50304, "masked", mode) for mode in ("full", "attn", "core_attn")]]
    assert {(accum, B) for accum, B in stepped} == {(2, 8), (4, 4), (8, 2)}
    assert set(flash) == {("auto", True), ("math", False)}


@pytest.mark.parametrize("flags, B, accumulation", [([], 2, 2), (["--total_batch_size", "384"], 2, 3),
                                                    (["-B", "1", "--total_batch_size", "256"], 1, 4)])
def test_train_times_the_trainers_step_with_its_gradient_accumulation(tmp_path, flags, B, accumulation):
    """An optimizer step of train is total_batch_size / (B*T) forward-backward passes, counted by a
    hook on every GPT forward and one on every optimizer step: --quick's default is two micro-batches."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    forwards, steps = [], []
    hooks = [torch.nn.modules.module.register_module_forward_hook(
                 lambda module, args, out: forwards.append(args[0].shape) if isinstance(module, bench.GPT) else None),
             register_optimizer_step_post_hook(lambda *args: steps.append(1))]
    results = []
    try:
        bench.bench_train(bench.parse_args(["--quick", "--device", "cpu", "--parts", "train", "--baseline", "0",
                                            "--steps", "1", "--warmup", "1", *flags]), "cpu", str(tmp_path),
                          results.append)
    finally:
        for hook in hooks:
            hook.remove()
    [result] = results
    total = result["total_batch_size"]
    assert total == int(dict(zip(flags[::2], flags[1::2])).get("--total_batch_size", 2 * B * 64))
    assert result["grad_accum_steps"] == total // (B * 64) == accumulation and result["micro_batch_size"] == B
    assert f"B{B} T64 accum={accumulation} " in result["config"]
    assert len(steps) == 2 and forwards == [(B, 64)] * (accumulation * len(steps))  # warm-up and timed step


def test_the_gpu_size_steps_the_trainers_default_total_batch():
    from gpt2repro.training import train_config

    cfg = bench.train_sizes(bench.parse_args(["--device", "cpu", "--parts", "matmul"]), "cuda")
    assert cfg["total_batch_size"] == train_config.build_parser().get_default("total_batch_size")
    assert bench.total_batch(cfg, 64) // (64 * cfg["seq_len"]) == 8  # 524288 / (64*1024)


CATEGORIES = [category for category, _ in step_profile.PROFILE_CATEGORIES]


@pytest.mark.parametrize("name, category", [
    ("aten::addmm", "matmul"), ("aten::mm", "matmul"), ("aten::native_layer_norm", "normalization"),
    ("aten::native_layer_norm_backward", "normalization"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::nll_loss_forward", "loss"), ("aten::_log_softmax", "loss"), ("aten::_foreach_mul_", "optimizer"),
    ("aten::_fused_adamw_", "optimizer"), ("aten::copy_", "copies"), ("aten::_to_copy", "copies"),
    ("aten::gelu", "element-wise"), ("aten::add_", "element-wise"), ("aten::t", "element-wise"),
    # CUDA kernels, as the profiler names them
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matmul"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>",
     "attention"), ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "normalization"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"), ("triton_poi_fused_gelu_0", "element-wise")])
def test_the_profile_categories_come_from_the_names(name, category):
    assert step_profile.profile_category(name) == category


def test_on_the_cpu_an_element_wise_operator_takes_the_category_around_it():
    step = SimpleNamespace(name="Optimizer.step#AdamW.step", cpu_parent=None)
    assert step_profile.operator_category(SimpleNamespace(name="aten::lerp_", cpu_parent=step)) == "optimizer"
    linear = SimpleNamespace(name="aten::linear", cpu_parent=None)
    assert step_profile.operator_category(SimpleNamespace(name="aten::t", cpu_parent=linear)) == "matmul"
    copy = SimpleNamespace(name="aten::copy_", cpu_parent=step)
    assert step_profile.operator_category(copy) == "copies"  # its own name first


def event(name, device_type, self_cpu=0.0, self_device=0.0, parent=None, annotation=False):
    return SimpleNamespace(name=name, device_type=device_type, self_cpu_time_total=self_cpu,
                           self_device_time_total=self_device, cpu_parent=parent, is_user_annotation=annotation)


def test_the_profile_counts_each_moment_once():
    """On CUDA the kernels (not the operators that launched them, whose self device time is theirs
    again, nor an annotation's span on the GPU); on the CPU the aten operators' self time (not the
    autograd engine's wrappers)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    wrapper = event("autograd::engine::evaluate_function: AddmmBackward0", cpu, self_cpu=100)
    events = [wrapper, event("Optimizer.step#AdamW.step", cuda, self_device=300, annotation=True), event("aten::mm", cpu, self_cpu=300, self_device=400, parent=wrapper),
              event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", cuda, self_device=400),
              event("Memcpy HtoD (Pinned -> Device)", cuda, self_device=100)]
    on_cuda = step_profile.profile_table(events, 1e-3, 1, "cuda")["rows"]
    assert {r["category"]: r["share"] for r in on_cuda if r["share"]} == {"matmul": 40, "copies": 10, "idle": 50}
    on_cpu = step_profile.profile_table(events, 1e-3, 1, "cpu")["rows"]
    assert {r["category"]: r["share"] for r in on_cpu if r["share"]} == {"matmul": 30, "idle": 70}
    assert [r["category"] for r in on_cpu] == CATEGORIES + ["idle"]


def test_a_profile_table_keeps_its_columns_apart_when_a_number_outgrows_its_width(capsys):
    """Under load a copy's ratio to its floor reaches millions: wider than its column, it still
    stands apart from the floor before it, so the table splits into its five columns."""
    rows = [dict(category="copies", ms_per_step=123_456.7, share=15.8, floor_ms_per_step=4.2e-05, ratio=12_345_678.9),
            dict(category="idle", ms_per_step=9.0, share=8.0)]
    step_profile.print_profile(dict(config="c", steps=1, wall_ms_per_step=1_234_567.8, rows=rows, floor_ms_per_step=15.9,
                                    ratio=77_777.7, ceilings=dict(matmul_flops_per_sec=1e12, copy_bytes_per_sec=1e9),
                                    idle_means="", trace="t"))
    table = capsys.readouterr().out.splitlines()[5:8]
    assert [line.split() for line in table] == [["copies", "123,456.7", "15.8%", "4.2e-05", "12,345,678.9x"],
                                                ["idle", "9.0", "8.0%"],
                                                ["step", "1,234,567.8", "100.0%", "15.9", "77,777.7x"]]


def test_profile_on_the_cpu_prints_a_table_of_the_step_and_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--device", "cpu", "--parts", "train", "--baseline", "0", "--steps", "1", "--warmup", "1",
                "--profile", "--json", str(out)])
    printed = capsys.readouterr().out
    [timed, profile] = json.loads(out.read_text())["results"]
    assert (timed["name"], profile["name"]) == ("train", "profile") and profile["steps"] == 1
    assert profile["config"] == timed["config"] == "L2 C64 B2 T64 accum=2 float32 compile=0"
    assert [r["category"] for r in profile["rows"]] == CATEGORIES + ["idle"]
    shares = [r["share"] for r in profile["rows"]]
    assert all(0 <= share <= 100 for share in shares)
    assert sum(shares[:-1]) <= 100 + 1e-9 and sum(shares) == pytest.approx(100)
    # Each category's floor: its work (step_work, at the model's shapes) at the ceilings this run measured.
    work = step_profile.step_work(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=bench.PADDED_VOCAB),
                                  2 * 2 * 64, 4)
    ceilings = profile["ceilings"]
    rate = {"FLOPs": ceilings["matmul_flops_per_sec"], "bytes": ceilings["copy_bytes_per_sec"]}
    for row in profile["rows"][:-1]:
        unit, amount = work[row["category"]]
        assert row["floor_ms_per_step"] == pytest.approx(1000 * amount / rate[unit]) and row["floor_ms_per_step"] > 0
        assert row["ratio"] == pytest.approx(row["ms_per_step"] / row["floor_ms_per_step"])
    assert "ratio" not in profile["rows"][-1]  # idle has no floor
    assert profile["floor_ms_per_step"] == pytest.approx(sum(row["floor_ms_per_step"] for row in profile["rows"][:-1]))
    assert profile["ratio"] == pytest.approx(profile["wall_ms_per_step"] / profile["floor_ms_per_step"])
    table = printed[printed.index("profile of train's step"):].splitlines()
    assert table[3].split() == ["category", "ms/step", "share", "floor", "ratio"]
    rows = [line.split() for line in table[4:4 + len(CATEGORIES) + 2]]
    assert [row[0] for row in rows] == CATEGORIES + ["idle", "step"]
    assert all(len(row) == 5 and row[4].endswith("x") for row in rows[:-2] + rows[-1:]) and len(rows[-2]) == 3
    assert float(rows[-1][3]) == pytest.approx(profile["floor_ms_per_step"], rel=1e-2)
    assert table[-1] == f"trace: {tmp_path / 'bench.trace.json.gz'}" == f"trace: {profile['trace']}"
    with gzip.open(tmp_path / "bench.trace.json.gz") as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "bench.trace.json.gz"]


def test_a_steps_least_work_is_counted_from_the_models_shapes():
    """step_work against the work of a tiny GPT counted another way: the matmuls' FLOPs by torch's FLOP
    counter over a real forward and backward, attention's causal pairs one at a time, the bytes from the
    model's own modules and parameters (bf16 activations: 2 bytes; float32 parameters and moments)."""
    from torch.utils.flop_counter import FlopCounterMode

    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=5, vocab_size=16)
    B, T, C, accumulation = 3, 5, 8, 2
    tokens = B * T * accumulation  # an optimizer step of two micro-steps
    model = GPT(config)
    with FlopCounterMode(display=False) as counter:
        _, loss = model(*[torch.randint(0, 16, (B, T))] * 2)
        loss.backward()
    flops = counter.get_flop_counts()["Global"]
    pairs = sum(q + 1 for _ in range(tokens // T) for q in range(T))  # each position with itself and those before it
    modules = list(model.modules())
    norms, gelus = (sum(isinstance(m, kind) for m in modules) for kind in (torch.nn.LayerNorm, torch.nn.GELU))
    hidden = model.transformer.h[0].mlp.c_fc.out_features
    expected = {
        "matmul": ("FLOPs", accumulation * (flops[torch.ops.aten.mm] + flops[torch.ops.aten.addmm])),
        "attention": ("FLOPs", config.n_layer * pairs * 3 * (2 * C + 2 * C)),  # q.k and the sum of v; backward twice
        "normalization": ("bytes", norms * tokens * C * 2 * (2 + 3)),  # x read, y written; dy and x read, dx written
        "loss": ("bytes", tokens * 16 * 2 * 2),  # the logits read, their gradient written
        "optimizer": ("bytes", sum(p.numel() for p in model.parameters()) * 4 * (1 + 4 + 3)),
        "copies": ("bytes", tokens * 2 * torch.tensor(0).element_size()),  # inputs and targets, int64
        "element-wise": ("bytes", tokens * 2 * (gelus * hidden * (2 + 3) + len(model.transformer.h) * 2 * C * (3 + 3)
                                                + C * (3 + 3)))}  # GELU, the residual adds, the embeddings
    assert step_profile.step_work(config, tokens, 2) == expected


def test_each_floor_is_its_work_at_the_devices_ceiling():
    profile = dict(wall_ms_per_step=10.0, rows=[dict(category="matmul", ms_per_step=4.0),
                                                 dict(category="copies", ms_per_step=1.0),
                                                 dict(category="idle", ms_per_step=5.0)])
    work = {"matmul": ("FLOPs", 2e12), "copies": ("bytes", 5e8)}
    result = step_profile.floors(profile, work, {"FLOPs": 1e15, "bytes": 1e12})
    assert [(r["category"], r.get("floor_ms_per_step"), r.get("ratio")) for r in result["rows"]] == [
        ("matmul", 2.0, 2.0), ("copies", 0.5, 2.0), ("idle", None, None)]
    assert (result["floor_ms_per_step"], result["ratio"]) == (2.5, 4.0)
    assert result["ceilings"] == {"matmul_flops_per_sec": 1e15, "copy_bytes_per_sec": 1e12}


def test_the_trace_goes_beside_the_json(tmp_path):
    assert bench.parse_args(["--quick", "--profile"]).trace == "bench.trace.json.gz"
    assert bench.parse_args(["--quick", "--profile", "--json", str(tmp_path / "x.json")]).trace == str(
        tmp_path / "x.trace.json.gz")
    assert bench.parse_args(["--quick"]).trace is None


@pytest.mark.slow
def test_a_trace_that_cannot_be_written_is_said_and_leaves_nothing(tmp_path):
    """torch's export only logs a failed write, leaving X.trace.json.tmp and no trace."""
    result = run_script("bench.py", "--quick", "--device", "cpu", "--parts", "train", "--baseline", "0", "--steps", "1",
                        "--warmup", "1", "--profile", "--json", tmp_path / "x.json",
                        preexec_fn=file_size_limit(200_000))  # the results fit, the trace not
    assert result.returncode == 0, result.stderr
    assert f"warning: could not write the trace {tmp_path / 'x.trace.json.gz'}: " in result.stderr
    assert result.stdout.rstrip().endswith("trace: not written")
    assert os.listdir(tmp_path) == ["x.json"]
    assert json.loads((tmp_path / "x.json").read_text())["results"][-1]["trace"] is None


GPU_SH = os.path.join(os.path.dirname(bench.__file__), "bench", "gpu.sh")
GPU_PARTS = ["probe", "cuda-tests", "default", "profile", "peers", "levers"]  # what each proves, first things first


def gpu_sh_parts():
    """{part: [(log name, seconds asked for, its arguments)]} of bench/gpu.sh, in the job's order, and its
    BUDGET and KILL_AFTER, read from the script: each part is a branch of the function part() whose every
    command is `run LOG SECONDS ...`."""
    with open(GPU_SH) as f:
        script = f.read().replace("\\\n", " ")
    budget, kill_after = (int(re.search(rf"^{name}=(\d+)", script, re.MULTILINE).group(1)) for name in ("BUDGET", "KILL_AFTER"))
    [body] = re.findall(r"^part\(\) \{[^\n]*\n(.*?)^\}", script, re.MULTILINE | re.DOTALL)
    parts, current = {}, None
    for line in body.splitlines():
        line = line.strip().removesuffix(";;").strip()
        if label := re.fullmatch(r"([\w-]+)\)", line):
            current = parts.setdefault(label.group(1), [])
        elif line.startswith("run "):
            words = shlex.split(line)
            current.append((words[1], int(words[2]), words[3:]))
        else:
            assert line in ("PART=$1", "case $1 in", "esac"), line  # nothing outside a timeout
    assert re.search(r"^PARTS=\((.*)\)$", script, re.MULTILINE).group(1).split() == list(parts)
    return parts, budget, kill_after


def test_gpu_sh_is_one_job_of_at_most_8_minutes_and_8_files():
    """The device tool's limits: at most 480 s of timeouts, kills included, and 8 files back. The
    first four parts (the probe, the cuda tests, the default step, its profile) get their whole time
    within the budget, and each later part its own in a call of its own; a peer's own timeout fits
    inside its command's; the files are each log, each file named in OUT, and the trace beside a
    profile's JSON."""
    parts, budget, kill_after = gpu_sh_parts()
    assert budget <= 480
    asked = {part: sum(seconds + kill_after for _, seconds, _ in jobs) for part, jobs in parts.items()}
    assert sum(asked[part] for part in GPU_PARTS[:4]) <= budget and max(asked.values()) <= budget
    jobs = [job for part in parts.values() for job in part]
    files = {f"{name}.log" for name, _, _ in jobs}
    for _, _, args in jobs:
        files.update(arg.split("$OUT/", 1)[1] for arg in args if arg.startswith("$OUT/"))
        if "--profile" in args:
            files.add(os.path.basename(bench.trace_path(args[args.index("--json") + 1])))
    assert len(files) <= 8, files
    [(_, seconds, args)] = parts["peers"]
    assert int(args[args.index("--peer_timeout") + 1]) < seconds


def test_gpu_sh_never_runs_past_its_budget_and_names_what_it_cut(tmp_path):
    """run() cuts a command's timeout to what is left of BUDGET, less the kill's grace, and skips a
    command cut below 30 s: the job ends within BUDGET whatever each command takes. A part with a
    command skipped, or stopped by its timeout, is cut."""
    with open(GPU_SH) as f:
        run = re.search(r"^run\(\) \{.*?^\}", f.read(), re.MULTILINE | re.DOTALL).group(0)
    script = (f"OUT={tmp_path}; BUDGET=100; KILL_AFTER=5; CUT=()\n{run}\n"
              "SECONDS=0; PART=a; run a 20 true; SECONDS=50; PART=b; run b 90 true; SECONDS=70; PART=c; run c 90 true\n"
              "SECONDS=0; PART=d; run d 1 sleep 10; PART=e; run e 20 true; echo \"${CUT[*]}\"\n")
    done = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True)
    assert "at most 20 s" in (tmp_path / "a.log").read_text()
    assert "at most 45 s" in (tmp_path / "b.log").read_text()  # 100 - 50 - 5
    assert (tmp_path / "c.log").read_text().startswith("== skipped, 25 s of the budget left")
    assert (tmp_path / "d.log").read_text().splitlines()[-1].startswith("exit 124 at")  # timeout's own code
    assert done.stdout.splitlines()[-1] == "c d"


def run_gpu_sh(tmp_path, *parts):
    """bench/gpu.sh run with python3 a stand-in that logs its arguments, says the GPU is an H200, and
    ends as a timeout would for the profile: (the completed process, the commands it ran)."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then echo h200; exit 0; fi\necho "$*" >> {tmp_path}/calls\n'
                    'case "$*" in *--profile*) exit 124 ;; esac\n')
    fake.chmod(0o755)
    (tmp_path / "calls").write_text("")
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), PEERS="P")
    done = subprocess.run(["bash", GPU_SH, *parts], env=env, capture_output=True, text=True, timeout=120)
    return done, (tmp_path / "calls").read_text().splitlines()


def test_gpu_sh_runs_its_parts_in_the_order_of_what_each_proves_or_those_named(tmp_path):
    """The probe, the cuda tests (verbose: a timeout's kill must leave each test's name), the default
    step against the masked loss at -B 64 and 128, its profile, the peers, the other levers; or only the
    parts named, in that order, so that a second call runs what the first one's budget cut. A part
    that is not one is one line, before anything runs."""
    parts, _, _ = gpu_sh_parts()
    assert list(parts) == GPU_PARTS
    out, steps = str(tmp_path / "out"), "--steps 6 --warmup 2"

    def command(args):
        return " ".join(arg.replace("$OUT", out).replace("$PEERS", "P").replace("$STEPS", steps) for arg in args)[
            len("python3 "):]
    expected = {part: [command(args) for _, _, args in jobs] for part, jobs in parts.items()}
    done, calls = run_gpu_sh(tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls == [call for part in GPU_PARTS for call in expected[part]]
    assert expected["probe"] == ["-m gpt2repro.benchmark.peers", "bench.py --parts matmul"]
    assert expected["cuda-tests"][0].endswith("-m cuda -p no:cacheprovider -o addopts= -v -rA --durations=0")
    assert " -B 64,128 " in expected["default"][0] and expected["default"][0].split("--levers ")[1].startswith(
        "masked_loss ")
    assert "--profile" in expected["profile"][0] and "--parts peers" in expected["peers"][0]
    assert expected["levers"][0].split("--levers ")[1].startswith("max_autotune,coordinate_descent,cuda_graphs ")
    assert done.stdout.splitlines()[-1] == ("== cut by the budget: profile; run what is left in a second call: "
                                            "PEERS=P bash bench/gpu.sh profile")
    assert sorted(os.listdir(out)) == ["bench.log", "cuda-tests.log", "probe.log"]

    done, calls = run_gpu_sh(tmp_path, "peers", "profile")
    assert done.returncode == 0 and calls == expected["profile"] + expected["peers"]
    done, calls = run_gpu_sh(tmp_path / "typo", "peers", "proflie")
    assert (done.returncode, done.stderr) == (2, "bench/gpu.sh: no part named 'proflie': the parts are "
                                                 f"{' '.join(GPU_PARTS)}\n")
    assert calls == [] and not os.path.exists(tmp_path / "typo" / "out")
