"""CORE's tasks as DCLM and nanochat lay them out, an eval bundle: core.yaml (the tasks: label,
dataset_uri, num_fewshot, icl_task_type, continuation_delimiter), eval_meta_data.csv (each task's
random baseline) and eval_data/ (the examples, jsonl). A bundle is a file from others: every file
is read with bounds and checked, every refusal one CoreError line naming the file, the line and the
fix; the download unpacks only what is inside the bundle. Beside it, OpenAI's GPT-2 scores on these
tasks, which core_eval.py and plot_log.py set a model's beside."""
import contextlib
import csv
import http.client
import io
import math
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass

import yaml

from gpt2repro import REPO
from gpt2repro.common.inputs import (UnreadableFile, brief, first_line, open_url, parse_json, parse_lines, read_text,
                                     structure_problem, unicode_problem)

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's scripts/base_eval.py
URL_ENV = "CORE_BUNDLE_URL"  # overrides BUNDLE_URL: a mirror, or a local server (the tests)
BUNDLE_DIR = os.path.join(REPO, "eval_bundle")  # beside hellaswag/
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")


# OpenAI's GPT-2 as nanochat measured it (dev/estimate_gpt3_core.ipynb): CORE at each size, and
# the 124M's accuracy on the tasks the notebook lists.
GPT2_CORE = {"gpt2": 0.1139, "gpt2-medium": 0.1849, "gpt2-large": 0.2146, "gpt2-xl": 0.2565}
GPT2_ACCURACY = {"hellaswag_zeroshot": 0.309, "lambada_openai": 0.323, "hellaswag": 0.308, "piqa": 0.623,
                 "arc_easy": 0.412, "arc_challenge": 0.222}

# Bounds on a bundle, a file from others. The real one's files are a few MB to tens of MB; its
# tasks take up to 10 examples as shots, and 4 choices.
MAX_BUNDLE_BYTES = 1 << 30  # the zip, and its unpacked files together
MAX_MEMBERS = 10_000
MAX_CONFIG_CHARS = 1 << 20  # core.yaml, eval_meta_data.csv
MAX_FEWSHOT = 100
MAX_CHOICES = 100
MAX_DELIMITER_CHARS = 1000


class CoreError(Exception):
    """A bundle that cannot be had or trusted, or a model that cannot score it: one line."""


@dataclass(frozen=True)
class Task:
    """One of core.yaml's icl_tasks, checked."""
    label: str
    path: str  # its examples, a jsonl file
    kind: str  # one of TASK_TYPES
    num_fewshot: int
    delimiter: str  # between a query (context) and its answer (continuation)
    baseline: float  # accuracy by chance, in percent (eval_meta_data.csv's "Random baseline")


# ----------------------------------------------------------------------------- the bundle

def read_bundle(directory, labels=None):
    """The Tasks of the bundle in directory (core.yaml, eval_meta_data.csv, eval_data/), those of
    labels only if given, in core.yaml's order. CoreError names the file, the line and the fix."""
    config = os.path.join(directory, "core.yaml")
    entries = read_task_list(config)
    names = [entry.get("label") if isinstance(entry, dict) else None for entry, _ in entries]
    unknown = [label for label in labels or () if label not in names]
    if unknown:
        raise CoreError(f"--tasks: {', '.join(map(brief, unknown))} not in {config} (its tasks: "
                        f"{', '.join(n for n in names if isinstance(n, str) and len(n) <= 100)})")
    baselines = read_baselines(os.path.join(directory, "eval_meta_data.csv"))
    tasks = []
    for (entry, lines), label in zip(entries, names):
        if labels and label not in labels:
            continue
        task = task_of(entry, lines, config, baselines)
        if task.label in [t.label for t in tasks]:
            raise CoreError(f"{config} line {lines['label']}: a second task labelled {task.label!r}: give each its "
                            f"own label")
        tasks.append(task)
    return tasks


def read_task_list(path):
    """[(entry, {key: its line, None: the entry's})] of core.yaml's icl_tasks. Plain YAML only: an alias (which YAML's merge
    keys expand, each level doubling) is refused, so what is built is no larger than the text."""
    try:
        text = read_text(path, MAX_CONFIG_CHARS)
        events = yaml.parse(text, Loader=yaml.SafeLoader)
        alias = next((event for event in events if isinstance(event, yaml.AliasEvent)), None)
        if alias is not None:
            raise CoreError(f"{path} line {alias.start_mark.line + 1}: a YAML alias (*name): core.yaml is plain data; "
                            f"write the value out")
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            config = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except FileNotFoundError:
        raise CoreError(f"{path}: no such file: not an eval bundle (`python core_eval.py --download_only` "
                        f"fetches nanochat's)") from None
    except UnreadableFile as e:  # it names the file
        raise CoreError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CoreError(f"{path}: cannot read it ({first_line(e)})") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise CoreError(f"{path}: not YAML ({first_line(e)})") from None
    problem = structure_problem(config, max_depth=8, max_values=1 << 16)
    if problem or not isinstance(config, dict) or not isinstance(config.get("icl_tasks"), list) \
            or not config["icl_tasks"]:
        raise CoreError(f"{path}: {problem or 'no icl_tasks list'}: not a CORE config")
    items = [value for key, value in node.value if key.value == "icl_tasks"][-1].value  # the last, as YAML takes it
    return [(entry, {None: item.start_mark.line + 1, **{key.value: key.start_mark.line + 1 for key, _ in
                                                         (item.value if isinstance(item, yaml.MappingNode) else ())}})
            for entry, item in zip(config["icl_tasks"], items)]


