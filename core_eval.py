"""CORE, the DCLM paper's average of 22 in-context tasks, scored as nanochat scores GPT-2.

    python core_eval.py --download_only                 # fetches nanochat's eval bundle to eval_bundle/, once
    python core_eval.py -m gpt2                         # downloads it first if it is not there
    python core_eval.py -m log/ckpt_019073.pt --json core.json
    python core_eval.py -m log/ --data my_bundle/ --tasks arc_easy,piqa --max_per_task 500
    torchrun --standalone --nproc_per_node=8 core_eval.py -m gpt2-xl   # the examples split over 8 GPUs

Each task's examples are shuffled with random.Random(1337) and cut to --max_per_task; the example
at position i gets num_fewshot others, drawn by random.Random(1234 + i).sample. Prompts are the
few-shot examples, each followed by a blank line, then the example: query + delimiter + choice
(multiple choice), context option + delimiter + continuation (schema), trimmed context + delimiter +
continuation (language modeling); <|endoftext|> first, cropped from the left to the model's context.
Multiple choice and schema pick the row of the lowest mean loss over its own tokens (those after
the rows' common start, or before their common end); language modeling is right when greedy
decoding gives every continuation token. centered = (accuracy - baseline) / (1 - baseline), and
CORE is the mean of the centered accuracies.

The rows of an example share their start: it is computed once, and every row's own tokens read
its keys and values from the KV cache, packed after it with a mask that keeps each row to itself.

train_gpt2.py scores CORE with load_for_run and evaluate; docs/evaluation.md has the rest.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import collections
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpt2repro.common import distributed
from gpt2repro.common.cli import Parser
from gpt2repro.common.devices import pick_dtype
from gpt2repro.common.distributed import Stopped, every_rank, never_stop
from gpt2repro.common.inputs import brief
from gpt2repro.common.progress import progress_meter
from gpt2repro.evals.continuations import branch_scores, common_start, units_of
from gpt2repro.evals.core_bundle import (BUNDLE_DIR, BUNDLE_URL, GPT2_ACCURACY, GPT2_CORE, URL_ENV, CoreError, Task,
                                         check_bundle, download_bundle, read_bundle, read_examples)
from gpt2repro.lm.tokenizer import EOT, get_encoding, gpt2_vocab_problem
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.loading import check_source, load_model_on
from gpt2repro.training import fsdp
from hellaswag import ScoringConfig

SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234  # nanochat's: the draws behind GPT-2's published figures


@dataclass(frozen=True)
class LoadedTask:
    """A task's examples in the protocol's order, as the model scores them."""
    task: Task
    lines: list  # each example's line in the task file
    golds: list  # each example's right answer (None for language modeling)
    rows: list  # each example's number of rows
    units: list  # every example's continuations.Units, in example order


# -----------------------------------------------------------------------------
# the bundle (core_bundle.py), downloaded where it is missing


def ensure_bundle(directory, local_rank=0):
    """directory, nanochat's bundle downloaded there first if it is not there (by local rank 0 only,
    the ranks beside it waiting). Only the default place is filled: another is the user's own."""
    if dist.is_initialized() and local_rank != 0:
        dist.barrier()
    error = None
    if local_rank == 0 and not os.path.exists(directory):
        if os.path.abspath(directory) != BUNDLE_DIR:
            error = f"--data {directory}: no such directory (`python core_eval.py --download_only --data {directory}` " \
                    f"fetches nanochat's bundle there)"
        else:
            try:
                download_bundle(os.environ.get(URL_ENV, BUNDLE_URL), directory)
            except CoreError as e:
                error = str(e)
    if dist.is_initialized() and local_rank == 0:
        dist.barrier()
    if error:
        raise CoreError(error)
    return directory



# -----------------------------------------------------------------------------
# the protocol


def ordered(examples, max_per_task=None):
    """A task's examples in the order that is scored: shuffled by random.Random(SHUFFLE_SEED), then
    the first max_per_task."""
    examples = list(examples)
    random.Random(SHUFFLE_SEED).shuffle(examples)
    return examples[:max_per_task]


def shots_of(i, n, num_fewshot):
    """The positions of the examples shown before the one at position i of n: num_fewshot of the
    others (all of them, if fewer), drawn by random.Random(FEWSHOT_SEED + i).sample from the list of
    the others. sample() reads its population by index only, so it draws the same indices from
    range(n - 1), each shifted past i, without a list of n positions for every one of n examples."""
    k = min(num_fewshot, n - 1)
    return [j + (j >= i) for j in random.Random(FEWSHOT_SEED + i).sample(range(n - 1), k)] if k > 0 else []


