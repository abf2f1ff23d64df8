"""core_eval.py: the protocol against a plain scorer written here, batching and the KV cache, 2 ranks
against 1, the bundle's checks and download, the CLI. Offline; the bundles are written here."""
import dataclasses
import functools
import http.server
import json
import math
import os
import random
import threading
import warnings
import zipfile

import pytest
import torch
from torch.nn import functional as F

import core_eval
import train_gpt2
from gpt2repro.common.distributed import Stopped
from gpt2repro.evals import core_bundle
from gpt2repro.lm.tokenizer import EOT, get_encoding
from gpt2repro.runs.loading import load_model
from hellaswag import ScoringConfig
from helpers.models import make_tiny_gpt
from helpers.processes import call_on_ranks, exit_message
from helpers.runs import train
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# a plain scorer of the protocol: nanochat's scoring, one row a forward pass, its whole logits


def reference_values(model, path, kind, num_fewshot, delimiter, max_per_task=None):
    """[(line, [(mean loss, greedy misses) of each row], gold)] of a task file's examples in the
    protocol's order, each row run alone through model's forward. Written from the protocol's
    description, apart from core_eval's code: a row's scored tokens are those after the rows'
    common prefix (multiple choice), within their common suffix (schema), or after the context
    (language modeling); a row longer than the model's context keeps its last tokens."""
    with open(path, encoding="utf-8") as f:
        data = [(n, json.loads(text)) for n, text in enumerate(f, 1) if text.strip()]
    random.Random(1337).shuffle(data)
    data = data[:max_per_task]
    enc = get_encoding()
    results = []
    for i, (line, item) in enumerate(data):
        others = [j for j in range(len(data)) if j != i]
        picked = random.Random(1234 + i).sample(others, min(num_fewshot, len(others))) if num_fewshot and others else []
        shots = [data[j][1] for j in picked]
        if kind == "multiple_choice":
            shown = [s["query"] + delimiter + s["choices"][s["gold"]] for s in shots]
            rows = [[EOT] + enc.encode_ordinary("\n\n".join(shown + [item["query"] + delimiter + c]))
                    for c in item["choices"]]
            same = 0
            while all(len(r) > same for r in rows) and len({r[same] for r in rows}) == 1:
                same += 1
            spans = [(same, len(r)) for r in rows]
        elif kind == "schema":
            shown = [s["context_options"][s["gold"]] + delimiter + s["continuation"] for s in shots]
            rows = [[EOT] + enc.encode_ordinary("\n\n".join(shown + [o + delimiter + item["continuation"]]))
                    for o in item["context_options"]]
            same = 0
            while all(len(r) > same for r in rows) and len({r[-1 - same] for r in rows}) == 1:
                same += 1
            spans = [(len(r) - same, len(r)) for r in rows]
        else:
            shown = [s["context"].strip() + delimiter + s["continuation"] for s in shots]
            head = "\n\n".join(shown + [item["context"].strip() + delimiter])
            without = [EOT] + enc.encode_ordinary(head.strip())
            rows = [[EOT] + enc.encode_ordinary(head + item["continuation"])]
            spans = [(len(without), len(rows[0]))]
        results.append((line, [row_scores(model, r, s, e) for r, (s, e) in zip(rows, spans)], item.get("gold")))
    return results


@torch.no_grad()
def row_scores(model, row, start, end):
    """(mean loss, greedy misses) of row's tokens start..end-1, the row cut to its last block_size tokens."""
    cut = max(0, len(row) - model.config.block_size)
    row, start, end = row[cut:], start - cut, end - cut
    logits = model(torch.tensor([row]))[0][0].float()
    losses = F.cross_entropy(logits[:-1], torch.tensor(row[1:]), reduction="none")
    scored = slice(start - 1, end - 1)
    misses = (logits[scored].argmax(dim=-1) != torch.tensor(row[start:end])).sum().item()
    return losses[scored].mean().item(), misses


def reference_correct(kind, values, gold):
    """As nanochat judges: greedy missed nothing; or Python's min() over the means, then index()."""
    if kind == "language_modeling":
        return values[0][1] == 0
    means = [mean for mean, _ in values]
    return means.index(min(means)) == gold


def assert_same_values(model, task, max_per_task=None, batch_size=16):
    """core_eval's scores of every row and judgement of every example of task equal the plain scorer's."""
    loaded = core_eval.load_task(task, model.config.block_size, max_per_task)
    got = core_eval.score_rows(model, loaded, ScoringConfig("cpu", batch_size))
    expected = reference_values(model, task.path, task.kind, task.num_fewshot, task.delimiter, max_per_task)
    assert loaded.lines == [line for line, _, _ in expected]
    for i, (line, rows, gold) in enumerate(expected):
        assert len(got[i]) == len(rows), line
        for (mean, misses), (ref_mean, ref_misses) in zip(got[i], rows):
            assert (math.isnan(mean) and math.isnan(ref_mean)) or mean == pytest.approx(ref_mean, rel=1e-4, abs=1e-4), line
            assert misses == (None if math.isnan(ref_mean) else ref_misses), line
        assert core_eval.judged(task, loaded.golds[i], got[i]) == reference_correct(task.kind, rows, gold), line
    return loaded


