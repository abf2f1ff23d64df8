"""Text corpus -> GPT-2 token shards for pretraining, in the format of build-nanogpt's fineweb.py.

    python fineweb.py                    # FineWeb-Edu sample-10BT -> edu_fineweb10B/, 100M tokens a shard
    python fineweb.py --version 100B     # sample-100BT -> edu_fineweb100B/
    python fineweb.py --input data/tinyshakespeare.txt --output_dir data/shakespeare \\
        --prefix shakespeare --shard_size 32768

Every document becomes <|endoftext|> followed by encode_ordinary(text). The documents, in
input order, form one token stream, cut into shards of exactly shard_size tokens (the last
holds the rest, and a document may span shards). Shard 0 is val, the others train; data.py
owns the file format. A manifest next to the shards records which corpus they hold and how
far the run got, so a rerun resumes an interrupted run and refuses to mix two corpora.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import argparse
import collections
import contextlib
import ctypes
import glob
import hashlib
import itertools
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow
import pyarrow.parquet as pq

from gpt2repro.common.atomic import CannotClaim, atomic_open, claim_directory, remove_if_unused
from gpt2repro.common.cli import Parser, preset_path, read_config
from gpt2repro.common.inputs import UnreadableFile, parse_json, read_text
from gpt2repro.common.progress import progress_meter
from gpt2repro.lm.data import (SHARD_DTYPE, SPLITS, TINY_SHAKESPEARE, Shard, list_shards, shard_name, split_of,
                               write_shard)
from gpt2repro.lm.tokenizer import BPE_SHA256, EOT, get_encoding

FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
VERSIONS = {"10B": "sample-10BT", "100B": "sample-100BT"}
SAMPLE_TOKENS = {VERSIONS["10B"]: 10**10, VERSIONS["100B"]: 10**11}  # named for their size in GPT-2 tokens, roughly
EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
MANIFEST = "fineweb_manifest.json"
MAX_MANIFEST_CHARS = 1 << 26  # a manifest lists its inputs: ~150 characters each, hundreds of thousands of them
FRESH = {"shards": 0, "document": 0, "skip": 0, "complete": False}  # a manifest's progress before the first shard
CHUNK_CHARS = 1 << 20  # text per worker task: ~250K tokens, ~0.1 s of encoding, so sending it costs little
MAX_ID = int(np.iinfo(SHARD_DTYPE).max)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what SLURM and Kubernetes send to preempt a job


class InputError(ValueError):
    """A bad input, argument or output directory; the CLI prints it as one line and exits 1."""


class TokenIdTooLarge(Exception):
    """Raised in a worker: args are (index of the document in its chunk, the token id)."""


@dataclass(frozen=True)
class ShardingJob:
    """Where the shards go and how they are cut, whatever the corpus: shard_size tokens a shard,
    named {prefix}_{split}_{index:06d}.npy in output_dir, tokenized by num_proc processes, with a
    progress bar (or a line a minute where no terminal shows one) if progress."""
    output_dir: str
    prefix: str
    shard_size: int
    num_proc: int = 1
    progress: bool = False

    def shard_path(self, index):
        """The path of shard number index."""
        return os.path.join(self.output_dir, shard_name(self.prefix, split_of(index), index))


@dataclass(frozen=True)
class HubDataset:
    """A split of a Hugging Face dataset (a hub name, or a local folder load_dataset reads), with its
    text in the text_field column; streaming reads it while sharding rather than downloading it first."""
    dataset: str = FINEWEB_EDU
    name: str | None = VERSIONS["10B"]  # the dataset's config
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False


@dataclass(frozen=True)
class Corpus:
    """What shard_corpus reads: identity tells the corpus apart from others in the manifest's run,
    name is the corpus in messages, documents(skip) yields its (text, origin) pairs from document
    number skip on."""
    identity: dict
    name: str
    documents: Callable

# -----------------------------------------------------------------------------
# tokenizing: chunks of documents to worker processes, results back in input order


def encode_texts(texts):
    """[EOT] + encode_ordinary(text) for each text, concatenated into one uint16 array.
    Runs in the workers; each builds its own encoding (get_encoding is cached per process)."""
    enc = get_encoding()
    docs = [enc.encode_ordinary(text) for text in texts]
    tokens = np.empty(len(docs) + sum(map(len, docs)), dtype=np.uint32)
    pos = 0
    for doc in docs:
        tokens[pos] = EOT
        tokens[pos + 1:pos + 1 + len(doc)] = doc
        pos += 1 + len(doc)
    if tokens.size and tokens.max() > MAX_ID:  # casting would wrap it around silently
        bad = next(i for i, doc in enumerate(docs) if doc and max(doc) > MAX_ID)
        raise TokenIdTooLarge(bad, max(docs[bad]))
    return tokens.astype(SHARD_DTYPE)


def chunk_documents(documents, chunk_chars):
    """Groups (text, origin) pairs into (texts, origins) lists of about chunk_chars characters."""
    texts, origins, size = [], [], 0
    for text, origin in documents:
        texts.append(text)
        origins.append(origin)
        size += len(text)
        if size >= chunk_chars:
            yield texts, origins
            texts, origins, size = [], [], 0
    if texts:
        yield texts, origins


def init_worker():
    """Worker initializer: Ctrl-C and SIGTERM, which a terminal or a scheduler sends to every
    process, are the main process's to handle (it keeps the finished shards and shuts the pool
    down). Should the main process be killed outright (SIGKILL, the OOM killer), Linux kills the
    workers too, rather than leave them orphaned."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform == "linux":
        parent, PR_SET_PDEATHSIG = os.getppid(), 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)


