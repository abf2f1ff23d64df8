"""Plots training runs from their log.jsonl: train and val loss, and HellaSwag acc_norm, against
OpenAI's GPT-2 (124M) and GPT-3 Small, and CORE against GPT-2's four sizes, and prints a summary
of each run.

    python plot_log.py log/                       # writes log/plot.png
    python plot_log.py log_a/ log_b/ -o runs.png  # several runs on one figure
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import json
import math
import os
import sys

try:
    import matplotlib
except ImportError:
    sys.exit("error: plot_log.py needs matplotlib: pip install matplotlib")
matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.ticker import FuncFormatter

from gpt2repro.common.atomic import atomic_open
from gpt2repro.common.cli import Parser
from gpt2repro.common.inputs import brief, first_line, parse_json
from gpt2repro.evals.core_bundle import GPT2_CORE

# OpenAI's checkpoints, for reference: GPT-2 (124M)'s loss on the FineWeb-Edu val split,
# and HellaSwag acc_norm of GPT-2 (124M) and of GPT-3 Small (125M, the GPT-3 paper).
GPT2_VAL_LOSS = 3.2924
GPT2_HELLASWAG = 0.2955
GPT3_HELLASWAG = 0.337
FIGSIZE, DPI = (21, 5), 100  # 2100 x 500 pixels
SERIES = dict(train="train_loss", val="val_loss", hellaswag="hellaswag_acc_norm", core="core")  # their log fields


def read_log(path):
    """The records of a log.jsonl. A line that does not parse is skipped with a warning: the
    last line of a run that crashed mid-write, or, when a resumed run appended to such a
    file, the line where the two runs' writes ran together. So is a record whose step, tokens or
    plotted value is not a finite number (null, a string, NaN): there is nothing to draw."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:  # unreadable, or not a text file at all
        sys.exit(f"error: {path}: {e}")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except ValueError:  # not JSON, or nested too deep
            record = None
        if not isinstance(record, dict) or "step" not in record or "tokens" not in record:
            what = "truncated last line (a crash mid-write?)" if n == len(lines) else "damaged line"
            print(f"warning: {path}:{n}: skipping a {what}", file=sys.stderr)
            continue
        bad = next((k for k in ("step", "tokens", *SERIES.values()) if k in record and not is_number(record[k])), None)
        if bad:
            print(f"warning: {path}:{n}: skipping a record whose {bad} is {as_json(record[bad])}, not a finite number",
                  file=sys.stderr)
            continue
        records.append(record)
    return records


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records, key):
    """(steps, tokens, values) of key, one value per step, in step order. A run resumed from
    an earlier checkpoint logs some steps twice; the later entry is the one that continued."""
    by_step = {r["step"]: (r["tokens"], r[key]) for r in records if key in r}
    steps = sorted(by_step)
    return steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps]


def as_json(value):
    """A value of log.jsonl as JSON writes it (null, NaN, "30") where brief shows it whole; else brief's text."""
    return json.dumps(value) if brief(value) == repr(value) else brief(value)


def load_run(path):
    """A run's series and totals from its log directory (or its log.jsonl itself)."""
    if os.path.isdir(path):
        log_file, label = os.path.join(path, "log.jsonl"), os.path.normpath(path)
    elif os.path.basename(path) == "log.jsonl":  # a run's log: named by its directory
        log_file, label = path, os.path.normpath(os.path.dirname(path) or path)
    else:  # a log kept under a name of its own, several to a directory (bench/results/)
        log_file, label = path, os.path.splitext(os.path.normpath(path))[0]
    if not os.path.isfile(log_file):
        sys.exit(f"error: {path}: no {'log.jsonl in it' if os.path.isdir(path) else 'such file or directory'}")
    records = read_log(log_file)
    if not records:
        sys.exit(f"error: {log_file}: no records (an empty log)")
    return dict(
        label=label,
        **{name: series(records, key) for name, key in SERIES.items()},
        steps=max(r["step"] for r in records),
        tokens=max(r["tokens"] for r in records),
        # The values the records imply: one, fixed by the batch size, or none in a run logged at
        # step 0 only (an evaluation), which fits a tokens axis of any scale.
        tokens_per_step={r["tokens"] / r["step"] for r in records if r["step"] > 0},
    )