@pytest.mark.skipif(not os.environ.get("CORE_BUNDLE"), reason="CORE_BUNDLE names no real eval bundle")
def test_real_bundle_judgements_equal_the_plain_scorers():
    """On a real bundle (run by hand: CORE_BUNDLE=DIR), each task whose file is there (or those of
    CORE_TASKS=a,b), CORE_PER_TASK examples of each (default 20; 0: all), through a tiny random
    model of CORE_BLOCK_SIZE positions (default 256: the few-shot prompts are cut)."""
    directory, per_task = os.environ["CORE_BUNDLE"], int(os.environ.get("CORE_PER_TASK", 20)) or None
    labels = os.environ["CORE_TASKS"].split(",") if os.environ.get("CORE_TASKS") else None
    model = make_tiny_gpt(block_size=int(os.environ.get("CORE_BLOCK_SIZE", 256)))
    counts = {}
    for task in core_bundle.read_bundle(directory, labels):
        if os.path.exists(task.path):
            loaded = assert_same_values(model, task, per_task)
            counts[task.label] = (len(loaded.lines), sum(loaded.rows))
    print(f"compared {sum(n for n, _ in counts.values())} examples, {sum(r for _, r in counts.values())} rows: {counts}")


# -----------------------------------------------------------------------------
# small bundles, each task type once

MC_EXAMPLES = [
    {"query": "Question: What do bees make?", "choices": ["honey", "bread", "glass", "iron nails"], "gold": 0},
    {"query": "Question: Which is a planet?", "choices": ["the Moon", "Mars", "Sirius", "a comet"], "gold": 1},
    {"query": "Question: What melts ice?", "choices": ["cold air", "darkness", "heat from the sun", "salt water"],
     "gold": 2},
    {"query": "Question: Where do fish live?", "choices": ["in trees", "in the desert", "on clouds", "in water"],
     "gold": 3},
    {"query": "Question: What do you use to cut paper?", "choices": ["scissors", "a spoon", "a pillow", "soap"],
     "gold": 0},
    {"query": "Question: Which animal barks?", "choices": ["a cat", "a dog", "a fish", "a snail"], "gold": 1},
    {"query": "Question: What is frozen water called?", "choices": ["steam", "sand", "ice", "wind"], "gold": 2},
    {"query": "Question: How many legs does a spider have?", "choices": ["two", "four", "six", "eight"], "gold": 3},
]
SCHEMA_EXAMPLES = [
    {"context_options": ["The trophy did not fit in the suitcase because the trophy",
                         "The trophy did not fit in the suitcase because the suitcase"],
     "continuation": "was too big.", "gold": 0},
    {"context_options": ["Anna thanked Maria because Anna", "Anna thanked Maria because Maria"],
     "continuation": "had helped her move house.", "gold": 1},
    {"context_options": ["The man lifted the boy onto his shoulders because the man",
                         "The man lifted the boy onto his shoulders because the boy"],
     "continuation": "was so strong.", "gold": 0},
    {"context_options": ["The cat chased the mouse until the cat", "The cat chased the mouse until the mouse"],
     "continuation": "hid in a hole in the wall.", "gold": 1},
    {"context_options": ["Sam gave Tom his old bike since Sam", "Sam gave Tom his old bike since Tom"],
     "continuation": "needed a way to get to school.", "gold": 1},
]
LM_EXAMPLES = [
    {"context": "The capital of France is", "continuation": "Paris"},
    {"context": "One, two, three, four,", "continuation": "five"},
    {"context": "  The opposite of hot is  ", "continuation": "cold"},
    {"context": "Roses are red, violets are", "continuation": "blue"},
    {"context": "The first month of the year is", "continuation": "January"},
    {"context": "Water boils at one hundred degrees", "continuation": "Celsius at sea level"},
]
# label: (icl_task_type, num_fewshot, continuation_delimiter, random baseline in percent, examples)
TASKS = {"mc": ("multiple_choice", 3, "\nAnswer: ", 25, MC_EXAMPLES), "schema": ("schema", 1, " ", 50, SCHEMA_EXAMPLES),
         "lm": ("language_modeling", 2, " ", 0, LM_EXAMPLES)}