def task_of(entry, lines, config, baselines):
    """The Task of a core.yaml entry, its examples' file in eval_data/ beside config; lines: the
    line of each of its keys, and None's its own, which CoreError names."""
    def refuse(key, problem):
        raise CoreError(f"{config} line {lines.get(key, lines[None])}: {problem}")
    if not isinstance(entry, dict):
        refuse(None, "a task must be a mapping of label, dataset_uri, num_fewshot, icl_task_type")
    label, uri, kind = entry.get("label"), entry.get("dataset_uri"), entry.get("icl_task_type")
    shots, delimiter = entry.get("num_fewshot"), entry.get("continuation_delimiter", " ")
    if isinstance(shots, list) and shots:  # DCLM lists the shots to try; nanochat, and this, takes the first
        shots = shots[0]
    if not isinstance(label, str) or not label or len(label) > 100:
        refuse("label", f"label must be a name of 1 to 100 characters, not {brief(label)}")
    if not isinstance(uri, str) or not uri or uri.startswith(("/", "\\")) or "\0" in uri \
            or ".." in uri.replace("\\", "/").split("/"):
        refuse("dataset_uri", f"dataset_uri must be a path inside eval_data/, not {brief(uri)}")
    if kind not in TASK_TYPES:
        refuse("icl_task_type", f"unknown icl_task_type {brief(kind)} (core_eval.py scores {', '.join(TASK_TYPES)}): "
                                f"leave the task out with --tasks")
    if type(shots) is not int or not 0 <= shots <= MAX_FEWSHOT:
        refuse("num_fewshot", f"num_fewshot must be 0 to {MAX_FEWSHOT} (or a list, of which the first counts), "
                              f"not {brief(shots)}")
    if not isinstance(delimiter, str) or len(delimiter) > MAX_DELIMITER_CHARS or unicode_problem(delimiter):
        refuse("continuation_delimiter", f"continuation_delimiter must be text of at most {MAX_DELIMITER_CHARS} "
                                         f"characters, not {brief(delimiter)}")
    directory = os.path.dirname(config)
    if label not in baselines:
        refuse("label", f"task {label!r} has no row in {os.path.join(directory, 'eval_meta_data.csv')}: add its "
                        f"Random baseline (in percent) there, or leave the task out with --tasks")
    return Task(label, os.path.join(directory, "eval_data", uri), kind, shots, delimiter, baselines[label]())


def read_baselines(path):
    """{task: random baseline in percent} of eval_meta_data.csv (its "Eval Task" and "Random baseline"
    columns), each a function that checks it: only the tasks scored need sound rows. A later row of
    a task replaces an earlier one, as nanochat reads them."""
    columns = ("Eval Task", "Random baseline")
    try:
        rows = csv.DictReader(io.StringIO(read_text(path, MAX_CONFIG_CHARS), newline=""))
        if not set(columns) <= set(rows.fieldnames or ()):
            raise CoreError(f"{path}: no {' and '.join(map(repr, columns))} columns: not DCLM's eval_meta_data.csv")
        found = {row["Eval Task"]: (row["Random baseline"], rows.line_num) for row in rows}
    except FileNotFoundError:
        raise CoreError(f"{path}: no such file: an eval bundle holds one beside core.yaml") from None
    except UnreadableFile as e:  # it names the file
        raise CoreError(str(e)) from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CoreError(f"{path}: cannot read it ({first_line(e)})") from None

    def baseline(task):
        value, line = found[task]
        try:
            percent = float(value)
        except (TypeError, ValueError):  # None: a row short of the column
            percent = math.nan
        if not 0 <= percent < 100:
            raise CoreError(f"{path} line {line}: the Random baseline of {brief(task)} must be a percentage in "
                            f"[0, 100), not {brief(value)}: correct it")
        return percent
    return {task: (lambda task=task: baseline(task)) for task in found}


def read_examples(task):
    """[(line number, example)] of a task's jsonl file, every line checked; blank lines skipped."""
    try:
        return parse_lines(task.path, lambda line: parse_example(line, task.kind))
    except FileNotFoundError:
        raise CoreError(f"{task.path}: no such file, yet core.yaml's task {task.label!r} names it: the bundle is "
                        f"incomplete (fetch it anew with `python core_eval.py --download_only --data NEW_DIR`), or "
                        f"leave the task out with --tasks") from None
    except UnreadableFile as e:  # it names the file, and the line
        raise CoreError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CoreError(f"{task.path}: cannot read it ({first_line(e)})") from None


FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
          "language_modeling": ("context", "continuation")}


