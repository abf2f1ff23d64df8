"""plot_log.py: a PNG and a summary from train_gpt2.py's log.jsonl, and clear errors."""
import json
import os
import struct

import pytest

from helpers.processes import run_script

pytest.importorskip("matplotlib")
import plot_log  # noqa: E402  (after the skip: it needs matplotlib)

TOKENS_PER_STEP = 524288


def write_log(path, steps, best_val, best_hellaswag, tokens_per_step=TOKENS_PER_STEP):
    """A synthetic log.jsonl: a falling train loss every step, val loss and HellaSwag every
    10 steps, with the best values at known steps."""
    path.mkdir()
    lines = []
    for step in range(steps + 1):
        common = dict(step=step, tokens=step * tokens_per_step)
        lines.append(dict(common, train_loss=10.9 - 7 * step / steps, lr=6e-4, grad_norm=1.0, dt_ms=100.0,
                          tokens_per_sec=5e6))
        if step % 10 == 0:
            lines.append(dict(common, val_loss=best_val + (steps - step) / steps))
            lines.append(dict(common, hellaswag_acc_norm=best_hellaswag - (steps - step) / 1000,
                              hellaswag_acc=0.25, hellaswag_n=10042))
    lines.append(dict(step=steps, tokens=steps * tokens_per_step, samples=["Hello, I'm a language model, and"]))
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])  # the IHDR chunk's width and height


