"""bench.py in its tiny configuration: a complete table and JSON, never a speed."""
import json
import os

import pytest
import torch

import bench
import memory
from conftest import disk_full, exit_message, run_script
from model import GPTConfig

FIGURES = {"matmul": ["flops_per_sec"], "train": ["tokens_per_sec", "ms_per_step"], "tokenize": ["tokens_per_sec"],
           "loader": ["batches_per_sec", "rss_bytes"], "hellaswag": ["examples_per_sec", "flops_per_sec"],
           "generate": ["tokens_per_sec"]}
VARIANTS = {"matmul": {"ceiling"}, "train": {"project", "baseline"}, "tokenize": {"project", "baseline"},
            "loader": {"project", "baseline"}, "hellaswag": {"batched", "unbatched", "baseline"},
            "generate": {"batched", "unbatched"}}


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


@pytest.mark.parametrize("failure, recorded", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB"), {"out_of_memory": True}),
    (RuntimeError("backend compiler failed\n(a long trace)"), {"error": "RuntimeError: backend compiler failed"})])
def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, failure, recorded):
    real_build = bench.build_trainable

    def fail_the_project(*args, attention, **kwargs):  # the baseline runs the math attention
        if attention != "math":
            raise failure
        return real_build(*args, attention=attention, **kwargs)
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


def test_the_json_keeps_the_results_of_a_run_cut_short(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_loader", interrupted)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--quick", "--parts", "matmul,loader", "--json", str(out)])
    assert [(r["name"], r["variant"]) for r in json.loads(out.read_text())["results"]] == [("matmul", "ceiling")]


def test_a_json_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "atomic_open", disk_full)
    bench.main(["--quick", "--parts", "matmul,loader", "--json", str(tmp_path / "bench.json")])
    out, err = capsys.readouterr()
    parts = [line.split()[0] for line in out.splitlines()[2:]]  # the table's rows: every result
    assert parts[0] == "matmul" and set(parts[1:]) == {"loader"}
    assert err.count("warning: could not write") == len(parts)  # once after each result


def test_bad_arguments_stop_with_one_line_before_anything_is_timed(tmp_path, capsys):
    missing_device = "mps" if torch.cuda.is_available() else "cuda"
    cases = [(["--n_head", "3", "--n_embd", "64"], "--n_embd 64 is not divisible by --n_head 3"),
             (["--n_head", "3"], "--n_embd 64 is not divisible by --n_head 3"),  # the size's default n_embd
             (["--device", missing_device], f"--device: device {missing_device}"),
             (["--json", str(tmp_path)], "cannot write there (a directory, not a file name)"),
             (["--json", str(tmp_path / "file" / "x.json")], "cannot write there"),
             (["--parts", "train,foo"], "unknown part(s) foo"),
             (["-B", "64,0"], "-B/--micro_batch_size: '0' is not a positive integer"),
             (["--warmup", "-1"], "--warmup must be 0 or more"),
             (["--levers", "recompute_full,foo"], "unknown lever(s) foo"),
             (["--levers", "max_autotune", "--device", "cpu"], "--levers: max_autotune: not a lever of the project on cpu")]
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
    return f"a GPT of {memory.n_params(config):,} parameters needs"


@pytest.mark.parametrize("flags, expected", [
    (["--n_embd", 10**6], quick_gpt(n_embd=10**6)), (["--n_layer", 10**12], quick_gpt(n_layer=10**12)),
    (["-T", 10**12], quick_gpt(block_size=10**12)), (["--n_embd", 10**400], "a GPT of these sizes needs more than"),
    (["-B", f"2,{10**12}"], f"train's random tokens, (--steps 2 + --warmup 1 + 1) x -B {10**12} x -T 64, do not fit"),
    (["--steps", 10**12], f"train's random tokens, (--steps {10**12} + --warmup 1 + 1) x -B 2 x -T 64, do not fit"),
    (["--warmup", 10**12], f"train's random tokens, (--steps 2 + --warmup {10**12} + 1) x -B 2 x -T 64, do not fit")],
    ids=["n_embd", "n_layer", "seq_len", "past_a_float", "micro_batch_size", "steps", "warmup"])