@contextlib.contextmanager
def naming_the_document(origins):
    """Turns a worker's TokenIdTooLarge into an InputError naming the document's file and line."""
    try:
        yield
    except TokenIdTooLarge as e:
        doc, token_id = e.args
        raise InputError(f"{origins[doc] or f'document {doc}'}: token id {token_id} does not fit "
                         f"in a uint16 shard (max {MAX_ID})") from None


def tokenize_chunks(chunks, num_proc):
    """Yields (origins, tokens) for each (texts, origins) chunk, in input order.

    With num_proc > 1, num_proc worker processes encode the chunks. At most two chunks a
    worker are in flight, so reading never runs far ahead of tokenizing (Pool.imap would
    queue the whole corpus in memory)."""
    if num_proc == 1:  # no pool: nothing to send between processes
        for texts, origins in chunks:
            with naming_the_document(origins):
                tokens = encode_texts(texts)
            yield origins, tokens
        return
    pool = ProcessPoolExecutor(num_proc, initializer=init_worker)
    try:
        pending = collections.deque()
        for texts, origins in chunks:
            pending.append((origins, pool.submit(encode_texts, texts)))
            if len(pending) == 2 * num_proc:
                yield collect(*pending.popleft())
        while pending:
            yield collect(*pending.popleft())
    finally:
        pool.shutdown(cancel_futures=True)


def collect(origins, future):
    with naming_the_document(origins):
        return origins, future.result()


def tokenize_documents(texts, num_proc=1, chunk_chars=CHUNK_CHARS):
    """Yields the tokens of texts (an iterable of strings) in order, one uint16 array per chunk
    of documents; concatenated they are [EOT] + doc 1 + [EOT] + doc 2 ... (for benchmarks)."""
    for _, tokens in tokenize_chunks(chunk_documents(((text, None) for text in texts), chunk_chars), num_proc):
        yield tokens

# -----------------------------------------------------------------------------
# reading documents: (text, origin) pairs, origin naming the file and line for error messages


def expand_inputs(paths):
    """The input files, in order: a directory stands for its supported files, sorted by name."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            try:
                names = os.listdir(path)
            except OSError as e:
                raise InputError(f"{path}: cannot list ({e.strerror or e})") from None
            found = sorted(os.path.join(path, name) for name in names  # the manifest: our output, when sharding into it
                           if name.lower().endswith(EXTENSIONS) and name != MANIFEST and os.path.isfile(os.path.join(path, name)))
            if not found:
                raise InputError(f"{path}: directory holds no {'/'.join(EXTENSIONS)} files")
            files += found
        elif not os.path.exists(path):
            raise InputError(f"{path}: no such file or directory")
        elif not path.lower().endswith(EXTENSIONS):
            raise InputError(f"{path}: unsupported file type (expected {', '.join(EXTENSIONS)})")
        else:
            files.append(path)
    return files


def check_readable(path, text_field):
    """Fails early, before any output is written, on a file that cannot be opened."""
    if not os.path.isfile(path):  # a FIFO, a device: reading it could wait forever
        raise InputError(f"{path}: not a regular file")
    try:
        with open(path, "rb"):
            pass
        if path.lower().endswith(".parquet"):
            open_parquet(path, text_field)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


def file_sha256(path):
    """The SHA-256 of path's bytes: what tells an input apart from itself edited (an edit may keep
    its size), so that a rerun resumes only from the bytes its shards were cut from."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


