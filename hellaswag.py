"""HellaSwag, scored completion style: which of four endings does the model find likeliest?

    python hellaswag.py --download_only              # fetches the val split to hellaswag/, once
    python hellaswag.py -m gpt2                      # downloads it first if it is not there
    python hellaswag.py -m log/ckpt_019073.pt --json out.json
    python hellaswag.py -m gpt2 --data hellaswag_val.jsonl   # a local copy, no network

For each example the model reads context + ending, once per ending. The cross-entropy of
every ending token given all tokens before it is summed (acc picks the lowest sum) and
averaged over the ending's tokens (acc_norm picks the lowest mean). Rows are padded on
the right, where causal attention never looks, and pad positions are left out of the loss.

train_gpt2.py scores its periodic evals with load_for_run and accuracy_over_ranks.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import contextlib
import http.client
import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gpt2repro.common.atomic import atomic_open
from gpt2repro.common.cli import Parser
from gpt2repro.common.devices import autocast, pick_dtype
from gpt2repro.common.distributed import Stopped, every_rank, never_stop
from gpt2repro.common.inputs import UnreadableFile, brief, open_url, parse_lines, unicode_problem
from gpt2repro.common.progress import progress_meter
from gpt2repro.evals.continuations import logits_per_chunk
from gpt2repro.lm.tokenizer import get_encoding, gpt2_vocab_problem
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.loading import check_source, load_model_on

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/"
URL_ENV = "HELLASWAG_URL"  # overrides URL: a mirror, or a local folder as file:///... (the tests)
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag")
SPLIT_SIZES = {"train": 39905, "val": 10042}  # examples per file; a different count means a bad file
N_ENDINGS = 4
PAD_ID = 0  # any valid id: padding comes after every real token, so no real position attends to it


class HellaSwagError(Exception):
    """Data that cannot be had or cannot be trusted: unreadable, undownloadable, malformed."""


# -----------------------------------------------------------------------------
# data


def parse_example(line):
    """One jsonl line -> {"ctx", "endings", "label" (an int)}; ValueError says what is wrong."""
    try:
        example = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once a level: arrays nested thousands deep
        raise ValueError("JSON nested too deep to read (thousands of levels)") from None
    if not isinstance(example, dict):
        raise ValueError("not a JSON object")
    for key in ("ctx", "endings", "label"):
        if key not in example:
            raise ValueError(f"missing field {key!r}")
    ctx, endings, label = example["ctx"], example["endings"], example["label"]
    if not isinstance(ctx, str) or not ctx:
        raise ValueError("ctx must be a non-empty string")
    if not isinstance(endings, list) or len(endings) != N_ENDINGS or not all(isinstance(e, str) and e for e in endings):
        raise ValueError(f"endings must be a list of {N_ENDINGS} non-empty strings")
    for field, text in [("ctx", ctx), *((f"ending {i}", ending) for i, ending in enumerate(endings))]:
        if problem := unicode_problem(text):
            raise ValueError(f"{field} {problem}")
    # The original files hold ints; other copies (Hugging Face's) hold digit strings.
    if isinstance(label, str) and label in [str(i) for i in range(N_ENDINGS)]:
        label = int(label)
    if type(label) is not int or not 0 <= label < N_ENDINGS:  # type(): True is an int too
        raise ValueError(f"label must be 0 to {N_ENDINGS - 1} (an int or a digit string), "
                         f"not {brief(example['label'])}")
    return {"ctx": ctx, "endings": endings, "label": label}


def read_examples(path, expected=None):
    """Every example of a HellaSwag jsonl file, each line checked; expected: the count it must
    hold. A file that is not a regular file, or a line longer than inputs.MAX_LINE_CHARS, is refused."""
    try:
        examples = [example for _, example in parse_lines(path, parse_example)]
    except UnreadableFile as e:  # it names the file, and the line
        raise HellaSwagError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise HellaSwagError(f"{path}: cannot read it ({e})") from None
    if expected is not None and len(examples) != expected:
        raise HellaSwagError(f"{path}: {len(examples)} examples, expected {expected}")
    return examples


def download(url, path, local_flag="--data"):
    """Fetches url to path through a temporary name (one per process: DDP ranks may download
    at once), renamed once complete: an interrupted download never takes the final name, and a
    failed one leaves no file, nor the directory it made. local_flag: the caller's flag for a
    local copy, named in the error; None under --download_only, whose error says where a copy goes."""
    print(f"downloading {url} to {path}")
    directory = os.path.dirname(path)
    made = not os.path.isdir(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        with open_url(url) as response, atomic_open(path) as f:
            shutil.copyfileobj(response, f)
    # URLError and timeouts are OSErrors; ValueError: a URL of no known scheme
    except (OSError, ValueError, http.client.HTTPException) as e:
        if made:
            with contextlib.suppress(OSError):  # only if empty: a rank beside this one may have put the file there
                os.rmdir(directory)
        if local_flag is None:
            advice = f"run this where there is a network, or copy {os.path.basename(path)} into {directory}"
        else:
            advice = (f"fetch it once where there is a network with `python hellaswag.py --download_only`, "
                      f"or pass {local_flag} PATH, a local copy")
        raise HellaSwagError(f"could not download {url} ({getattr(e, 'reason', e)}); {advice}") from None


def load_examples(path=None, split="val", cache_dir=None, local_flag="--data"):
    """The examples of a local jsonl file (path), or of a split of the original files,
    downloaded once to cached_path(split, cache_dir). A cached file that fails its checks is
    reported and downloaded again, never scored. local_flag: see download."""
    if path is not None:
        return read_examples(path)
    if split not in SPLIT_SIZES:
        hint = "the test split's labels are not public; " if split == "test" else ""
        raise HellaSwagError(f"cannot score split {split!r}: {hint}choose one of {', '.join(SPLIT_SIZES)}")
    path = cached_path(split, cache_dir)
    if os.path.exists(path):
        try:
            return read_examples(path, SPLIT_SIZES[split])
        except HellaSwagError as e:
            print(f"warning: {e}: downloading it again", file=sys.stderr)
    download(os.environ.get(URL_ENV, URL).rstrip("/") + f"/{os.path.basename(path)}", path, local_flag)
    return read_examples(path, SPLIT_SIZES[split])


def cached_path(split, cache_dir=None):
    """Where a split's download is kept: cache_dir, by default hellaswag/ beside this script."""
    return os.path.join(cache_dir or CACHE_DIR, f"hellaswag_{split}.jsonl")