def human(n, spec=".2f"):
    """A count in K, M or B: 10.00B tokens."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:{spec}}{unit}"
    return f"{n:.0f}"


def summary(run):
    parts = [f"{run['label']}: {run['steps']} steps, {human(run['tokens'])} tokens"]
    for name, (steps, _, values), best in (("val loss", run["val"], min),
                                           ("HellaSwag acc_norm", run["hellaswag"], max),
                                           ("CORE", run["core"], max)):
        if values:
            value, step = best(zip(values, steps), key=lambda vs: vs[0])
            parts.append(f"best {name} {value:.4f} (step {step})")
        elif name != "CORE":  # a run that never scored CORE (no bundle) says nothing of it
            parts.append(f"no {name}")
    return "; ".join(parts)


def plot(runs, out, image_format, x):
    fig, (ax_loss, ax_hs, ax_core) = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    i = 0 if x == "step" else 1  # series are (steps, tokens, values)
    for n, run in enumerate(runs):
        color, name = colors[n % len(colors)], f"{run['label']} " if len(runs) > 1 else ""
        ax_loss.plot(run["train"][i], run["train"][2], color=color, alpha=0.4, lw=0.8, label=f"{name}train")
        ax_loss.plot(run["val"][i], run["val"][2], color=color, lw=2, label=f"{name}val")
        ax_hs.plot(run["hellaswag"][i], run["hellaswag"][2], color=color, lw=2, marker=".", label=run["label"])
        ax_core.plot(run["core"][i], run["core"][2], color=color, lw=2, marker=".", label=run["label"])
    ax_loss.axhline(GPT2_VAL_LOSS, color="k", ls="--", lw=1, label=f"OpenAI GPT-2 (124M) val loss {GPT2_VAL_LOSS}")
    ax_hs.axhline(GPT2_HELLASWAG, color="k", ls="--", lw=1, label=f"OpenAI GPT-2 (124M) {GPT2_HELLASWAG}")
    ax_hs.axhline(GPT3_HELLASWAG, color="k", ls=":", lw=1, label=f"OpenAI GPT-3 Small {GPT3_HELLASWAG}")
    for (size, core), style in zip(GPT2_CORE.items(), ("--", "-.", ":", (0, (1, 4)))):
        ax_core.axhline(core, color="k", ls=style, lw=1, label=f"OpenAI {size} {core}")
    for ax, name in ((ax_hs, "HellaSwag"), (ax_core, "CORE")):
        if not any(run[name.lower()][0] for run in runs):
            ax.text(0.5, 0.5, f"no {name} evaluations in the log", transform=ax.transAxes, ha="center")
    ax_loss.set(title="loss", ylabel="cross-entropy (nats)")
    ax_hs.set(title="HellaSwag acc_norm", ylabel="accuracy")
    ax_core.set(title="CORE (core_eval.py)", ylabel="mean centered accuracy")
    tokens_axis(runs, x, (ax_loss, ax_hs, ax_core))
    for ax in (ax_loss, ax_hs, ax_core):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format=image_format)  # no bbox_inches="tight": the image keeps FIGSIZE x DPI pixels
    plt.close(fig)


def tokens_axis(runs, x, axes):
    """Labels the x axes in steps, with tokens along the top, or in tokens. Tokens along the
    top of a step axis need every run to train on the same number of tokens per step."""
    per_step = set().union(*(run["tokens_per_step"] for run in runs))
    if x == "step" and len(per_step) > 1:
        print("note: the runs differ in tokens per step, so there is no tokens axis (try --x tokens)", file=sys.stderr)
    common = per_step.pop() if len(per_step) == 1 else None
    tokens_format = FuncFormatter(lambda t, _: human(t, "g"))
    for ax in axes:
        ax.set_xlabel(x)
        if x == "tokens":
            ax.xaxis.set_major_formatter(tokens_format)
        elif common:
            top = ax.secondary_xaxis("top", functions=(lambda s: s * common, lambda t: t / common))
            top.xaxis.set_major_formatter(tokens_format)
            top.set_xlabel("tokens")


def main(argv=None):
    parser = Parser(prog="plot_log.py", description="Plot loss, HellaSwag and CORE of training runs from their log.jsonl.")
    parser.add_argument("logs", nargs="+", help="log directories of train_gpt2.py (or log.jsonl files)")
    parser.add_argument("-o", "--out", help="the image to write; its extension names the format (default: plot.png "
                                            "beside the first log, in its run's directory)")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the x axis")
    args = parser.parse_args(argv)
    if args.out is None:  # beside the run, not in whatever directory this was started from
        first = args.logs[0]
        args.out = os.path.join(first if os.path.isdir(first) else os.path.dirname(first), "plot.png")
    # Named by the extension, as matplotlib would; without one it would write OUT.png, not OUT.
    image_format = os.path.splitext(args.out)[1][1:].lower()
    if image_format not in FigureCanvasAgg.get_supported_filetypes():
        sys.exit(f"error: -o {args.out}: the extension must name an image format (png, pdf, svg, ...)")
    runs = [load_run(path) for path in args.logs]
    try:
        with atomic_open(args.out) as f:
            plot(runs, f, image_format, args.x)
    except OSError as e:  # a missing directory, or one we may not write to
        sys.exit(f"error: -o {args.out}: {e.strerror or e}")
    except RuntimeError as e:  # a writer that needs a missing tool (pgf: LaTeX)
        sys.exit(f"error: -o {args.out}: {first_line(e)}")
    for run in runs:
        print(summary(run))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