def open_parquet(path, text_field):
    try:
        parquet = pq.ParquetFile(path)
    except pyarrow.ArrowException as e:
        raise InputError(f"{path}: not a readable parquet file ({e})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise InputError(f"{path}: no {text_field!r} column (columns: {', '.join(schema.names)})")
    column_type = schema.field(text_field).type
    if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)):
        raise InputError(f"{path}: column {text_field!r} holds {column_type}, not strings")
    return parquet


def read_txt(path, text_field):
    """The whole file is one document, as is."""
    try:
        with open(path, encoding="utf-8", newline="") as f:  # \r\n and \r stay: the tokens are the file's text
            text = f.read()
    except (OSError, UnicodeError) as e:
        raise InputError(f"{path}: cannot read as UTF-8 text ({e})") from None
    yield text, path


def read_jsonl(path, text_field):
    """One document per line: the line's JSON object's text_field. Blank lines are skipped."""
    try:
        with open(path, "rb") as f:  # decoded a line at a time, so that bad UTF-8 is named by its own line
            for number, raw in enumerate(f, 1):
                where = f"{path} line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeError as e:
                    raise InputError(f"{where}: not UTF-8 text ({e})") from None
                if line.strip():
                    yield json_text(line, text_field, where), where
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


def json_text(line, text_field, where):
    try:
        record = parse_json(line)
    except ValueError as e:
        raise InputError(f"{where}: not JSON ({e}); .jsonl/.json inputs hold one JSON object a line") from None
    if not isinstance(record, dict) or text_field not in record:
        raise InputError(f"{where}: no {text_field!r} field")
    if not isinstance(record[text_field], str):
        raise InputError(f"{where}: {text_field!r} is {type(record[text_field]).__name__}, not a string")
    return record[text_field]


def read_parquet(path, text_field):
    """One document per row of the text_field column, read a batch of rows at a time, so memory
    holds a batch whatever the file's size."""
    row = 0
    try:
        for batch in open_parquet(path, text_field).iter_batches(batch_size=1024, columns=[text_field]):
            for value in batch.column(0):
                text = value.as_py()  # a row at a time, so invalid UTF-8 is named by its own row
                if text is None:
                    raise InputError(f"{path} row {row}: {text_field!r} is null")
                yield text, f"{path} row {row}"
                row += 1
    except (OSError, UnicodeError, pyarrow.ArrowException) as e:
        raise InputError(f"{path} row {row}: cannot read ({e})") from None