# -----------------------------------------------------------------------------
# scoring


def example_rows(example, block_size):
    """One row per ending: (tokens, start), tokens being context + ending and start the index
    of the first ending token. The model reads every token but the last, so a row holds up to
    block_size + 1 tokens; a longer one keeps its ending and drops context from the left."""
    enc = get_encoding()
    ctx = enc.encode_ordinary(example["ctx"])
    rows = []
    for ending in example["endings"]:
        end = enc.encode_ordinary(" " + ending)  # the space that joins it to the context
        keep = block_size + 1 - len(end)
        if keep < 1:  # the first ending token needs at least one token to be predicted from
            raise ValueError(f"an ending of {len(end)} tokens does not fit block_size {block_size}")
        row_ctx = ctx[-keep:]
        rows.append((row_ctx + end, len(row_ctx)))
    return rows


def check_model(config, examples):
    """Raises HellaSwagError unless a model of this config can score every example: its
    vocabulary must hold GPT-2's token ids, and its block_size each ending (see example_rows)."""
    if gpt2_vocab_problem(config.vocab_size):
        raise HellaSwagError(gpt2_vocab_problem(config.vocab_size))
    try:
        for example in examples:
            example_rows(example, config.block_size)
    except ValueError as e:
        raise HellaSwagError(str(e)) from None