def parse_example(line, kind):
    """One line of a task of kind -> its example, the fields FIELDS names; ValueError says what is wrong."""
    try:
        example = parse_json(line)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({first_line(e)})") from None
    if not isinstance(example, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in FIELDS[kind] if key not in example]
    if missing:
        raise ValueError(f"missing field {missing[0]!r} (a {kind} example has {', '.join(FIELDS[kind])})")
    example = {key: example[key] for key in FIELDS[kind]}
    options = "choices" if kind == "multiple_choice" else "context_options"
    texts = [key for key in FIELDS[kind] if key not in (options, "gold")]
    for key in texts:
        if not isinstance(example[key], str):
            raise ValueError(f"{key} must be a string, not {brief(example[key])}")
    if kind != "multiple_choice" and not example["continuation"]:
        raise ValueError("continuation must not be empty: there would be nothing to score")
    if kind != "language_modeling":
        answers, gold = example[options], example["gold"]
        if not isinstance(answers, list) or not 1 <= len(answers) <= MAX_CHOICES \
                or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"{options} must be a list of 1 to {MAX_CHOICES} strings")
        if type(gold) is not int or not 0 <= gold < len(answers):  # type(): True is an int too
            raise ValueError(f"gold must be the index of one of the {len(answers)} {options}, not {brief(gold)}")
        texts += [f"{options}[{i}]" for i in range(len(answers))]
    for name in texts:
        key, _, i = name.partition("[")
        if problem := unicode_problem(example[key][int(i[:-1])] if i else example[key]):
            raise ValueError(f"{name} {problem}")
    return example


# ----------------------------------------------------------------------------- the download

def download_bundle(url, directory):
    """Fetches the zip at url and unpacks its eval_bundle/ into directory, through a directory
    beside it that takes the final name only once every task in it reads as CORE data: an
    interrupted or refused download leaves neither, nor the parent directory it made. The zip is
    untrusted: at most MAX_BUNDLE_BYTES, its members only inside the bundle, never a link."""
    print(f"downloading {url} to {directory}", file=sys.stderr)
    parent = os.path.dirname(os.path.abspath(directory))
    made = not os.path.isdir(parent)
    work = None  # a directory of the download's own beside the target: the rename stays on one disk
    try:
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".eval_bundle.", dir=parent)  # a name no one can plant in advance
        unpacked = os.path.join(work, "eval_bundle")
        with open_url(url) as response, open(os.path.join(work, "bundle.zip"), "xb") as f:
            copy_bounded(response, f, MAX_BUNDLE_BYTES, "the download")
        unpack(os.path.join(work, "bundle.zip"), unpacked)
        check_bundle(unpacked)
        os.rename(unpacked, directory)
    except CoreError as e:  # named as in the zip
        raise CoreError(f"{url}: not a usable eval bundle: {str(e).replace(unpacked, 'eval_bundle')}") from None
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts; a URL of no known scheme
        raise CoreError(f"could not download {url} ({getattr(e, 'reason', first_line(e))}); run this where there is "
                        f"a network, or unpack a copy of the bundle into {directory}") from None
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):  # only if empty
                os.rmdir(parent)
    return directory


def copy_bounded(source, target, limit, what):
    """Copies the file object source to target; CoreError past limit bytes (only limit + 1 are read)."""
    copied = 0
    while chunk := source.read(min(1 << 20, limit + 1 - copied)):
        copied += len(chunk)
        if copied > limit:
            raise CoreError(f"{what} is larger than {limit:,} bytes")
        target.write(chunk)
    return copied


def unpack(zip_path, directory):
    """The members under eval_bundle/ of the zip, written into directory (made here, so nothing in
    it is a link): every name checked, and the bytes actually unpacked bounded, whatever the zip's
    headers claim."""
    budget = MAX_BUNDLE_BYTES
    try:
        with zipfile.ZipFile(zip_path) as z:
            members = z.infolist()
            if len(members) > MAX_MEMBERS:
                raise CoreError(f"the zip holds {len(members):,} files, more than {MAX_MEMBERS:,}")
            os.mkdir(directory)
            for member in members:
                parts = member.filename.split("/")
                if member.filename.startswith("/") or "\\" in member.filename or any(p in ("..", ".") for p in parts) \
                        or ":" in parts[0]:
                    raise CoreError(f"the zip's member {brief(member.filename)} is a path outside the bundle")
                if parts[0] != "eval_bundle" or member.is_dir() or len(parts) < 2:
                    continue  # the bundle is eval_bundle/; anything beside it (__MACOSX/) is left out
                target = os.path.join(directory, *parts[1:])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.lexists(target):
                    raise CoreError(f"the zip holds {brief(member.filename)} twice")
                with z.open(member) as source, open(target, "xb") as f:
                    budget -= copy_bounded(source, f, budget, "the unpacked bundle")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, RuntimeError, NotImplementedError, EOFError, zlib.error) as e:
        raise CoreError(f"not a zip that can be read ({first_line(e)})") from None


def check_bundle(directory):
    """Every task of the bundle in directory read and checked, as scoring would: (tasks, examples)."""
    tasks = read_bundle(directory)
    return len(tasks), sum(len(read_examples(task)) for task in tasks)