def prompts(task, example, shots):
    """The example's prompts, one per row, each with the shots first and a blank line after each;
    for language modeling two: the context alone (stripped) and with the continuation."""
    d = task.delimiter
    if task.kind == "multiple_choice":
        shown = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{shown}{example['query']}{d}{choice}" for choice in example["choices"]]
    if task.kind == "schema":
        shown = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{shown}{option}{d}{example['continuation']}" for option in example["context_options"]]
    shown = "".join(f"{s['context'].strip()}{d}{s['continuation']}\n\n" for s in shots)
    context = f"{shown}{example['context'].strip()}{d}"
    return [context.strip(), context + example["continuation"]]


def example_rows(task, example, shots):
    """[(tokens, start)] of each row: <|endoftext|> and the prompt's tokens, of which those from start
    on are scored: for multiple choice after the rows' common start, for schema within their common
    end, for language modeling the continuation's. ValueError where a continuation adds no tokens
    to its context's, or changes them (its first token merges with the context's last)."""
    enc = get_encoding()
    rows = [[EOT] + enc.encode_ordinary(prompt) for prompt in prompts(task, example, shots)]
    if task.kind == "multiple_choice":
        start = common_start(rows)
        return [(row, start) for row in rows]
    if task.kind == "schema":
        end = common_start([row[::-1] for row in rows])
        return [(row, len(row) - end) for row in rows]
    context, row = rows
    if len(row) <= len(context) or row[: len(context)] != context:
        raise ValueError(f"the continuation {brief(example['continuation'])} does not add tokens after the context's "
                         f"with the delimiter {task.delimiter!r}: nothing to score")
    return [(row, len(context))]


def load_task(task, block_size, max_per_task=None):
    """The LoadedTask of task for a model of block_size: its examples read, ordered, their rows built.
    CoreError names the file and line of an example that cannot be scored."""
    return prepare(task, ordered(read_examples(task), max_per_task), block_size)


def prepare(task, examples, block_size):
    """The LoadedTask of task's examples [(line, example)], in the order given, for a model of block_size."""
    items = [example for _, example in examples]
    n_rows, units = [], []
    for i, (line, example) in enumerate(examples):
        try:
            rows = example_rows(task, example, [items[j] for j in shots_of(i, len(items), task.num_fewshot)])
            units += units_of(i, rows, block_size)
        except ValueError as e:
            raise CoreError(f"{task.path} line {line}: {e}") from None
        n_rows.append(len(rows))
    return LoadedTask(task, [line for line, _ in examples], [e.get("gold") for e in items], n_rows, units)


def judged(task, gold, values):
    """Whether an example is right, from each row's (mean loss, greedy misses), (NaN, None) for a
    row with no tokens of its own: language modeling is right where greedy decoding missed none of
    the continuation's tokens; the others where the row of the lowest mean loss is gold's. That row
    is picked as Python's min() picks it in nanochat's code: a NaN first is kept, a NaN later never taken."""
    if task.kind == "language_modeling":
        return values[0][1] == 0
    means = [mean for mean, _ in values]
    best = 0
    for r, mean in enumerate(means):
        if mean < means[best]:
            best = r
    return best == gold


# -----------------------------------------------------------------------------
# scoring


def task_batches(loaded, batch_size, rank, world_size):
    """This rank's units of a task (those of the examples at positions rank, rank + world_size, ...)
    in batches of batch_size, the longest first: a batch of near-equal lengths wastes little on padding."""
    units = [u for u in loaded.units if u.example % world_size == rank]
    units.sort(key=lambda u: (-len(u.prefix), -sum(len(b.inputs) for b in u.branches)))
    return [units[i: i + batch_size] for i in range(0, len(units), batch_size)]