def write_bundle(directory, tasks=None):
    """An eval bundle laid out as DCLM's and nanochat's: core.yaml, eval_meta_data.csv, eval_data/."""
    tasks = TASKS if tasks is None else tasks
    os.makedirs(os.path.join(directory, "eval_data", "kinds"), exist_ok=True)
    config, meta = ["icl_tasks:"], ["Eval Task,Task Category,Random baseline,Description"]
    for label, (kind, shots, delimiter, baseline, examples) in tasks.items():
        config += ["-", f"  label: {label}", f"  dataset_uri: kinds/{label}.jsonl", f"  num_fewshot: [{shots}]",
                   f"  icl_task_type: {kind}", f"  continuation_delimiter: {json.dumps(delimiter)}"]
        meta.append(f"{label},testing,{baseline},\"a task, written by the tests\"")
        with open(os.path.join(directory, "eval_data", "kinds", f"{label}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in examples)
    with open(os.path.join(directory, "core.yaml"), "w", encoding="utf-8") as f:
        f.write("\n".join(config) + "\n")
    with open(os.path.join(directory, "eval_meta_data.csv"), "w", encoding="utf-8") as f:
        f.write("\n".join(meta) + "\n")
    return str(directory)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_bundle(tmp_path_factory.mktemp("bundle") / "eval_bundle")


@pytest.fixture(scope="module")
def tiny():
    """A tiny GPT of 32 positions: the 3-shot prompts are cut from the left."""
    return make_tiny_gpt(block_size=32)


def test_prompts_are_written_as_nanochat_writes_them():
    def task(kind, delimiter):
        return core_bundle.Task("t", "t.jsonl", kind, 2, delimiter, 0.0)
    mc = task("multiple_choice", "\nAnswer: ")
    assert core_eval.prompts(mc, MC_EXAMPLES[2], MC_EXAMPLES[:2]) == [
        "Question: What do bees make?\nAnswer: honey\n\nQuestion: Which is a planet?\nAnswer: Mars\n\n"
        f"Question: What melts ice?\nAnswer: {choice}" for choice in MC_EXAMPLES[2]["choices"]]
    assert core_eval.prompts(task("schema", " "), SCHEMA_EXAMPLES[1], SCHEMA_EXAMPLES[:1]) == [
        "The trophy did not fit in the suitcase because the trophy was too big.\n\n"
        f"Anna thanked Maria because {who} had helped her move house." for who in ("Anna", "Maria")]
    # The contexts trimmed; the one without its continuation stripped too (of the delimiter).
    assert core_eval.prompts(task("language_modeling", " "), LM_EXAMPLES[2], LM_EXAMPLES[:2]) == [
        "The capital of France is Paris\n\nOne, two, three, four, five\n\nThe opposite of hot is",
        "The capital of France is Paris\n\nOne, two, three, four, five\n\nThe opposite of hot is cold"]
    assert core_eval.prompts(mc, MC_EXAMPLES[0], []) == [f"Question: What do bees make?\nAnswer: {c}"
                                                          for c in MC_EXAMPLES[0]["choices"]]


def test_examples_are_shuffled_and_shots_drawn_as_nanochat_draws_them():
    examples = list(range(20))
    shuffled = list(range(20))
    random.Random(1337).shuffle(shuffled)
    assert core_eval.ordered(examples) == shuffled and core_eval.ordered(examples, 5) == shuffled[:5]
    for i, n in [(0, 20), (7, 20), (19, 20), (0, 5000), (1234, 5000), (4999, 5000)]:  # sample()'s two ways
        assert core_eval.shots_of(i, n, 10) == random.Random(1234 + i).sample([j for j in range(n) if j != i], 10)
    assert sorted(core_eval.shots_of(2, 4, 10)) == [0, 1, 3]  # fewer than asked for: all the others
    assert core_eval.shots_of(0, 1, 10) == [] and core_eval.shots_of(3, 20, 0) == []


@pytest.mark.parametrize("batch_size", [16, 3, 1])
def test_every_row_scores_as_a_plain_scorer_scores_it_alone(tiny, bundle, batch_size):
    """Each row's mean loss and greedy misses, and each judgement, batched or not, through the KV
    cache of its example's shared start, equal a plain scorer's of the row alone; the 3-shot
    prompts are longer than the model's 32 positions, so rows are cut, and rows cut alike share."""
    for task in core_bundle.read_bundle(bundle):
        loaded = assert_same_values(tiny, task, batch_size=batch_size)
        assert any(u.prefix[0] != EOT for u in loaded.units)  # rows were cut
        if task.kind == "multiple_choice":
            assert len(loaded.lines) < len(loaded.units) < sum(loaded.rows)  # some cut apart, some alike


def test_rows_share_their_start_only_where_cut_alike():
    rows = [([EOT, 1, 2, 3, 4, 5], 4), ([EOT, 1, 2, 3, 9], 4), ([EOT, 1, 2, 3, 7, 8], 4)]
    [unit] = core_eval.units_of(0, rows, 64)
    assert unit.prefix.tolist() == [EOT, 1, 2] and [b.inputs.tolist() for b in unit.branches] == [[3, 4], [3], [3, 7]]
    assert [(b.first, b.targets.tolist()) for b in unit.branches] == [(0, [4, 5]), (0, [9]), (0, [7, 8])]
    # Cut to 5 tokens: the two rows of 6 lose one token alike, the row of 5 none.
    cut, short = core_eval.units_of(0, rows, 5)
    assert (short.prefix.tolist(), [b.row for b in short.branches]) == ([EOT, 1, 2], [1])
    assert (cut.prefix.tolist(), [b.row for b in cut.branches]) == ([1, 2], [0, 2])
    with pytest.raises(ValueError, match="an answer of 2 tokens does not fit block_size 2"):
        core_eval.units_of(0, rows, 2)


def unigram_model(token_logits, block_size=64):
    """A GPT whose next-token logits are token_logits wherever it reads, whatever came before."""
    model = GPT(GPTConfig(block_size=block_size, vocab_size=50304, n_layer=1, n_head=1, n_embd=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[: len(token_logits), 0] = token_logits
    return model


def test_greedy_decoding_and_the_lowest_mean_judge(tmp_path):
    enc = get_encoding()
    the, cat = enc.encode_ordinary(" the"), enc.encode_ordinary(" cat")
    logits = torch.zeros(50257)
    logits[the] = 5.0  # greedy decoding says " the" after anything
    logits[cat] = 4.0
    lm = [{"context": "Say it twice:", "continuation": "the the"}, {"context": "Say it:", "continuation": "the cat"},
          {"context": "A word:", "continuation": "the"}]
    # " the" costs less than " cat", so the choice of fewer " cat"s by its mean loss wins.
    mc = [{"query": "Pick:", "choices": ["cat cat", "the cat the", "cat the"], "gold": 1},
          {"query": "Pick:", "choices": ["cat the the", "cat cat", "the"], "gold": 0}]
    directory = write_bundle(tmp_path / "b", {"lm": ("language_modeling", 0, " ", 0, lm),
                                               "mc": ("multiple_choice", 0, " ", 25, mc)})
    result = core_eval.evaluate(unigram_model(logits), [core_eval.load_task(t, 64) for t in
                                                       core_bundle.read_bundle(directory)], ScoringConfig("cpu"))
    right = {(e["task"], e["index"]): e["correct"] for e in result["examples"]}
    assert right == {("lm", 1): True, ("lm", 2): False, ("lm", 3): True, ("mc", 1): True, ("mc", 2): False}
    assert result["tasks"]["mc"] == dict(result["tasks"]["mc"], accuracy=0.5, centered=(0.5 - 0.25) / 0.75, n=2)
    assert result["core"] == pytest.approx(((2 / 3) + (0.5 - 0.25) / 0.75) / 2)


@pytest.mark.parametrize("gold, right", [(0, True), (1, False)])
def test_a_choice_that_is_the_start_of_another_is_judged_as_nanochat_judges_it(tiny, tmp_path, gold, right):
    """" water" is the start of " watermelon"'s tokens: that row has no tokens of its own, its mean
    loss is NaN, and Python's min() in nanochat's code keeps a NaN that comes first (4 PIQA examples)."""
    example = {"query": "Question: compactor\n", "choices": ["can squish  water", "can squish  watermelon"], "gold": gold}
    directory = write_bundle(tmp_path / "b", {"piqa": ("multiple_choice", 0, "\nAnswer: ", 50, [example])})
    [task] = core_bundle.read_bundle(directory)
    loaded = assert_same_values(tiny, task)
    values = core_eval.score_rows(tiny, loaded, ScoringConfig("cpu"))[0]
    assert math.isnan(values[0][0]) and values[0][1] is None and not math.isnan(values[1][0])
    assert core_eval.score_task(tiny, loaded, ScoringConfig("cpu")) == [right]
    assert core_eval.judged(task, 2, [(2.0, 0), (math.nan, None), (1.0, 0)]) is True  # a NaN later is never taken


def test_a_stop_between_batches_ends_the_evaluation(tiny, bundle):
    loaded = [core_eval.load_task(task, tiny.config.block_size) for task in core_bundle.read_bundle(bundle)]
    asked = []

    def stop_after_two():
        asked.append(True)
        return len(asked) > 2
    with pytest.raises(Stopped):
        core_eval.evaluate(tiny, loaded, ScoringConfig("cpu", batch_size=2), stop_requested=stop_after_two)
    assert len(asked) == 3  # asked before each batch: two scored, and the stop before the third
    assert core_eval.evaluate(tiny, loaded, ScoringConfig("cpu"), stop_requested=lambda: False)["core"] is not None


# -----------------------------------------------------------------------------
# the command line, and the bundles it refuses


def save_checkpoint(model, path):
    """model as train_gpt2.py saves it, weights and config."""
    torch.save({"model": model.state_dict(), "config": dataclasses.asdict(model.config), "step": 0}, path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    return save_checkpoint(tiny, tmp_path_factory.mktemp("ckpt") / "ckpt.pt")


def test_cli_prints_the_table_and_writes_the_json(tiny, bundle, checkpoint, tmp_path, capsys):
    out = tmp_path / "core.json"
    core_eval.main(["-m", checkpoint, "--data", bundle, "--json", str(out), "--device", "cpu", "--batch_size", "3"])
    result = json.loads(out.read_text())
    loaded = [core_eval.load_task(task, 32) for task in core_bundle.read_bundle(bundle)]
    expected = core_eval.evaluate(tiny, loaded, ScoringConfig("cpu"))
    assert result.keys() == {"core", "tasks", "examples"} and result["examples"] == expected["examples"]
    for label, task in result["tasks"].items():
        assert task.keys() == {"accuracy", "centered", "n", "seconds"} and task["seconds"] > 0
        assert {k: task[k] for k in ("accuracy", "centered", "n")} == {k: expected["tasks"][label][k]
                                                                        for k in ("accuracy", "centered", "n")}
    assert result["core"] == sum(t["centered"] for t in result["tasks"].values()) / 3 == expected["core"]
    # index: each example's line in its task file, every example once, in the protocol's order
    lines = [e["index"] for e in result["examples"] if e["task"] == "mc"]
    assert lines == [i + 1 for i in core_eval.ordered(range(len(MC_EXAMPLES)))]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["task", "n", "accuracy", "centered", "GPT-2", "(124M)"]
    assert [row.split()[:2] for row in table[1:4]] == [["mc", "8"], ["schema", "5"], ["lm", "6"]]
    assert table[4].startswith(f"{checkpoint}: CORE {result['core']:.4f} over 3 tasks; OpenAI's GPT-2, as nanochat "
                               f"measured it: gpt2 0.1139, gpt2-medium 0.1849, gpt2-large 0.2146, gpt2-xl 0.2565")


def test_tasks_and_max_per_task_score_a_part(tiny, bundle, checkpoint, tmp_path, capsys):
    out = tmp_path / "part.json"
    core_eval.main(["-m", checkpoint, "--data", bundle, "--tasks", "lm,mc", "--max_per_task", "4", "--json", str(out),
                    "--device", "cpu"])
    result = json.loads(out.read_text())
    assert list(result["tasks"]) == ["mc", "lm"] and [t["n"] for t in result["tasks"].values()] == [4, 4]
    assert "over 2 tasks (a part of the bundle: not comparable with GPT-2's)" in capsys.readouterr().out
    # The first 4 of the shuffled order, their shots drawn from those 4.
    [mc] = core_bundle.read_bundle(bundle, ["mc"])
    assert [e["index"] for e in result["examples"][:4]] == [line for line, _, _ in
                                                           reference_values(tiny, mc.path, mc.kind, 3, mc.delimiter, 4)]


def edited_bundle(tmp_path, edit):
    """A copy of the test bundle with edit(directory) applied."""
    directory = write_bundle(tmp_path / "bad")
    edit(directory)
    return directory


def replace_in(path, old, new):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert old in text
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))


def line_of(directory, label, n, text):
    """Replaces line n of a task's file with text."""
    path = os.path.join(directory, "eval_data", "kinds", f"{label}.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    lines[n - 1] = text
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def task_file(label):
    return os.path.join("eval_data", "kinds", f"{label}.jsonl")


@pytest.mark.parametrize("edit, message", [
    (lambda d: os.remove(os.path.join(d, task_file("schema"))),
     "{d}/eval_data/kinds/schema.jsonl: no such file, yet core.yaml's task 'schema' names it: the bundle is incomplete "
     "(fetch it anew with `python core_eval.py --download_only --data NEW_DIR`), or leave the task out with --tasks"),
    (lambda d: line_of(d, "mc", 3, '{"query": "Q", "choices": ["a", "b"], "gold": 0'),
     "{d}/eval_data/kinds/mc.jsonl line 3: not valid JSON (Expecting ',' delimiter"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "icl_task_type: schema", "icl_task_type: generation"),
     "{d}/core.yaml line 12: unknown icl_task_type 'generation' (core_eval.py scores multiple_choice, schema, "
     "language_modeling): leave the task out with --tasks"),
    (lambda d: line_of(d, "mc", 2, '{"query": "Q", "choices": ["a", "b"], "gold": 2}'),
     "{d}/eval_data/kinds/mc.jsonl line 2: gold must be the index of one of the 2 choices, not 2"),
    (lambda d: line_of(d, "schema", 4, '{"context_options": [], "continuation": "x", "gold": 0}'),
     "{d}/eval_data/kinds/schema.jsonl line 4: context_options must be a list of 1 to 100 strings"),
    (lambda d: line_of(d, "mc", 1, '{"query": "Q", "choices": [], "gold": 0}'),
     "{d}/eval_data/kinds/mc.jsonl line 1: choices must be a list of 1 to 100 strings"),
    (lambda d: line_of(d, "lm", 5, '{"context": "Q", "continuation": ""}'),
     "{d}/eval_data/kinds/lm.jsonl line 5: continuation must not be empty: there would be nothing to score"),
    (lambda d: line_of(d, "lm", 5, '{"context": "Q"}'),
     "{d}/eval_data/kinds/lm.jsonl line 5: missing field 'continuation' (a language_modeling example has context, "
     "continuation)"),
    (lambda d: line_of(d, "mc", 6, '{"query": "Q \\udc00", "choices": ["a"], "gold": 0}'),
     "{d}/eval_data/kinds/mc.jsonl line 6: query holds '\\udc00', a lone surrogate: not Unicode text"),
    (lambda d: write_bundle(d, {"lm": ("language_modeling", 0, "", 0, [
        {"context": "The capital of France is", "continuation": " Paris"},
        {"context": "Count: on", "continuation": "e"}, {"context": "Roses are", "continuation": " red"}])}),
     "{d}/eval_data/kinds/lm.jsonl line 2: the continuation 'e' does not add tokens after the context's with the "
     "delimiter '': nothing to score"),
    (lambda d: replace_in(os.path.join(d, "eval_meta_data.csv"), "schema,testing,50,", "other,testing,50,"),
     "{d}/core.yaml line 9: task 'schema' has no row in {d}/eval_meta_data.csv: add its Random baseline (in "
     "percent) there, or leave the task out with --tasks"),
    (lambda d: replace_in(os.path.join(d, "eval_meta_data.csv"), "schema,testing,50,", "schema,testing,fifty,"),
     "{d}/eval_meta_data.csv line 3: the Random baseline of 'schema' must be a percentage in [0, 100), not 'fifty': "
     "correct it"),
    (lambda d: replace_in(os.path.join(d, "eval_meta_data.csv"), "schema,testing,50,", "schema,testing,100,"),
     "{d}/eval_meta_data.csv line 3: the Random baseline of 'schema' must be a percentage in [0, 100), not '100': "
     "correct it"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "num_fewshot: [1]", "num_fewshot: [1000]"),
     "{d}/core.yaml line 11: num_fewshot must be 0 to 100 (or a list, of which the first counts), not 1000"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "dataset_uri: kinds/lm.jsonl", "dataset_uri: ../../lm.jsonl"),
     "{d}/core.yaml line 16: dataset_uri must be a path inside eval_data/, not '../../lm.jsonl'"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "label: lm", "label: mc"),
     "{d}/core.yaml line 15: a second task labelled 'mc': give each its own label"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "num_fewshot: [1]", "num_fewshot: *shots") or
     replace_in(os.path.join(d, "core.yaml"), "icl_tasks:", "shots: &shots [1]\nicl_tasks:"),
     "{d}/core.yaml line 12: a YAML alias (*name): core.yaml is plain data; write the value out"),
    (lambda d: replace_in(os.path.join(d, "core.yaml"), "icl_tasks:", "icl_tasks: [\n"),
     "{d}/core.yaml: not YAML (while parsing a flow"),
    (lambda d: os.remove(os.path.join(d, "eval_meta_data.csv")),
     "{d}/eval_meta_data.csv: no such file: an eval bundle holds one beside core.yaml"),
])
def test_a_bad_bundle_is_one_line_naming_the_file_and_line(checkpoint, tmp_path, capsys, edit, message):
    directory = edited_bundle(tmp_path, edit)
    out = tmp_path / "out.json"
    error = exit_message(capsys, core_eval.main, "-m", checkpoint, "--data", directory, "--json", out, "--device", "cpu")
    assert error.startswith(f"core_eval.py: error: {message.format(d=directory)}")
    assert not out.exists() and os.listdir(tmp_path) == ["bad"]  # nothing written