def make_batch(rows, device):
    """Inputs and targets, (rows, T) each, padded on the right; a target of -1 is not an ending token."""
    T = max(len(tokens) for tokens, _ in rows) - 1
    inputs = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    targets = torch.full((len(rows), T), -1, dtype=torch.long)
    for r, (tokens, start) in enumerate(rows):
        inputs[r, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[r, start - 1 : len(tokens) - 1] = torch.tensor(tokens[start:])
    return inputs.to(device), targets.to(device)


@torch.no_grad()
def ending_losses(model, rows, device, dtype=torch.float32):
    """The summed and the mean cross-entropy of each row's ending tokens: two float32 (rows,) tensors."""
    inputs, targets = make_batch(rows, device)
    scored = targets != -1
    with autocast(torch.device(device).type, dtype):
        # Logits only where an ending token is predicted: the head over the whole vocabulary is
        # most of a small model's work, and the context positions' logits are never used.
        hidden = model.hidden_states(inputs)[scored].float()
    # The head in float32, outside autocast: GPT-2's logits lie around -60, where bfloat16's
    # steps are 0.25 apart, coarser than the loss differences between endings it must rank.
    # A chunk of positions at a time: a batch's logits (1.7 GB in float32 for 64 examples)
    # never exist at once, so the batch size is bounded by the model, not by the head.
    chunk = max(1, logits_per_chunk(hidden.device) // model.config.vocab_size)
    losses = [F.cross_entropy(model.head(h), t, reduction="none")
              for h, t in zip(hidden.split(chunk), targets[scored].split(chunk))]
    token_losses = torch.zeros(targets.shape, device=hidden.device)
    token_losses[scored] = torch.cat(losses)
    total = token_losses.sum(dim=1)
    return total, total / scored.sum(dim=1)


def score_batches(model, examples, device, batch_size=16, dtype=torch.float32, stop_requested=never_stop):
    """Yields (keys, sum_loss, mean_loss) per forward pass of batch_size * 4 rows: keys the
    (example index, ending index) of each row, the losses float32 CPU tensors (len(keys),).
    Rows go longest first, whichever example they come from: a batch of near-equal lengths
    wastes almost nothing on padding (an example's own four endings differ more), and the
    largest batch, the likeliest to run out of memory, runs at once rather than at the end.
    Stopped where stop_requested() is true before a forward pass."""
    rows = [((i, j), row) for i, example in enumerate(examples)
            for j, row in enumerate(example_rows(example, model.config.block_size))]
    rows.sort(key=lambda keyed_row: -len(keyed_row[1][0]))
    for b in range(0, len(rows), batch_size * N_ENDINGS):
        if stop_requested():
            raise Stopped
        batch = rows[b : b + batch_size * N_ENDINGS]
        total, mean = ending_losses(model, [row for _, row in batch], device, dtype)
        yield [key for key, _ in batch], total.cpu(), mean.cpu()


@dataclass(frozen=True)
class ScoringConfig:
    """How count_correct runs, alike on every rank (which examples a rank scores is
    count_correct's rank, world_size and equal_shares)."""
    device: str  # the device the caller put the model on: "cpu", "cuda:0", ...
    batch_size: int = 16  # examples (of 4 rows each) per forward pass
    dtype: torch.dtype = torch.float32  # autocast's
    progress: bool = False  # a progress meter on stderr


def count_correct(model, examples, config, rank=0, world_size=1, equal_shares=False, stop_requested=never_stop):
    """Scores this rank's share, examples[rank::world_size], as config says, and returns its LOCAL
    counts {"n", "correct", "correct_norm"} for the caller to sum over ranks. The model is used as
    given: the caller puts it on config.device and in eval mode. equal_shares: every rank runs as
    many forward passes (under FSDP each one gathers weights from all ranks; every rank asks
    stop_requested before each), a short share being padded with repeats of an example that are
    scored but not counted. Stopped where stop_requested() is true before a forward pass."""
    share = examples[rank::world_size]
    n = len(share)
    if equal_shares:
        share = share + (share or examples)[:1] * (-(-len(examples) // world_size) - n)
    labels = torch.tensor([e["label"] for e in share])
    sum_loss, mean_loss = torch.zeros(len(share), N_ENDINGS), torch.zeros(len(share), N_ENDINGS)
    rows_left = [N_ENDINGS] * len(share)
    done = correct = correct_norm = 0
    batches = score_batches(model, share, config.device, config.batch_size, config.dtype, stop_requested)
    with contextlib.closing(progress_meter("hellaswag", "ex", total=n, disable=not config.progress)) as bar:
        for keys, total, mean in batches:
            i, j = torch.tensor(keys).T
            sum_loss[i, j], mean_loss[i, j] = total, mean
            finished = []  # counted examples whose last row was in this batch
            for example, _ in keys:
                rows_left[example] -= 1
                if rows_left[example] == 0 and example < n:
                    finished.append(example)
            correct += (sum_loss[finished].argmin(dim=1) == labels[finished]).sum().item()
            correct_norm += (mean_loss[finished].argmin(dim=1) == labels[finished]).sum().item()
            done += len(finished)
            bar.set_postfix(acc_norm=f"{correct_norm / max(done, 1):.4f}", refresh=False)
            bar.update(len(finished))
    return {"n": n, "correct": correct, "correct_norm": correct_norm}


def load_for_run(eval_config, local_rank, gpt_config, log):
    """The examples a training run of eval_config (train_config.EvalConfig) scores at each eval, or
    None with a one-line note to log (offline, or a damaged file: training goes on without them).
    Each eval is a collective, so unless every rank loaded the same number of examples, no rank
    scores any; nor where a GPT of gpt_config cannot hold them."""
    if not eval_config.hellaswag or not eval_config.eval_interval:
        return None
    # One download per machine, not one per GPU: local rank 0 reads first, fetching the file
    # if it is not cached; the other ranks wait at the barrier, then read its copy.
    if dist.is_initialized() and local_rank != 0:
        dist.barrier()
    examples, path = None, eval_config.hellaswag_path
    if path is not None and not os.path.exists(path):
        log(f"note: no HellaSwag file at {path}: skipping HellaSwag "
            f"(`python hellaswag.py --download_only` fetches it to {cached_path('val')})")
    else:
        try:
            examples = load_examples(path, local_flag="--hellaswag_path")[: eval_config.hellaswag_limit or None]
        except HellaSwagError as e:
            log(f"note: skipping HellaSwag: {e}")
    if dist.is_initialized() and local_rank == 0:
        dist.barrier()
    counts = every_rank(len(examples) if examples else 0)
    if len(set(counts)) > 1:
        log(f"note: skipping HellaSwag: not every rank could load it (examples per rank: {counts})")
        return None
    if examples:
        try:
            check_model(gpt_config, examples)
        except HellaSwagError as e:  # the same examples on every rank: all skip alike
            log(f"note: skipping HellaSwag: {e}")
            return None
    return examples


@torch.no_grad()
def accuracy_over_ranks(model, examples, config, rank=0, world_size=1, stop_requested=never_stop):
    """(acc, acc_norm, n) of model, a GPT in evaluation mode, FSDP-sharded or not, with the examples
    split across ranks as config says and the counts summed. Every rank runs as many forward
    passes, asking stop_requested before each (Stopped on every rank alike)."""
    counts = count_correct(model, examples, config, rank, world_size, equal_shares=world_size > 1,
                           stop_requested=stop_requested)
    total = torch.tensor([counts["n"], counts["correct"], counts["correct_norm"]], device=config.device,
                         dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(total)
    n, correct, correct_norm = total.tolist()
    return correct / n, correct_norm / n, n


# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    parser = Parser(prog="hellaswag.py", description="Score a GPT-2 model on HellaSwag (completion style).")
    parser.add_argument("-m", "--model", default="gpt2",
                        help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 directory, a train_gpt2.py "
                             "checkpoint (.pt), or a run's log directory (its newest checkpoint)")
    parser.add_argument("--split", default="val", help="val or train (the test split has no public labels)")
    parser.add_argument("--data", default=None, help="a local HellaSwag jsonl file to score instead of a download")
    parser.add_argument("--cache_dir", default=CACHE_DIR, help="where downloads are kept")
    parser.add_argument("--batch_size", type=int, default=16, help="examples (of 4 rows each) per forward pass")
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto: bfloat16 on CUDA (float16 before Ampere), else float32")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--download_only", action="store_true",
                        help="fetch --split into --cache_dir and check it, then exit: no model is loaded, and "
                             "every later run reads that copy offline")
    args = parser.parse_args(argv)
    if args.download_only and args.data:
        parser.error("--download_only fetches --split; --data is a local copy already")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--batch_size and --limit must be at least 1")
    if args.json:
        parser.check_output("--json", args.json)  # now, not after the scoring

    try:
        if not args.download_only:
            check_source(args.model)  # a mistyped -m is the error, not the download that would come first
        examples = load_examples(args.data, args.split, args.cache_dir, None if args.download_only else "--data")
    except (CheckpointError, HellaSwagError) as e:
        parser.fail(str(e))
    if args.download_only:
        print(f"{cached_path(args.split, args.cache_dir)}: {len(examples):,} examples, checked")
        return
    examples = examples[: args.limit]
    try:
        model, device = load_model_on(args.model, args.device)
    except CheckpointError as e:
        parser.fail(str(e))
    try:
        check_model(model.config, examples)
    except HellaSwagError as e:
        parser.fail(f"{args.model}: {e}")

    dtype = pick_dtype(args.dtype, torch.device(device).type)
    result = count_correct(model, examples, ScoringConfig(device, args.batch_size, dtype, progress=True))
    result["acc"] = result["correct"] / result["n"]
    result["acc_norm"] = result["correct_norm"] / result["n"]
    print(f"{args.model} on {args.data or 'hellaswag ' + args.split}: {result['n']} examples, "
          f"acc {result['acc']:.4f} ({result['correct']}/{result['n']}), "
          f"acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{result['n']})")
    if args.json:
        parser.write_json(args.json, result)


if __name__ == "__main__":
    main()