def test_plot_and_summary_of_two_runs(tmp_path):
    write_log(tmp_path / "run_a", 100, best_val=3.1, best_hellaswag=0.31)
    write_log(tmp_path / "run_b", 50, best_val=3.4, best_hellaswag=0.28)
    # run_a crashed mid-write (line 125); the resumed run logged step 100 again, with a lower
    # val loss (line 126), and crashed mid-write too (line 127).
    with open(tmp_path / "run_a" / "log.jsonl", "a") as f:
        f.write('{"step": 100, "tokens": 52428800, "val_lo\n')
        f.write(json.dumps(dict(step=100, tokens=100 * TOKENS_PER_STEP, val_loss=3.05)) + "\n")
        f.write('{"step": 101, "tokens": 529')
    result = run_script("plot_log.py", "run_a", "run_b/", "-o", "runs.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "run_a: 100 steps, 52.43M tokens; best val loss 3.0500 (step 100); best HellaSwag acc_norm 0.3100 (step 100)",
        "run_b: 50 steps, 26.21M tokens; best val loss 3.4000 (step 50); best HellaSwag acc_norm 0.2800 (step 50)",
        "wrote runs.png",
    ]
    assert "run_a/log.jsonl:125: skipping a damaged line" in result.stderr
    assert "run_a/log.jsonl:127: skipping a truncated last line" in result.stderr
    assert png_size(tmp_path / "runs.png") == (2100, 500)
    # Without -o, beside the first run, not in the directory it was started from.
    result = run_script("plot_log.py", "run_b", "run_a", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == f"wrote {os.path.join('run_b', 'plot.png')}"
    assert png_size(tmp_path / "run_b" / "plot.png") == (2100, 500) and not (tmp_path / "plot.png").exists()


def test_the_axes_hold_every_point_plotted_the_first_steps_too(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()  # a loss that falls as a real run's does: from 10.9 to about 4 in a few steps
    records = [dict(step=s, tokens=s * TOKENS_PER_STEP, train_loss=3.9 + 7 * 0.5 ** s) for s in range(101)]
    records += [dict(step=s, tokens=s * TOKENS_PER_STEP, val_loss=4.0 + 7 * 0.5 ** s) for s in range(0, 101, 10)]
    (tmp_path / "run" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(plot_log.plt, "close", figures.append)
    plot_log.plot([plot_log.load_run(str(tmp_path / "run"))], str(tmp_path / "run.png"), "png", "step")
    lines = [line for ax in figures[0].axes for line in ax.get_lines() if len(line.get_ydata())]
    assert max(max(line.get_ydata()) for line in lines) == 11.0  # step 0 is plotted
    for line in lines:
        low, high = line.axes.get_ylim()
        assert low <= min(line.get_ydata()) and max(line.get_ydata()) <= high, line.get_label()


def test_a_resumed_run_keeps_the_later_entry_of_a_step():
    records = [dict(step=s, tokens=s, val_loss=v) for s, v in ((0, 9.0), (10, 5.0), (20, 4.0), (10, 4.5), (20, 3.9))]
    assert plot_log.series(records, "val_loss") == ([0, 10, 20], [0, 10, 20], [9.0, 4.5, 3.9])


def test_missing_or_empty_logs_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "log.jsonl").write_text("")
    (tmp_path / "no_log").mkdir()
    for path, message in ((tmp_path / "empty", "no records (an empty log)"),
                          (tmp_path / "no_log", "no log.jsonl in it"),
                          (tmp_path / "nowhere", "no such file or directory")):
        with pytest.raises(SystemExit) as e:
            plot_log.main([str(path), "-o", str(tmp_path / "x.png")])
        assert e.value.code.startswith("error: ") and e.value.code.endswith(message)
    assert not (tmp_path / "x.png").exists()
    result = run_script("plot_log.py", "nowhere", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == "error: nowhere: no such file or directory\n"


def exit_message(argv):
    """The message plot_log.main exits with (Python prints it and exits with status 1)."""
    with pytest.raises(SystemExit) as e:
        plot_log.main(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    return e.value.code


def test_bad_output_paths_are_one_line_errors_and_write_nothing(tmp_path):
    write_log(tmp_path / "run", 20, best_val=3.1, best_hellaswag=0.31)
    for out, message in ((tmp_path / "no_dir" / "x.png", "No such file or directory"),
                         (tmp_path / "x.xyz", "the extension must name an image format (png, pdf, svg, ...)"),
                         (tmp_path / "x", "the extension must name an image format (png, pdf, svg, ...)")):
        assert exit_message([str(tmp_path / "run"), "-o", str(out)]) == f"error: -o {out}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # matplotlib would have written x.png


def test_a_log_that_is_not_utf8_is_a_one_line_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_bytes(b'{"step": 0, "tokens": 0, "val_loss": 10.0}\n\xff\xfe\x00\x01\n')
    message = exit_message([str(tmp_path / "run"), "-o", str(tmp_path / "x.png")])
    assert message.startswith(f"error: {tmp_path / 'run' / 'log.jsonl'}: 'utf-8' codec can't decode byte 0xff")


def test_a_record_whose_value_is_not_a_number_is_skipped(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text(
        '{"step": 0, "tokens": 0, "val_loss": 10.0}\n'
        '{"step": 10, "tokens": 100, "val_loss": null}\n'
        '{"step": 20, "tokens": 200, "val_loss": NaN}\n'
        '{"step": "30", "tokens": 300, "train_loss": 3.0}\n'
        '{"step": 40, "tokens": 400, "val_loss": 4.0}\n'
        '{"step": 50, "tokens": 500, "val_loss": "%s"}\n'
        '%s\n'
        '{"step": 60, "tokens": 600, "val_loss": 6.0}\n' % ("x" * 10**6, "[" * 100_000 + "]" * 100_000))
    plot_log.main([str(tmp_path / "run"), "-o", str(tmp_path / "x.png")])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].endswith("run: 60 steps, 600 tokens; best val loss 4.0000 (step 40); no HellaSwag acc_norm")
    log = tmp_path / "run" / "log.jsonl"
    assert err.splitlines() == [
        f"warning: {log}:2: skipping a record whose val_loss is null, not a finite number",
        f"warning: {log}:3: skipping a record whose val_loss is NaN, not a finite number",
        f'warning: {log}:4: skipping a record whose step is "30", not a finite number',
        f"warning: {log}:6: skipping a record whose val_loss is {'x' * 40!r}... (1,000,000 characters), not a finite "
        f"number",  # cut to a bounded length (inputs.brief)
        f"warning: {log}:7: skipping a damaged line",  # JSON nested past Python's recursion limit
    ]


def test_the_tokens_per_step_note_only_for_runs_that_differ(tmp_path, capsys):
    write_log(tmp_path / "run", 20, best_val=3.1, best_hellaswag=0.31)
    write_log(tmp_path / "half_batch", 20, best_val=3.2, best_hellaswag=0.30, tokens_per_step=TOKENS_PER_STEP // 2)
    # An evaluation-only run (--max_steps 0) logs at step 0 only: it fits any tokens per step.
    (tmp_path / "eval_only").mkdir()
    (tmp_path / "eval_only" / "log.jsonl").write_text(
        '{"step": 0, "tokens": 0, "val_loss": 3.2924}\n'
        '{"step": 0, "tokens": 0, "hellaswag_acc_norm": 0.2955, "hellaswag_acc": 0.2892, "hellaswag_n": 10042}\n')
    note = "note: the runs differ in tokens per step, so there is no tokens axis (try --x tokens)\n"
    for runs, expected in ((["eval_only"], ""), (["eval_only", "run"], ""), (["run", "half_batch"], note)):
        plot_log.main([str(tmp_path / run) for run in runs] + ["-o", str(tmp_path / "x.png")])
        assert capsys.readouterr().err == expected, runs


def test_logs_kept_under_names_of_their_own_are_named_by_file(tmp_path):
    """bench/results/ keeps several runs' logs in one directory, as NAME.jsonl: each is labelled
    by its own name; a run's log.jsonl, by its directory."""
    (tmp_path / "results").mkdir()
    for name in ("adamw", "muon"):
        write_log(tmp_path / name, 20, best_val=3.1, best_hellaswag=0.31)
        (tmp_path / name / "log.jsonl").rename(tmp_path / "results" / f"{name}.jsonl")
    write_log(tmp_path / "run", 20, best_val=3.1, best_hellaswag=0.31)
    paths = [tmp_path / "results" / "adamw.jsonl", tmp_path / "results" / "muon.jsonl", tmp_path / "run" / "log.jsonl"]
    assert [plot_log.load_run(str(p))["label"] for p in paths] == [
        str(tmp_path / "results" / "adamw"), str(tmp_path / "results" / "muon"), str(tmp_path / "run")]


def test_core_is_drawn_beside_gpt2s_four_sizes_and_summed_up(tmp_path, monkeypatch, capsys):
    write_log(tmp_path / "run", 40, best_val=3.1, best_hellaswag=0.31)
    with open(tmp_path / "run" / "log.jsonl", "a") as f:
        for step, core in ((20, 0.08), (40, 0.12)):
            f.write(json.dumps(dict(step=step, tokens=step * TOKENS_PER_STEP, core=core, core_n=11000,
                                    core_accuracy={"arc_easy": 0.4})) + "\n")
    figures = []
    monkeypatch.setattr(plot_log.plt, "close", figures.append)
    plot_log.main([str(tmp_path / "run")])
    core_axes = figures[0].axes[2]
    lines = {line.get_label(): list(line.get_ydata()) for line in core_axes.get_lines()}
    assert lines[str(tmp_path / "run")] == [0.08, 0.12]
    assert {label: ys[0] for label, ys in lines.items() if label.startswith("OpenAI")} == {
        "OpenAI gpt2 0.1139": 0.1139, "OpenAI gpt2-medium 0.1849": 0.1849, "OpenAI gpt2-large 0.2146": 0.2146,
        "OpenAI gpt2-xl 0.2565": 0.2565}
    assert capsys.readouterr().out.splitlines()[0].endswith("; best CORE 0.1200 (step 40)")