def score_rows(model, loaded, config, rank=0, world_size=1, stop_requested=never_stop):
    """{position: [(mean loss, greedy misses) of each row]} of this rank's share of loaded's examples
    ((NaN, None) for a row with nothing of its own to score). Every rank runs as many batches,
    asking stop_requested before each: Stopped (under FSDP each forward gathers weights from all
    ranks, so a short share repeats a batch, uncounted)."""
    batches = task_batches(loaded, config.batch_size, rank, world_size)
    values = {i: [(math.nan, None)] * loaded.rows[i] for i in range(rank, len(loaded.lines), world_size)}
    units_left = collections.Counter(unit.example for batch in batches for unit in batch)
    bar = progress_meter(loaded.task.label, "ex", total=len(values), initial=len(values) - len(units_left),
                         disable=not config.progress)
    for b in range(max(every_rank(len(batches)))):
        if stop_requested():
            bar.close()
            raise Stopped
        if b >= len(batches):
            if fsdp.is_sharded(model):
                branch_scores(model, batches[-1] if batches else loaded.units[:1], config.device, config.dtype)
            continue
        means, misses = branch_scores(model, batches[b], config.device, config.dtype)
        scores = iter(zip(means.tolist(), misses.tolist()))
        for unit in batches[b]:
            for branch in unit.branches:
                values[unit.example][branch.row] = next(scores)
            units_left[unit.example] -= 1
            bar.update(units_left[unit.example] == 0)
    bar.close()
    return values


def score_task(model, loaded, config, rank=0, world_size=1, stop_requested=never_stop):
    """[whether each example of loaded is right], in its order: each rank scores its share
    (score_rows), and the judgements are summed over the ranks."""
    values = score_rows(model, loaded, config, rank, world_size, stop_requested)
    judgements = torch.zeros(len(loaded.lines), dtype=torch.long)  # 1: wrong, 2: right, summed over the ranks
    for i, row_values in values.items():
        judgements[i] = 1 + judged(loaded.task, loaded.golds[i], row_values)
    if dist.is_initialized():
        judgements = judgements.to(config.device)
        dist.all_reduce(judgements)
    judgements = judgements.tolist()
    assert set(judgements) <= {1, 2}, "every example is judged by one rank"
    return [j == 2 for j in judgements]


def evaluate(model, tasks, config, rank=0, world_size=1, stop_requested=never_stop):
    """CORE of model (a GPT in evaluation mode, on config.device; FSDP-sharded or not) on tasks
    (LoadedTasks), the examples of each split over the ranks, as every rank returns it:
    {"core", "tasks": {label: {"accuracy", "centered", "n", "seconds"}}, "examples": [{"task",
    "index" (its line), "correct"}]}. Stopped where stop_requested says so before a batch."""
    result = {"core": None, "tasks": {}, "examples": []}
    for loaded in tasks:
        t0 = time.perf_counter()
        correct = score_task(model, loaded, config, rank, world_size, stop_requested)
        task, accuracy = loaded.task, sum(correct) / len(correct)
        centered = (accuracy - task.baseline / 100) / (1 - task.baseline / 100)
        result["tasks"][task.label] = dict(accuracy=accuracy, centered=centered, n=len(correct),
                                           seconds=time.perf_counter() - t0)
        result["examples"] += [dict(task=task.label, index=line, correct=c) for line, c in zip(loaded.lines, correct)]
    result["core"] = sum(t["centered"] for t in result["tasks"].values()) / len(result["tasks"])
    return result


def load_for_run(eval_config, gpt_config, log):
    """The LoadedTasks that a training run of eval_config (train_config.EvalConfig) scores at each
    CORE evaluation, or None, with a one-line note to log where it cannot (no bundle, a damaged one,
    a model that cannot read it): training goes on without CORE. Unless every rank loaded the same
    examples, no rank scores any (each evaluation is a collective)."""
    if not eval_config.core_interval:
        return None
    directory, tasks = eval_config.core_path or BUNDLE_DIR, None
    if not os.path.isdir(directory):
        log(f"note: no CORE bundle at {directory}: skipping CORE (`python core_eval.py --download_only` fetches "
            f"it to {BUNDLE_DIR})")
    else:
        try:
            if gpt2_vocab_problem(gpt_config.vocab_size):
                raise CoreError(gpt2_vocab_problem(gpt_config.vocab_size))
            tasks = [load_task(task, gpt_config.block_size, eval_config.core_limit or None)
                     for task in read_bundle(directory)]
        except CoreError as e:
            log(f"note: skipping CORE: {e}")
    counts = every_rank([len(t.lines) for t in tasks] if tasks else None)
    if len(set(map(str, counts))) > 1:
        log(f"note: skipping CORE: not every rank could load it (examples per task and rank: {counts})")
        return None
    return tasks