@pytest.mark.parametrize("name", ["core.yaml", "eval_meta_data.csv", os.path.join("eval_data", "kinds", "lm.jsonl")])
def test_a_bundle_file_that_never_ends_is_refused_unread(checkpoint, tmp_path, capsys, name):
    """A FIFO would wait for a writer forever, /dev/zero never end: refused as not regular files."""
    directory = write_bundle(tmp_path / "bundle")
    os.remove(os.path.join(directory, name))
    os.mkfifo(os.path.join(directory, name))
    error = exit_message(capsys, core_eval.main, "-m", checkpoint, "--data", directory, "--device", "cpu")
    assert error == f"core_eval.py: error: {os.path.join(directory, name)}: a FIFO, not a regular file"


# -----------------------------------------------------------------------------
# the download, from a server on 127.0.0.1


def zip_of(bundle, path, extra=()):
    """bundle's files as nanochat's zip holds them, under eval_bundle/; extra: (name, bytes) more members."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for root, _, files in os.walk(bundle):
            for name in files:
                full = os.path.join(root, name)
                z.write(full, os.path.join("eval_bundle", os.path.relpath(full, bundle)))
        with warnings.catch_warnings():  # a name twice, on purpose
            warnings.simplefilter("ignore", UserWarning)
            for name, data in extra:
                z.writestr(name, data)
    return path


@pytest.fixture
def server(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving tmp_path/served/, core_eval's download URL pointed at its
    eval_bundle.zip. Yields the folder it serves."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(core_bundle.URL_ENV, f"http://127.0.0.1:{httpd.server_address[1]}/eval_bundle.zip")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    yield served
    httpd.shutdown()
    httpd.server_close()


def test_download_only_fetches_and_checks_the_bundle_then_runs_need_no_network(bundle, checkpoint, server, tmp_path,
                                                                               capsys):
    zip_of(bundle, server / "eval_bundle.zip", extra=[("__MACOSX/._core.yaml", b"\x00\x05")])
    target = tmp_path / "data" / "eval_bundle"
    core_eval.main(["--download_only", "--data", str(target)])
    assert capsys.readouterr().out.splitlines()[-1] == f"{target}: 3 tasks, 19 examples, checked"
    assert sorted(os.listdir(target)) == ["core.yaml", "eval_data", "eval_meta_data.csv"]
    assert os.listdir(tmp_path / "data") == ["eval_bundle"]  # no zip, no partial directory left
    (server / "eval_bundle.zip").unlink()  # offline from here on
    core_eval.main(["--download_only", "--data", str(target)])  # there already: checked, not fetched
    assert capsys.readouterr().out.splitlines()[-1] == f"{target}: 3 tasks, 19 examples, checked"
    core_eval.main(["-m", checkpoint, "--data", str(target), "--device", "cpu", "--tasks", "lm"])
    assert "CORE" in capsys.readouterr().out


@pytest.mark.parametrize("members, why", [
    ([("eval_bundle/../evil.txt", b"x")], "the zip's member 'eval_bundle/../evil.txt' is a path outside the bundle"),
    ([("/etc/evil.txt", b"x")], "the zip's member '/etc/evil.txt' is a path outside the bundle"),
    ([("eval_bundle/eval_data/kinds/mc.jsonl", b"x")], "the zip holds 'eval_bundle/eval_data/kinds/mc.jsonl' twice"),
    ([("eval_bundle/big.bin", b"\0" * 5000)], "the unpacked bundle is larger than 4,000 bytes"),
])
def test_a_zip_that_is_not_a_sound_bundle_is_refused_and_leaves_nothing(bundle, server, tmp_path, monkeypatch, capsys,
                                                                        members, why):
    monkeypatch.setattr(core_bundle, "MAX_BUNDLE_BYTES", 4000 if "larger" in why else core_bundle.MAX_BUNDLE_BYTES)
    zip_of(bundle if "larger" not in why else tmp_path / "none", server / "eval_bundle.zip", extra=members)
    target = tmp_path / "data" / "eval_bundle"
    error = exit_message(capsys, core_eval.main, "--download_only", "--data", target)
    assert error.startswith(f"core_eval.py: error: {os.environ[core_bundle.URL_ENV]}: not a usable eval bundle: ")
    assert error.endswith(why)
    assert not (tmp_path / "data").exists() and not (tmp_path / "evil.txt").exists()


def test_a_bundle_whose_data_fails_its_checks_is_refused_naming_the_file_in_the_zip(bundle, server, tmp_path, capsys):
    damaged = edited_bundle(tmp_path, lambda d: line_of(d, "schema", 2, '{"context_options": ["a"], "gold": 0}'))
    zip_of(damaged, server / "eval_bundle.zip")
    error = exit_message(capsys, core_eval.main, "--download_only", "--data", tmp_path / "data" / "eval_bundle")
    assert error == (f"core_eval.py: error: {os.environ[core_bundle.URL_ENV]}: not a usable eval bundle: "
                     f"eval_bundle/eval_data/kinds/schema.jsonl line 2: missing field 'continuation' (a schema example "
                     f"has context_options, continuation, gold)")
    assert not (tmp_path / "data").exists()


def test_without_network_or_bundle_it_is_one_line_and_leaves_nothing(checkpoint, server, tmp_path, monkeypatch, capsys):
    # Nothing served: a 404. The default place is filled by a download, which fails.
    default = str(tmp_path / "default" / "eval_bundle")
    monkeypatch.setattr(core_eval, "BUNDLE_DIR", default)
    error = exit_message(capsys, core_eval.main, "-m", checkpoint, "--device", "cpu")
    assert error.startswith(f"core_eval.py: error: could not download {os.environ[core_bundle.URL_ENV]} (File not found); "
                            f"run this where there is a network, or unpack a copy of the bundle into {default}")
    assert not (tmp_path / "default").exists()
    # Another place is the user's own: never downloaded into.
    error = exit_message(capsys, core_eval.main, "-m", checkpoint, "--data", tmp_path / "mine", "--device", "cpu")
    assert error == (f"core_eval.py: error: --data {tmp_path / 'mine'}: no such directory (`python core_eval.py "
                     f"--download_only --data {tmp_path / 'mine'}` fetches nanochat's bundle there)")


# -----------------------------------------------------------------------------
# ranks


def without_times(result):
    return {**result, "tasks": {k: {**v, "seconds": None} for k, v in result["tasks"].items()}}


@pytest.mark.slow
def test_two_ranks_give_one_process_result(bundle, checkpoint, tmp_path):
    """Each rank scores every second example of each task (schema's 5 in shares of 3 and 2), each
    judged by one rank (score_task checks): the JSON rank 0 writes equals one process's, example by example."""
    flags = ["-m", checkpoint, "--data", bundle, "--device", "cpu", "--batch_size", "2"]
    core_eval.main(flags + ["--json", str(tmp_path / "one.json")])
    ranks = call_on_ranks(core_eval.main, flags + ["--json", str(tmp_path / "two.json")])
    assert [rank.returncode for rank in ranks.ranks] == [0, 0], ranks.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert without_times(two) == without_times(one)
    assert sorted(os.listdir(tmp_path)) == ["one.json", "two.json"]  # rank 1 wrote nothing


# -----------------------------------------------------------------------------
# during training


@pytest.mark.slow
def test_training_logs_the_core_of_its_checkpoints(shards, bundle, tmp_path, capsys):
    """CORE at every --core_interval steps and at the end, in log.jsonl, equal to core_eval's of the
    checkpoint the run ends with."""
    records = train(shards, tmp_path / "log", "--total_batch_size", "256", "-B", "8", "--vocab_size", "50304",
                    "--max_steps", "3", "--core_interval", "2", "--core_limit", "4", "--core_path", bundle)
    core = [r for r in records if "core" in r]
    assert [(r["step"], r["core_n"], sorted(r["core_accuracy"])) for r in core] == [
        (2, 12, ["lm", "mc", "schema"]), (3, 12, ["lm", "mc", "schema"])]
    assert "step     3 | CORE " in capsys.readouterr().out
    model = load_model(str(tmp_path / "log" / "ckpt_000003.pt")).eval()
    loaded = [core_eval.load_task(task, model.config.block_size, 4) for task in core_bundle.read_bundle(bundle)]
    result = core_eval.evaluate(model, loaded, ScoringConfig("cpu"))
    assert core[-1]["core"] == result["core"]
    assert core[-1]["core_accuracy"] == {label: t["accuracy"] for label, t in result["tasks"].items()}


def test_training_skips_core_with_a_note_where_it_cannot_score_it(bundle, tmp_path):
    notes = []
    cfg = train_gpt2.parse_args(["--core_path", str(tmp_path / "absent")])
    assert core_eval.load_for_run(cfg.eval, cfg.model, notes.append) is None
    assert notes == [f"note: no CORE bundle at {tmp_path / 'absent'}: skipping CORE (`python core_eval.py "
                     f"--download_only` fetches it to {core_bundle.BUNDLE_DIR})"]
    cfg = train_gpt2.parse_args(["--core_path", bundle, "--vocab_size", "256"])
    assert core_eval.load_for_run(cfg.eval, cfg.model, notes.append) is None
    assert notes[-1] == "note: skipping CORE: a vocabulary of 256 cannot hold GPT-2's 50257 token ids"
    cfg = train_gpt2.parse_args(["--core_path", str(tmp_path / "absent"), "--core_interval", "0"])
    assert core_eval.load_for_run(cfg.eval, cfg.model, notes.append) is None and len(notes) == 2
    cfg = train_gpt2.parse_args(["--core_path", bundle, "--core_limit", "2"])
    assert [len(t.lines) for t in core_eval.load_for_run(cfg.eval, cfg.model, notes.append)] == [2, 2, 2]