READERS = {".txt": read_txt, ".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}


def local_documents(files, text_field, skip):
    """The documents of files, in order, from document number skip on."""
    documents = (doc for path in files for doc in READERS[os.path.splitext(path)[1].lower()](path, text_field))
    return itertools.islice(documents, skip, None)


def hub_documents(hub, skip):
    """The documents of a HubDataset, from row skip on."""
    import datasets  # only here: a slow import that local inputs do not need

    dataset, text_field = hub.dataset, hub.text_field
    try:
        ds = datasets.load_dataset(dataset, name=hub.name, split=hub.split, streaming=hub.streaming)
    except Exception as e:  # the hub and the builders raise many types; each is one bad input here
        raise InputError(f"{dataset}: cannot load config {hub.name} split {hub.split} ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    if ds.column_names is not None and text_field not in ds.column_names:
        raise InputError(f"{dataset}: no {text_field!r} column (columns: {', '.join(ds.column_names)})")
    ds = ds.select_columns([text_field]).skip(skip)  # only the text: the other columns cost reading time
    row = skip
    for batch in ds.iter(batch_size=1024):
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise InputError(f"{dataset} row {row}: {text_field!r} is {type(text).__name__}, not a string")
            yield text, f"{dataset} row {row}"
            row += 1

# -----------------------------------------------------------------------------
# the output directory: a manifest says which corpus its shards hold and how far the run got


def read_manifest(output_dir):
    """The manifest in output_dir, or None; read as any user's file is: a regular file, bounded."""
    path = os.path.join(output_dir, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        manifest = parse_json(read_text(path, MAX_MANIFEST_CHARS))
        check_manifest(manifest)
    except UnreadableFile as e:
        raise unreadable_manifest(output_dir, str(e).removeprefix(f"{path}: ")) from None
    except (OSError, ValueError) as e:
        raise unreadable_manifest(output_dir, e) from None
    return manifest


def unreadable_manifest(output_dir, problem):
    return InputError(f"{os.path.join(output_dir, MANIFEST)}: unreadable manifest ({problem}); delete {output_dir} and rerun")


def check_manifest(manifest):
    """Raises ValueError unless manifest has the fields write_shards writes: valid JSON edited by
    hand or by another tool would otherwise crash a rerun, or pass for no manifest at all."""
    keys = ["run", *FRESH]
    if isinstance(manifest, dict) and manifest.get("complete"):
        keys += ["documents", "tokens"]
    if not (isinstance(manifest, dict) and all(key in manifest for key in keys) and isinstance(manifest["run"], dict)):
        raise ValueError(f"not a JSON object with {', '.join(keys)}")
    counts = [key for key in keys if key not in ("run", "complete")]
    bad = next((key for key in counts if type(manifest[key]) is not int or manifest[key] < 0), None)
    if bad or not isinstance(manifest["complete"], bool):
        raise ValueError(f"impossible progress: {bad or 'complete'} is {json.dumps(manifest[bad or 'complete'])}")
    if manifest["complete"] and not (manifest["shards"] >= 1 and manifest["documents"] == manifest["document"]):
        raise ValueError("impossible progress: complete, but with no shard or a document count that disagrees")


def check_progress(manifest, shard_size):
    """Raises ValueError unless the manifest's counts fit in its shards of shard_size tokens: each
    document is at least its <|endoftext|>, so the documents before the resume point and the skip
    tokens after it cannot outnumber the tokens written. Costs no reading of the corpus."""
    written = manifest["shards"] * shard_size
    if manifest["complete"]:
        if not written - shard_size < manifest["tokens"] <= written:
            raise ValueError(f"impossible progress: tokens is {manifest['tokens']:,}, but {manifest['shards']} "
                             f"shard(s) of {shard_size:,} hold {written - shard_size + 1:,} to {written:,}")
        written = manifest["tokens"]
    if manifest["document"] + manifest["skip"] > written:
        raise ValueError(f"impossible progress: document is {manifest['document']:,} and skip {manifest['skip']:,}, "
                         f"but its shards hold {written:,} tokens and a document is at least one")


def write_manifest(output_dir, manifest):
    """Atomically, like the shards: a crash leaves the old manifest or the new one."""
    with atomic_open(os.path.join(output_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def shard_files(output_dir, prefix):
    """{index: path} of this prefix's shards in output_dir, and the paths of any other shards."""
    ours, others = {}, []
    for split in SPLITS:
        for path in list_shards(output_dir, split):
            match = re.fullmatch(rf"{re.escape(prefix)}_{split}_(\d{{6}})\.npy", os.path.basename(path))
            index = int(match.group(1)) if match else -1
            if index >= 0 and split_of(index) == split:
                ours[index] = path
            else:
                others.append(path)
    return ours, others


def remove_leftovers(output_dir, prefix, from_index):
    """Deletes this prefix's shards from from_index on, and temporary files of killed runs."""
    ours, _ = shard_files(output_dir, prefix)
    stale = [path for index, path in ours.items() if index >= from_index]
    stale += glob.glob(os.path.join(glob.escape(output_dir), glob.escape(prefix) + "_*.npy.tmp*"))
    stale += glob.glob(os.path.join(glob.escape(output_dir), MANIFEST + ".tmp*"))
    for path in stale:
        os.remove(path)


def start_or_resume(output_dir, prefix, run):
    """The manifest to continue from: a fresh one, this run's own if it was interrupted or is
    complete; refuses a directory that holds shards of anything else."""
    manifest = read_manifest(output_dir)
    ours, others = shard_files(output_dir, prefix)
    if manifest is None and (ours or others):
        found = os.path.basename((others or list(ours.values()))[0])
        raise InputError(f"{output_dir} holds shards ({found}, ...) but no {MANIFEST}: not written by "
                         f"this tool or from an older run; delete them or choose another --output_dir")
    if manifest is None:
        return {"run": run} | FRESH
    if manifest["run"] != as_recorded(run, manifest["run"]):
        old = manifest["run"]
        changed = changed_input(old, run)
        if changed:
            raise InputError(f"{changed}: changed since the shards in {output_dir} were cut from it (another SHA-256): "
                             f"they would mix two corpora; restore it, or delete {output_dir} and rerun")
        key = next(k for k in sorted(set(run) | set(old)) if run.get(k) != old.get(k))
        there, now = (repr(value)[:200] for value in (old.get(key), run.get(key)))
        raise InputError(f"{output_dir} holds shards of another run ({key}: {there} there, {now} now); "
                         f"delete it or choose another --output_dir")
    try:  # the run is this one: its shard_size is ours
        check_progress(manifest, run["shard_size"])
    except ValueError as e:
        raise unreadable_manifest(output_dir, e) from None
    if others:
        raise InputError(f"{output_dir} holds shards of another prefix ({os.path.basename(others[0])}); "
                         f"training would read them too: move them or choose another --output_dir")
    # Of more shards than there are files, one of the first len(ours) + 1 is missing: a count of
    # 10**12 is never walked.
    missing = next((i for i in range(min(manifest["shards"], len(ours) + 1)) if i not in ours), None)
    if missing is not None:
        raise InputError(f"{output_dir}: its {MANIFEST} records {manifest['shards']:,} shards, but "
                         f"{shard_name(prefix, split_of(missing), missing)} is missing; delete it and rerun")
    # An incomplete run's next shard may be there: a kill came between it and the manifest.
    last = manifest["shards"] - 1 if manifest["complete"] else manifest["shards"]
    unlisted = sorted(index for index in ours if index > last)
    if unlisted:
        raise InputError(f"{output_dir} holds {os.path.basename(ours[unlisted[0]])}, which its {MANIFEST} does not "
                         f"list; training would read it too: move it, or delete {output_dir} and rerun")
    try:
        check_written(manifest, run["shard_size"], [ours[index] for index in range(manifest["shards"])])
    except ValueError as e:  # ShardError too
        raise unreadable_manifest(output_dir, e) from None
    return manifest


def as_recorded(run, recorded):
    """run as the run recorded in a manifest names it: a manifest of a fineweb.py from before the
    inputs' SHA-256 names them by path and size alone, and is resumed as then."""
    inputs = recorded.get("inputs")
    if "inputs" not in run or not (isinstance(inputs, list) and inputs) \
            or any(not isinstance(entry, dict) or "sha256" in entry for entry in inputs):
        return run
    return run | {"inputs": [{k: v for k, v in entry.items() if k != "sha256"} for entry in run["inputs"]]}


def changed_input(recorded, run):
    """The path of an input that the recorded run (a manifest's) names by the path and size that
    run does, but by another SHA-256: a file edited in place. None if there is none."""
    inputs = recorded.get("inputs")
    for then, now in zip(inputs if isinstance(inputs, list) else [], run.get("inputs", [])):
        same_file = isinstance(then, dict) and then.get("path") == now["path"] and then.get("bytes") == now["bytes"]
        if same_file and then.get("sha256", now["sha256"]) != now["sha256"]:
            return now["path"]
    return None


def check_written(manifest, shard_size, paths):
    """Raises ValueError unless the shards at paths (the manifest's, in order) hold what it says:
    shard_size tokens each (the last of a complete run, the rest of its tokens), and `document`
    documents, one <|endoftext|> each, before its resume point, where the next document starts.
    Reads every shard written: a resume from counters that lie would write a corpus that is not."""
    sizes = [shard_size] * len(paths)
    if manifest["complete"]:
        sizes[-1] = manifest["tokens"] - (len(paths) - 1) * shard_size
    shards = [Shard(path) for path in paths]
    for shard, size in zip(shards, sizes):
        if shard.n_tokens != size:
            raise ValueError(f"{os.path.basename(shard.path)} holds {shard.n_tokens:,} tokens, not {size:,}")
    resume_at = sum(sizes) - manifest["skip"]  # in the stream of every shard, end to end
    documents, position, chunk = 0, 0, 1 << 24
    for shard in shards:
        before = min(shard.n_tokens, resume_at - position)  # this shard's tokens before the resume point
        for start in range(0, before, chunk):
            documents += int(np.count_nonzero(shard.read(start, min(chunk, before - start)) == EOT))
        if position <= resume_at < position + shard.n_tokens and shard.read(resume_at - position, 1)[0] != EOT:
            raise ValueError(f"its resume point, {manifest['skip']:,} tokens before the end of its shards, is not "
                             f"where a document starts")
        position += shard.n_tokens
    if documents != manifest["document"]:
        raise ValueError(f"document is {manifest['document']:,}, but its shards hold {documents:,} documents "
                         f"before its resume point")

# -----------------------------------------------------------------------------
# sharding


def shard_corpus(corpus, job):
    """Tokenizes corpus's documents into job's shards, resuming this run where an interrupted one
    stopped. Returns {output_dir, documents, tokens, shards, status, tokens_per_s} where status
    is "written", "resumed" or "already complete"."""
    if job.shard_size < 1 or job.num_proc < 1:
        raise InputError(f"shard_size ({job.shard_size}) and num_proc ({job.num_proc}) must be at least 1")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * job.shard_size > memory // 2:  # the shard's buffer of uint16 tokens, beside the tokenizers' own memory
        raise InputError(f"a shard of {job.shard_size:,} tokens needs {2 * job.shard_size / 2**30:,.1f} GiB of memory "
                         f"for its buffer; this machine has {memory / 2**30:,.1f} GiB: choose a smaller --shard_size")
    output_dir = job.output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise InputError(f"{output_dir}: exists and is not a directory")
    created_dir = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        with contextlib.closing(claim_directory(output_dir, "fineweb.py")):
            return shard_claimed(corpus, job)
    except CannotClaim as e:  # in use by another run, or a .lock that cannot be ours
        raise InputError(str(e)) from None
    finally:  # a refusal leaves no directory behind that it made
        if created_dir:
            remove_if_unused(output_dir)


def shard_claimed(corpus, job):
    """shard_corpus, once this process holds job.output_dir's lock."""
    output_dir, prefix = job.output_dir, job.prefix
    # The run: this corpus, cut by this job and this tokenizer; a rerun resumes only the same run.
    run = corpus.identity | {"prefix": prefix, "shard_size": job.shard_size, "tokenizer": f"gpt2 {BPE_SHA256}"}
    manifest = start_or_resume(output_dir, prefix, run)
    status = "already complete" if manifest["complete"] else "resumed" if manifest["shards"] else "written"
    t0, tokens_before = time.time(), manifest["shards"] * job.shard_size
    if not manifest["complete"]:
        remove_leftovers(output_dir, prefix, manifest["shards"])
        write_manifest(output_dir, manifest)  # claims the directory before the first shard lands in it
        started = manifest
        try:
            manifest = write_shards(started, corpus, job)
        except InputError:
            # The corpus cannot be built as asked, so what this invocation wrote goes. The shards
            # of an earlier, interrupted run stay with their manifest: the error may be passing
            # (an unreachable hub), and a rerun resumes from them, as after an interruption.
            remove_leftovers(output_dir, prefix, started["shards"])
            if started["shards"]:
                write_manifest(output_dir, started)
            else:
                os.remove(os.path.join(output_dir, MANIFEST))
            raise
    tokens_per_s = None if status == "already complete" else (manifest["tokens"] - tokens_before) / (time.time() - t0)
    return {"output_dir": output_dir, "documents": manifest["documents"], "tokens": manifest["tokens"],
            "shards": manifest["shards"], "status": status, "tokens_per_s": tokens_per_s}


def expected_tokens(run):
    """About how many tokens a run's corpus gives, where its name says (FineWeb-Edu's samples), else None."""
    return SAMPLE_TOKENS.get(run.get("name")) if run.get("dataset") == FINEWEB_EDU else None


def write_shards(manifest, corpus, job):
    """The sharding loop: fills a shard_size buffer from the token stream and writes each full
    one, then records in the manifest where the next shard starts: `skip` tokens into the
    stream that begins at document number `document`. Returns the final manifest."""
    shard, document, skip = manifest["shards"], manifest["document"], manifest["skip"]
    output_dir, shard_size = job.output_dir, job.shard_size
    buffer = np.empty(shard_size, dtype=SHARD_DTYPE)
    filled = 0
    bar = progress_meter("fineweb", "tok", expected_tokens(manifest["run"]), shard * shard_size, scale=True,
                         disable=not job.progress)
    bar.set_postfix(shards=shard)
    for origins, tokens in tokenize_chunks(chunk_documents(corpus.documents(document), CHUNK_CHARS), job.num_proc):
        start = min(skip, len(tokens))  # when resuming: tokens that the written shards already hold
        skip -= start
        bar.update(len(tokens) - start)
        while start < len(tokens):
            take = min(shard_size - filled, len(tokens) - start)
            buffer[filled:filled + take] = tokens[start:start + take]
            filled, start = filled + take, start + take
            if filled == shard_size:
                write_shard(job.shard_path(shard), buffer)
                shard, filled = shard + 1, 0
                write_manifest(output_dir, manifest | {"shards": shard, "document": document, "skip": start})
                bar.set_postfix(shards=shard)
        document += len(origins)
    if document == 0:
        raise InputError(f"{corpus.name}: no documents")
    # The manifest's resume point lies past the end of the corpus: tokens to skip are left, or no
    # document came from it (a manifest points into the chunk where its next shard starts).
    nothing_read = manifest["document"] > 0 and document == manifest["document"]
    if skip or nothing_read:
        where = f"at document {document:,}" if nothing_read else f"{skip:,} tokens"
        raise InputError(f"{os.path.join(output_dir, MANIFEST)}: resumes {where} past the end of {corpus.name}: "
                         f"not this corpus's progress; delete {output_dir} and rerun")
    total = shard * shard_size + filled
    if total == document:  # each document is its <|endoftext|> alone
        raise InputError(f"{corpus.name}: no text ({document:,} empty document{'s' * (document > 1)})")
    if total <= shard_size:  # refused: read again, from the start, only to say why
        if not any(text.strip() for text, _ in corpus.documents(0)):  # no shard size would give it text
            raise InputError(f"{corpus.name}: no text, whitespace alone")
        raise InputError(too_small(corpus.name, total, shard_size))
    if filled:
        write_shard(job.shard_path(shard), buffer[:filled])
        shard += 1
        bar.set_postfix(shards=shard)
    bar.close()
    manifest = manifest | {"shards": shard, "document": document, "skip": 0, "complete": True,
                           "documents": document, "tokens": total}
    write_manifest(output_dir, manifest)
    return manifest


def too_small(name, tokens, shard_size):
    """Why a corpus of tokens (2 or more) gives no train shard at shard_size (shard 0 is val), and a
    shard size that gives several: about ten, the val shard a tenth of the tokens."""
    smaller = -(-tokens // 10)
    shards = -(-tokens // smaller)
    return (f"{name}: {tokens:,} tokens make one shard of --shard_size {shard_size:,}, the val shard, and no "
            f"train shard: --shard_size {smaller:,} gives {shards} shards (1 val, {shards - 1} train)")


def no_train_shards(data_dir, val_paths):
    """The trainer's error for a data_dir without train shards: how to make them; where data_dir is a
    file, what to train on instead; and where val shards are all it holds, why (a corpus that fit in
    one shard, from before fineweb.py refused it)."""
    if os.path.isfile(data_dir):
        return file_as_data_dir(data_dir)
    if val_paths:
        return (f"{data_dir!r} holds val shards ({', '.join(map(os.path.basename, val_paths))}) and no *_train_*.npy: "
                f"its corpus fit in one shard, the val split; shard it again with a smaller --shard_size")
    return (f"no *_train_*.npy shards in {data_dir!r}: make them with `python fineweb.py --output_dir {data_dir}` "
            f"(or --input your files)")


def file_as_data_dir(path):
    """The trainer's error for a --data_dir that names a file: the demo's Tiny Shakespeare has a preset
    that shards it; another corpus, the command that shards it, and the --data_dir that then holds it."""
    where = f"--data_dir {path} is a file, not a directory of *_train_*.npy shards"
    if os.path.samefile(path, TINY_SHAKESPEARE):
        return f"{where}: `python train_gpt2.py --preset demo` trains on it, sharded into {demo_data_dir()} on first use"
    if not path.lower().endswith(EXTENSIONS):
        return where
    shards = os.path.splitext(path)[0]
    return (f"{where}: shard it with `python fineweb.py --input {shlex.quote(path)} --output_dir {shlex.quote(shards)}`, "
            f"then train with --data_dir {shlex.quote(shards)}")


def demo_data_dir():
    """The demo preset's data_dir: Tiny Shakespeare's shards, in the repository."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), read_config(preset_path("demo"))["data_dir"])


def shard_local_files(paths, job, text_field="text"):
    """Shards local .txt/.jsonl/.json/.parquet files (or directories of them), in order, the text of a
    .jsonl/.json line or a .parquet row in its text_field; returns shard_corpus's summary. Raises
    InputError (a ValueError) on bad input, or if job.output_dir holds shards of another corpus."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    files = expand_inputs([os.fspath(path) for path in paths])
    for path in files:
        check_readable(path, text_field)
    identity = {"inputs": [{"path": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": file_sha256(path)}
                           for path in files], "text_field": text_field}
    corpus = Corpus(identity, ", ".join(files), lambda skip: local_documents(files, text_field, skip))
    return shard_corpus(corpus, job)


def shard_demo_corpus(data_dir, enabled=True):
    """The bundled Tiny Shakespeare, sharded into data_dir if it is the demo preset's own (on first
    use, or to complete an interrupted first sharding), where enabled (the trainer's rank 0); returns
    a line saying so, or None where nothing was sharded. Any other data_dir is the user's: a missing
    one is the trainer's error, not a new folder. Raises as shard_local_files (InputError), or
    OSError for a shard that cannot be written."""
    if not enabled:
        return None
    if os.path.realpath(data_dir) != os.path.realpath(demo_data_dir()):
        return None
    demo = ShardingJob(data_dir, prefix="shakespeare", shard_size=32768, num_proc=1)
    summary = shard_local_files([TINY_SHAKESPEARE], demo)
    if summary["status"] == "already complete":
        return None
    return f"sharded {TINY_SHAKESPEARE} into {summary['shards']} shards in {data_dir}"


def shard_hub_dataset(hub, job):
    """Shards a HubDataset, in row order; returns shard_corpus's summary."""
    identity = {"dataset": hub.dataset, "name": hub.name, "split": hub.split, "text_field": hub.text_field}
    name = f"{hub.dataset} ({hub.name}, {hub.split})"
    return shard_corpus(Corpus(identity, name, lambda skip: hub_documents(hub, skip)), job)

# -----------------------------------------------------------------------------
# command line


def positive_int(text):
    try:
        value = int(text)  # 100_000_000 is fine too
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def parse_args(argv):
    parser = Parser(prog="fineweb.py", description="Tokenize a corpus into GPT-2 token shards (build-nanogpt's format).")
    parser.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                        help="local .txt (a document a file), .jsonl/.json (a document a line) or .parquet "
                             "(a document a row) files, or directories of them, instead of the hub, in the order "
                             "given (--input a --input b is --input a b)")
    parser.add_argument("--dataset", help=f"Hugging Face dataset (default {FINEWEB_EDU})")
    parser.add_argument("--name", help="dataset config (default for FineWeb-Edu: from --version)")
    parser.add_argument("--version", choices=sorted(VERSIONS), help="FineWeb-Edu sample-10BT (default) or sample-100BT")
    parser.add_argument("--split", help="dataset split (default train)")
    parser.add_argument("--streaming", action="store_true", help="stream the dataset rather than download it first")
    parser.add_argument("--text_field", default="text", help="the JSON field or column holding the text")
    parser.add_argument("--output_dir", help="default edu_fineweb10B (edu_fineweb100B with --version 100B)")
    parser.add_argument("--prefix", default="edufineweb", help="shard names: PREFIX_{val,train}_NNNNNN.npy")
    parser.add_argument("--shard_size", type=positive_int, default=10**8, help="tokens a shard (default: 100M)")
    parser.add_argument("--num_proc", type=positive_int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="tokenizing processes (default: all cores but one)")
    args = parser.parse_args(argv)
    hub_flags = [f"--{k}" for k in ("dataset", "name", "version", "split", "streaming") if getattr(args, k)]
    if args.input and hub_flags:
        parser.error(f"--input reads local files; {hub_flags[0]} is for the hub")
    if args.version and args.dataset not in (None, FINEWEB_EDU):
        parser.error("--version picks a FineWeb-Edu sample; with --dataset, use --name")
    if not args.prefix or re.search(r"[\\/]", args.prefix):
        parser.error(f"--prefix {args.prefix!r} must be a non-empty file-name prefix")
    cores = os.cpu_count() or 1
    if args.num_proc > cores:  # more processes than cores only share them, each with its own tokenizer's memory
        print(f"fineweb.py: --num_proc {args.num_proc:,} is more than this machine's {cores} cores: tokenizing in "
              f"{cores} processes", file=sys.stderr)
        args.num_proc = cores
    args.version = args.version or "10B"
    if args.dataset in (None, FINEWEB_EDU):
        args.dataset, args.name = FINEWEB_EDU, args.name or VERSIONS[args.version]
    args.split = args.split or "train"
    args.output_dir = args.output_dir or f"edu_fineweb{args.version}"
    return args


@contextlib.contextmanager
def stops_as_ctrl_c():
    """Within it SIGTERM and SIGINT (STOP_SIGNALS) raise KeyboardInterrupt, which main answers with
    its line: SIGTERM's default, dying at once, would leave the pool's workers running, orphaned,
    and SIGINT's handler until then (cli.exit_on_ctrl_c) would exit without that line. A SIGINT
    ignored from the start (a job started in the background) stays ignored."""
    stops = [s for s in STOP_SIGNALS if s != signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN]
    previous = [signal.signal(signum, raise_keyboard_interrupt) for signum in stops]
    try:
        yield
    finally:
        for signum, handler in zip(stops, previous):
            signal.signal(signum, handler)


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    """The command line; returns the exit status."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code
    job = ShardingJob(args.output_dir, args.prefix, args.shard_size, args.num_proc, progress=True)
    try:
        with stops_as_ctrl_c():
            if args.input:
                summary = shard_local_files(args.input, job, args.text_field)
            else:
                hub = HubDataset(args.dataset, args.name, args.split, args.text_field, args.streaming)
                summary = shard_hub_dataset(hub, job)
    except (InputError, OSError) as e:  # OSError: writing failed; the finished shards stay, resumable
        print(f"fineweb.py: error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        print("fineweb.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    rate = "" if summary["tokens_per_s"] is None else f", {summary['tokens_per_s']:,.0f} tokens/s"
    print(f"{summary['output_dir']}: documents {summary['documents']:,}, tokens {summary['tokens']:,}, "
          f"shards {summary['shards']} (1 val, {summary['shards'] - 1} train); {summary['status']}{rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