# -----------------------------------------------------------------------------
# command line


def report(result, model_name, complete):
    """The table: each task's accuracy and centered accuracy beside GPT-2 (124M)'s where known,
    and CORE beside the four GPT-2 sizes (comparable only where complete: every task, every example)."""
    width = max(len("task"), *map(len, result["tasks"]))
    lines = [f"{'task':<{width}}  {'n':>6}  accuracy  centered  GPT-2 (124M)"]
    for label, t in result["tasks"].items():
        reference = f"{GPT2_ACCURACY[label]:.4f}" if label in GPT2_ACCURACY else "-"
        lines.append(f"{label:<{width}}  {t['n']:>6}  {t['accuracy']:8.4f}  {t['centered']:8.4f}  {reference:>12}")
    sizes = ", ".join(f"{name} {core:.4f}" for name, core in GPT2_CORE.items())
    caveat = "" if complete else " (a part of the bundle: not comparable with GPT-2's)"
    lines.append(f"{model_name}: CORE {result['core']:.4f} over {len(result['tasks'])} tasks{caveat}; "
                 f"OpenAI's GPT-2, as nanochat measured it: {sizes}")
    return "\n".join(lines)


def build_parser():
    parser = Parser(prog="core_eval.py", description="Score a GPT-2 model on CORE (DCLM's 22 in-context tasks).")
    parser.add_argument("-m", "--model", default="gpt2",
                        help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 directory, a train_gpt2.py "
                             "checkpoint (.pt or sharded), or a run's log directory (its newest checkpoint)")
    parser.add_argument("--data", default=BUNDLE_DIR, help="the eval bundle: core.yaml, eval_meta_data.csv, eval_data/ "
                                                           "(the default place is filled by a download)")
    parser.add_argument("--tasks", default=None, help="comma-separated labels of core.yaml's tasks (default: all)")
    parser.add_argument("--max_per_task", type=int, default=None, help="score the first N examples of each task's "
                                                                       "shuffled order (default: all)")
    parser.add_argument("--batch_size", type=int, default=16, help="examples per forward pass")
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto: bfloat16 on CUDA (float16 before Ampere), else float32")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--download_only", action="store_true",
                        help="fetch nanochat's bundle into --data and check it, then exit: no model is loaded")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.max_per_task is not None and args.max_per_task < 1):
        parser.error("--batch_size and --max_per_task must be at least 1")
    labels = args.tasks.split(",") if args.tasks else None
    if args.download_only:
        return download_only(parser, args.data)
    if args.json:
        parser.check_output("--json", args.json)  # now, not after the scoring
    try:
        check_source(args.model)  # a mistyped -m is the error, not the download that would come first
        rank, local_rank, world_size, device = distributed.init(args.device)
    except (CheckpointError, distributed.RunError) as e:
        parser.fail(str(e))
    try:
        result = score(args, labels, rank, local_rank, world_size, device)
    except (CheckpointError, CoreError) as e:
        parser.fail(str(e))
    finally:
        distributed.leave()
    if rank == 0:
        print(report(result, args.model, labels is None and args.max_per_task is None))
        if args.json:
            parser.write_json(args.json, result)


def score(args, labels, rank, local_rank, world_size, device):
    """The CLI's result (evaluate's) on every rank: the bundle fetched if missing, read, the model loaded."""
    tasks = read_bundle(ensure_bundle(args.data, local_rank), labels)
    examples = [ordered(read_examples(task), args.max_per_task) for task in tasks]  # checked before the model loads
    model, device = load_model_on(args.model, device)
    loaded = [prepare(task, task_examples, model.config.block_size) for task, task_examples in zip(tasks, examples)]
    dtype = pick_dtype(args.dtype, torch.device(device).type)
    return evaluate(model, loaded, ScoringConfig(device, args.batch_size, dtype, progress=rank == 0), rank, world_size)


def download_only(parser, directory):
    """--download_only: the bundle fetched into directory and checked, or, if already there, checked."""
    try:
        if not os.path.exists(directory):
            download_bundle(os.environ.get(URL_ENV, BUNDLE_URL), directory)
        n_tasks, n_examples = check_bundle(directory)
    except CoreError as e:
        parser.fail(str(e))
    print(f"{directory}: {n_tasks} tasks, {n_examples:,} examples, checked")


if __name__ == "__main__":
    main()