def test_train_sizes_the_machine_cannot_hold_stop_with_one_line_before_anything_is_allocated(tmp_path, capsys, flags,
                                                                                             expected):
    """The model as the trainer checks it (memory.fit_problem), and the shard of random tokens that
    train writes first; not even --json's directory is made."""
    argv = ["--quick", "--device", "cpu", *flags, "--json", tmp_path / "out" / "x.json"]
    assert exit_message(capsys, bench.parse_args, *argv).startswith(f"bench.py: error: {expected}")
    assert not os.listdir(tmp_path)
    bench.parse_args(["--quick", "--device", "cpu", *map(str, flags), "--parts", "matmul"])  # train's sizes unused


def test_levers_named_are_timed_in_the_tables_order():
    args = bench.parse_args(["--quick", "--device", "cpu", "--levers", "recompute_full,chunked_loss,padded_vocab"])
    assert bench.train_runs(args, compile_model=False, device_type="cpu") == [
        ("project", None), ("baseline", None), ("project", "-padded_vocab"), ("project", "+chunked_loss"),
        ("project", "+recompute_full")]
    on_cuda = bench.train_runs(bench.parse_args(["--quick", "--device", "cpu", "--levers"]), True, "cuda")
    assert [lever for _, lever in on_cuda[2:]] == ["-compile", "-fused_adamw", "-padded_vocab", "-flash_attention",
                                                   "+chunked_loss", "+recompute_full", "+recompute_attn",
                                                   "+recompute_core_attn", "+cudnn_attention", "+max_autotune"]


def test_each_timed_step_waits_for_an_asynchronous_device(monkeypatch):
    """On MPS, as on CUDA, a step returns before the device has run it: the timer must wait."""
    waits = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waits.append("mps"))
    bench.time_steps(lambda: None, n_warmup=2, n_steps=3, device="mps")
    assert waits == ["mps"] * 5


def test_the_baseline_and_the_project_time_the_trainers_own_step(tmp_path, monkeypatch):
    """bench.py has no step of its own: each run is train_gpt2.train_step on a Trainable that
    train_gpt2.build_trainable made, with the levers of the variant; the baseline, at a micro-batch
    too large for the device, halves it and accumulates twice as often: the same tokens per step."""
    import train_gpt2

    built, stepped, flash = [], [], []

    def build(model, *args, **kwargs):
        built.append(((model, *args), kwargs))
        return train_gpt2.build_trainable(model, *args, **kwargs)
    monkeypatch.setattr(bench, "build_trainable", build)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):  # what SDPA is allowed to run, seen where it runs
        flash.append((built[-1][1]["attention"], torch.backends.cuda.flash_sdp_enabled()))
        return real_sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    def step(t, loader, lr):
        stepped.append((t.grad_accum_steps, loader.B))
        if t.raw_model.config.vocab_size == 50257 and built[-1][1]["attention"] == "math" and loader.B > 2:  # the baseline does not fit
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return train_gpt2.train_step(t, loader, lr)
    monkeypatch.setattr(bench, "train_step", step)
    results = []
    bench.bench_train(bench.parse_args(["--quick", "-B", "8", "--levers"]), "cpu", str(tmp_path), results.append)
    assert [(r["variant"], r.get("lever"), r["config"].split()[2:4]) for r in results] == [
        ("project", None, ["B8", "T64"]), ("baseline", None, ["B8", "(2x4)"]),
        ("project", "-padded_vocab", ["B8", "T64"]), ("project", "-flash_attention", ["B8", "T64"]),
        ("project", "+chunked_loss", ["B8", "T64"]), *[("project", f"+recompute_{mode}", ["B8", "T64"])
                                                       for mode in ("full", "attn", "core_attn")]]
    assert all(r["tokens_per_sec"] > 0 for r in results)
    levers = [(kw["attention"], kw["fused_adamw"], kw["compile_mode"], a[0].config.vocab_size, kw["chunked_loss"],
               kw["recompute"]) for a, kw in built]
    project, baseline = ("auto", None, None, 50304, False, "none"), ("math", False, None, 50257, False, "none")
    assert levers == [project, baseline, baseline, baseline, ("auto", None, None, 50257, False, "none"),
                      ("math", None, None, 50304, False, "none"), ("auto", None, None, 50304, True, "none"),
                      *[("auto", None, None, 50304, False, mode) for mode in ("full", "attn", "core_attn")]]
    assert {(accum, B) for accum, B in stepped} == {(1, 8), (2, 4), (4, 2)}
    assert set(flash) == {("auto", True), ("math", False)}
