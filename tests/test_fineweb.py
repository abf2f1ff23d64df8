"""fineweb.py: the shard stream, the input formats, start methods, bad input, interrupted runs."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fineweb
from bench import baseline_tokenize
from fineweb import ShardingJob
from gpt2repro.lm.data import Shard, shard_name
from gpt2repro.lm.tokenizer import EOT, get_encoding
from helpers import REPO
from helpers.files import DOCS, listdir, never_ending_inputs, write_docs_jsonl
from helpers.processes import run_bounded, run_script

SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare.txt")
def stream_of(docs):
    """The token stream computed independently: <|endoftext|> then the document, for each one."""
    enc = get_encoding()
    return [t for doc in docs for t in [EOT] + enc.encode_ordinary(doc)]


def shards_in(out, prefix):
    """The shards of out in index order, after checking out holds just them and the manifest."""
    names = sorted(n for n in listdir(out) if n != fineweb.MANIFEST)
    count = len(names)
    expected = [shard_name(prefix, "val" if i == 0 else "train", i) for i in range(count)]
    assert names == sorted(expected), names
    return [np.load(os.path.join(out, name)) for name in expected]


def check_shards(out, prefix, shard_size, docs):
    shards = shards_in(out, prefix)
    assert all(s.dtype == np.uint16 and s.ndim == 1 for s in shards)
    assert all(len(s) == shard_size for s in shards[:-1]) and 0 < len(shards[-1]) <= shard_size
    assert np.concatenate(shards).tolist() == stream_of(docs)
    return shards


def write_parquet(path, docs, field="text"):
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=2)  # several row groups: several batches
    return str(path)


def write_txt_dir(path, docs):
    path.mkdir()
    for i, doc in enumerate(docs):
        (path / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(path)


def run_cli(*args, env=None, script="fineweb.py"):
    return run_script(script, *args, env=env)


def shakespeare_speeches(limit=None):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        return f.read()[:limit].split("\n\n")


def test_tinyshakespeare_starts_with_gpt2_ids():
    start = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert shakespeare_speeches()[0] == start
    assert get_encoding().encode_ordinary(start) == [5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285,
                                                     502, 2740, 13]


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_round_trip(tmp_path, fmt):
    write = {"jsonl": lambda: write_docs_jsonl(tmp_path / "c.jsonl", DOCS), "txt": lambda: write_txt_dir(tmp_path / "c", DOCS),
             "parquet": lambda: write_parquet(tmp_path / "c.parquet", DOCS)}[fmt]
    summary = fineweb.shard_local_files(write(), ShardingJob(str(tmp_path / "out"), "tiny", 7))
    shards = check_shards(tmp_path / "out", "tiny", 7, DOCS)
    assert (np.concatenate(shards) == EOT).sum() == len(DOCS)  # a literal "<|endoftext|>" is just text
    assert summary["documents"] == len(DOCS) and summary["tokens"] == len(stream_of(DOCS))
    assert summary["shards"] == len(shards) > 10 and summary["status"] == "written"


def test_building_the_tokenizer_writes_nothing_to_the_temporary_directory(tmp_path):
    """tiktoken's own loader would copy the ranks into TMPDIR/data-gym-cache."""
    empty = tmp_path / "tmp"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    code = "from gpt2repro.lm.tokenizer import get_encoding; print(get_encoding().encode_ordinary('Hello world'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "TMPDIR": str(empty)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[15496, 995]\n"  # tiktoken's gpt2 ids
    assert os.listdir(empty) == []


def test_directory_is_sorted_by_name_and_files_keep_their_order(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_docs_jsonl(corpus / "b.jsonl", ["b1", "b2"])
    (corpus / "a.txt").write_text("a", encoding="utf-8")
    write_parquet(corpus / "c.parquet", ["c1"])
    (corpus / "notes.md").write_text("not a corpus file", encoding="utf-8")
    fineweb.shard_local_files(str(corpus), ShardingJob(str(tmp_path / "dir"), "t", 3))
    check_shards(tmp_path / "dir", "t", 3, ["a", "b1", "b2", "c1"])
    fineweb.shard_local_files([str(corpus / "c.parquet"), str(corpus / "a.txt")],
                              ShardingJob(str(tmp_path / "files"), "t", 3))
    check_shards(tmp_path / "files", "t", 3, ["c1", "a"])


def test_input_given_twice_shards_both_in_the_order_given(tmp_path, capsys):
    """--input a --input b is --input a b: b alone would drop a's documents without a word."""
    (tmp_path / "a.txt").write_text("first file", encoding="utf-8")
    write_docs_jsonl(tmp_path / "b.jsonl", ["b1", "b2"])
    (tmp_path / "c.txt").write_text("third", encoding="utf-8")
    assert fineweb.main(["--input", str(tmp_path / "a.txt"), "--input", str(tmp_path / "b.jsonl"), str(tmp_path / "c.txt"),
                         "--output_dir", str(tmp_path / "out"), "--prefix", "t", "--shard_size", "3", "--num_proc", "1"]) == 0
    assert "documents 4," in capsys.readouterr().out
    check_shards(tmp_path / "out", "t", 3, ["first file", "b1", "b2", "third"])


def test_a_txt_file_is_its_text_as_is(tmp_path):
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\rc")
    fineweb.shard_local_files(str(tmp_path / "crlf.txt"), ShardingJob(str(tmp_path / "out"), "t", 4))
    check_shards(tmp_path / "out", "t", 4, ["a\r\nb\rc"])  # [EOT] + encode_ordinary, \r\n and \r kept


def test_num_proc_1_and_2_write_identical_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 200)  # many chunks, so two workers interleave
    docs = shakespeare_speeches(20_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    for num_proc in (1, 2):
        fineweb.shard_local_files(corpus, ShardingJob(str(tmp_path / f"p{num_proc}"), "s", 500, num_proc=num_proc))
    one, two = check_shards(tmp_path / "p1", "s", 500, docs), check_shards(tmp_path / "p2", "s", 500, docs)
    assert len(one) == len(two) > 5 and all(np.array_equal(a, b) for a, b in zip(one, two))


def test_tokenize_documents_matches_one_document_per_task():
    texts = shakespeare_speeches(5_000)
    ours = np.concatenate(list(fineweb.tokenize_documents(texts, num_proc=2, chunk_chars=300)))
    baseline = np.concatenate(list(baseline_tokenize(texts, num_proc=2)))
    assert ours.dtype == baseline.dtype == np.uint16
    assert ours.tolist() == baseline.tolist() == stream_of(texts)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_cli_under_spawn_and_forkserver_matches_fork(tmp_path, method):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import multiprocessing\nmultiprocessing.set_start_method({method!r}, force=True)\n")
    docs = shakespeare_speeches()  # 1.1 MB: two chunks, one to each worker
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    args = ["--input", corpus, "--shard_size", 50_000, "--num_proc", 2, "--prefix", "s"]
    result = run_cli(*args, "--output_dir", tmp_path / method, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    fineweb.shard_local_files(corpus, ShardingJob(str(tmp_path / "fork"), "s", 50_000, num_proc=2))
    names = sorted(listdir(tmp_path / "fork"))
    assert names == sorted(listdir(tmp_path / method)) and len(names) == 8
    for name in names:
        if name != fineweb.MANIFEST:
            assert (tmp_path / "fork" / name).read_bytes() == (tmp_path / method / name).read_bytes()
    check_shards(tmp_path / method, "s", 50_000, docs)


def test_runs_where_torch_cannot_be_imported(tmp_path):
    """fineweb.py needs no torch (a machine that only prepares data may lack it), nor do its
    workers: here spawned, so each imports the script afresh, with torch unimportable in all."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import multiprocessing, sys\nsys.modules['torch'] = None\n"
                                           "multiprocessing.set_start_method('spawn', force=True)\n")
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    args = ["--input", corpus, "--shard_size", 50, "--num_proc", 2, "--prefix", "t", "--output_dir", tmp_path / "out"]
    result = run_cli(*args, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    check_shards(tmp_path / "out", "t", 50, DOCS)
    assert run_cli("--help", env={"PYTHONPATH": str(site)}).returncode == 0


def test_progress_lines_where_no_terminal_shows_a_bar(tmp_path, monkeypatch, capsys):
    from gpt2repro.common import progress
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0)  # a line at every chunk of tokens
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    assert fineweb.main(["--input", corpus, "--shard_size", "50", "--num_proc", "1", "--prefix", "t",
                         "--output_dir", str(tmp_path / "out")]) == 0
    shards = len([name for name in os.listdir(tmp_path / "out") if name.endswith(".npy")])
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.match(r"fineweb: [\d.]+k? tok, [\d.]+\w? tok/s, shards=\d+$", line) for line in lines), lines
    assert lines[-1].endswith(f"shards={shards}")
    # FineWeb-Edu's samples are named for their size: there, the lines say how long is left.
    assert fineweb.expected_tokens({"dataset": fineweb.FINEWEB_EDU, "name": "sample-10BT"}) == 10**10
    assert fineweb.expected_tokens({"inputs": [corpus]}) is None


def test_demo_corpus(tmp_path):
    summary = fineweb.shard_local_files(SHAKESPEARE, ShardingJob(str(tmp_path / "shakespeare"), "shakespeare", 32768))
    assert (summary["documents"], summary["tokens"], summary["shards"]) == (1, 338_026, 11)
    val = Shard(str(tmp_path / "shakespeare" / "shakespeare_val_000000.npy"))
    assert val.n_tokens == 32768 and val.read(0, 4).tolist() == [EOT, 5962, 22307, 25]


def test_a_corpus_of_one_shard_or_less_is_one_line_naming_a_shard_size_that_gives_train_shards(tmp_path):
    """60 KB of text at the default 100M tokens a shard would be a val shard and no train shard."""
    corpus = tmp_path / "small.txt"
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(60_000)
    corpus.write_text(text, encoding="utf-8")
    tokens = len(stream_of([text]))
    smaller = -(-tokens // 10)  # a tenth of the tokens, rounded up: ten shards
    result = run_cli("--input", corpus, "--output_dir", tmp_path / "out", "--num_proc", 1)
    one_line_error(result, f"small.txt: {tokens:,} tokens make one shard of --shard_size 100,000,000, the val shard, "
                           f"and no train shard: --shard_size {smaller:,} gives 10 shards (1 val, 9 train)")
    assert not (tmp_path / "out").exists()
    result = run_cli("--input", corpus, "--output_dir", tmp_path / "out", "--num_proc", 1, "--shard_size", smaller)
    assert result.returncode == 0 and "shards 10 (1 val, 9 train)" in result.stdout, result.stderr
    check_shards(tmp_path / "out", "edufineweb", smaller, [text])
    # Exactly one full shard is no train shard either.
    one_line_error(run_cli("--input", corpus, "--output_dir", tmp_path / "one", "--shard_size", tokens),
                   f"{tokens:,} tokens make one shard")
    assert not (tmp_path / "one").exists()


def one_line_error(result, name):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fineweb.py: error:") and name in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def bad_inputs(tmp):
    """(input path, name the message must hold, extra flags) for each kind of bad input."""
    (tmp / "c.csv").write_text("text\nhello\n")
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.txt").write_text(" \n\n\t \r\n  ")  # tokens, but no shard size would give them text
    (tmp / "nofield.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    (tmp / "notjson.jsonl").write_text('{"text": "a"}\n{text: b}\n')
    (tmp / "deep.jsonl").write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")  # past Python's recursion
    (tmp / "emptydir").mkdir()
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff\xfe"], type=pa.binary()).view(pa.string())}),
                   tmp / "latin1.parquet")
    # The bad line comes after more than a chunk of text: shards are written, then removed.
    late = write_docs_jsonl(tmp / "late.jsonl", shakespeare_speeches() + ["x"])
    with open(late, "a") as f:
        f.write('{"title": "no text"}\n')
    return {
        "missing path": (tmp / "nope.jsonl", "nope.jsonl", []),
        "unknown extension": (tmp / "c.csv", "c.csv", []),
        "not utf-8": (tmp / "latin1.txt", "latin1.txt", []),
        "not parquet": (tmp / "broken.parquet", "broken.parquet", []),
        "parquet not utf-8": (tmp / "latin1.parquet", "latin1.parquet row 1", []),
        "no text column": (write_parquet(tmp / "body.parquet", ["a"], field="body"), "body.parquet", []),
        "empty corpus": (tmp / "empty.jsonl", "empty.jsonl", []),
        "empty text file": (tmp / "empty.txt", "empty.txt: no text (1 empty document)", []),
        "whitespace alone": (tmp / "blank.txt", "blank.txt: no text, whitespace alone", []),
        "empty directory": (tmp / "emptydir", "emptydir", []),
        "missing text field": (tmp / "nofield.jsonl", "nofield.jsonl line 3", []),
        "not json": (tmp / "notjson.jsonl", "notjson.jsonl line 2", []),
        "json nested too deep": (tmp / "deep.jsonl", "deep.jsonl line 2: not JSON (nested too deep", []),
        "missing field after shards": (late, "late.jsonl line 7224", []),
        "shard_size 0": (SHAKESPEARE, "--shard_size", ["--shard_size", "0"]),
        "num_proc 0": (SHAKESPEARE, "--num_proc", ["--num_proc", "0"]),
    }


@pytest.mark.parametrize("case", [
    "missing path", "unknown extension", "not utf-8", "not parquet", "parquet not utf-8", "no text column",
    "empty corpus", "empty text file", "whitespace alone", "empty directory", "missing text field", "not json", "json nested too deep",
    "missing field after shards",
    "shard_size 0", "num_proc 0"])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, case):
    path, name, flags = bad_inputs(tmp_path)[case]
    before = set(listdir(tmp_path))
    result = run_cli("--input", path, "--output_dir", tmp_path / "out", "--shard_size", 1000, "--num_proc", 1, *flags)
    one_line_error(result, name)
    assert set(listdir(tmp_path)) == before  # no output directory, shard or temporary file


def test_token_id_over_uint16_names_the_document(tmp_path, monkeypatch, capsys):
    class HugeIds:
        def encode_ordinary(self, text):
            return [70000] if "huge" in text else [1, 2]
    monkeypatch.setattr(fineweb, "get_encoding", HugeIds)
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 1)  # the first documents are sharded before the bad one
    written, real_write_shard = [], fineweb.write_shard
    monkeypatch.setattr(fineweb, "write_shard", lambda path, tokens: (written.append(path), real_write_shard(path, tokens)))
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", ["ok", "ok", "huge"])
    assert fineweb.main(["--input", corpus, "--output_dir", str(tmp_path / "out"), "--shard_size", "2",
                         "--num_proc", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{corpus} line 3: token id 70000" in err[0]
    assert len(written) == 3 and not (tmp_path / "out").exists()  # three shards were written, then removed


KILL_AT_THIRD_SHARD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import fineweb

renamed, real_replace = 0, os.replace

def replace(src, dst):  # kills the run when shard 2 is written to its temporary file, not yet in place
    global renamed
    if dst.endswith(".npy"):
        renamed += 1
        if renamed == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)

os.replace = replace
sys.exit(fineweb.main(sys.argv[1:]))
"""


def test_killed_run_resumes_to_identical_shards(tmp_path):
    docs = shakespeare_speeches(30_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    (tmp_path / "kill.py").write_text(KILL_AT_THIRD_SHARD.format(repo=REPO))
    out = tmp_path / "out"
    args = ["--input", corpus, "--output_dir", out, "--shard_size", 1000, "--num_proc", 1]
    killed = run_cli(*args, script=str(tmp_path / "kill.py"))
    assert killed.returncode == -signal.SIGKILL
    names = sorted(listdir(out))
    assert [n for n in names if n.endswith(".npy")] == ["edufineweb_train_000001.npy", "edufineweb_val_000000.npy"]
    assert any(n.startswith("edufineweb_train_000002.npy.tmp") for n in names)  # never renamed into place
    assert all(Shard(str(out / n)).n_tokens == 1000 for n in names if n.endswith(".npy"))
    manifest = json.loads((out / fineweb.MANIFEST).read_text())
    assert manifest["shards"] == 2 and not manifest["complete"]
    check_rerun_matches_an_uninterrupted_run(args, corpus, out, 1000, docs)


def check_rerun_matches_an_uninterrupted_run(args, corpus, out, shard_size, docs):
    """Reruns the command line args of a stopped run: it resumes, and its output directory ends
    byte for byte as an uninterrupted run's, with no temporary file left."""
    resumed = run_cli(*args)
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    clean = out.parent / "clean"
    fineweb.shard_local_files(corpus, ShardingJob(str(clean), "edufineweb", shard_size))
    assert sorted(listdir(out)) == sorted(listdir(clean))
    for name in listdir(out):
        assert (out / name).read_bytes() == (clean / name).read_bytes()
    check_shards(out, "edufineweb", shard_size, docs)


DISK_FULL_AT_THIRD_SHARD = """
import resource, signal, sys
sys.path.insert(0, {repo!r})
import fineweb

written, real_write_shard = 0, fineweb.write_shard

def write_shard(path, tokens):  # from shard 2 on, a file can grow to 1000 bytes only, as on a full disk
    global written
    written += 1
    if written == 3:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG), not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    real_write_shard(path, tokens)

fineweb.write_shard = write_shard
sys.exit(fineweb.main(sys.argv[1:]))
"""


# Shards under and over stdio's 4 KB buffer: numpy's tofile left the small one truncated without
# an error, and said only "5000 requested and 436 written" of the large one.
@pytest.mark.parametrize("shard_size", [1000, 5000])
def test_a_full_disk_is_one_line_naming_the_shard_and_the_rerun_resumes(tmp_path, shard_size):
    docs = shakespeare_speeches(60_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    (tmp_path / "fill.py").write_text(DISK_FULL_AT_THIRD_SHARD.format(repo=REPO))
    out = tmp_path / "out"
    args = ["--input", corpus, "--output_dir", out, "--shard_size", shard_size, "--num_proc", 1]
    failed = run_cli(*args, script=str(tmp_path / "fill.py"))
    shard = out / "edufineweb_train_000002.npy"
    one_line_error(failed, f"{shard}: cannot write the shard ({os.strerror(errno.EFBIG)})")
    assert sorted(listdir(out)) == sorted([fineweb.MANIFEST, "edufineweb_val_000000.npy",
                                              "edufineweb_train_000001.npy"])  # no temporary file
    assert json.loads((out / fineweb.MANIFEST).read_text())["shards"] == 2
    check_rerun_matches_an_uninterrupted_run(args, corpus, out, shard_size, docs)


def test_interrupted_run_keeps_finished_shards_and_resumes(tmp_path, monkeypatch, capsys):
    docs = shakespeare_speeches(10_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    real_write_shard, written = fineweb.write_shard, []

    def interrupt_at_second_shard(path, tokens):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        real_write_shard(path, tokens)
    monkeypatch.setattr(fineweb, "write_shard", interrupt_at_second_shard)
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 300)  # the next shard starts inside a later chunk
    args = ["--input", corpus, "--output_dir", str(tmp_path / "out"), "--shard_size", "500", "--num_proc", "1"]
    assert fineweb.main(args) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert sorted(listdir(tmp_path / "out")) == sorted([fineweb.MANIFEST, "edufineweb_val_000000.npy"])
    manifest = json.loads((tmp_path / "out" / fineweb.MANIFEST).read_text())
    assert manifest["shards"] == 1 and manifest["document"] > 0 and manifest["skip"] > 0
    monkeypatch.setattr(fineweb, "write_shard", real_write_shard)
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 50)  # the tokens to skip now span several chunks
    summary = fineweb.shard_local_files(corpus, ShardingJob(str(tmp_path / "out"), "edufineweb", 500))
    assert summary["status"] == "resumed" and summary["documents"] == len(docs)
    check_shards(tmp_path / "out", "edufineweb", 500, docs)


STOP_AT_THIRD_SHARD = """
import multiprocessing, os, signal, sys
sys.path.insert(0, {repo!r})
import fineweb

signum, to_group, written, real_write_shard = int(sys.argv[1]), sys.argv[2] == "group", 0, fineweb.write_shard
# Python leaves SIGINT ignored when it starts ignored (pytest run in the background by a script): Ctrl-C's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)

def write_shard(path, tokens):  # signals the run as shard 2 is about to be written, after printing the workers' ids
    global written
    written += 1
    if written == 3:
        print(*(child.pid for child in multiprocessing.active_children()), flush=True)
        if to_group:
            os.killpg(0, signum)
        else:
            os.kill(os.getpid(), signum)
    real_write_shard(path, tokens)

fineweb.write_shard = write_shard
sys.exit(fineweb.main(sys.argv[3:]))
"""


def running(pid):
    """Whether process pid runs: a zombie has ended, whether or not its parent reaped it yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # the state follows the command's name
    except FileNotFoundError:
        return False


# Ctrl-C on a terminal and a scheduler's SIGTERM reach every process of the run; `kill`, or
# Kubernetes, signal only the main process, whose workers used to live on, orphaned.
@pytest.mark.slow
@pytest.mark.parametrize("signum,to", [(signal.SIGINT, "group"), (signal.SIGTERM, "group"),
                                       (signal.SIGTERM, "process")])
def test_ctrl_c_or_sigterm_shuts_the_workers_down_and_the_rerun_resumes(tmp_path, signum, to):
    docs = shakespeare_speeches(30_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    (tmp_path / "stop.py").write_text(STOP_AT_THIRD_SHARD.format(repo=REPO))
    out = tmp_path / "out"
    args = ["--input", corpus, "--output_dir", out, "--shard_size", 1000, "--num_proc", 2]
    # Output to files, not pipes: an orphaned worker would hold a pipe open, and reading it to its end would hang.
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        stopped = subprocess.run([sys.executable, tmp_path / "stop.py", str(int(signum)), to, *map(str, args)],
                                 stdout=stdout, stderr=stderr, start_new_session=True, timeout=300)
    workers = [int(pid) for pid in (tmp_path / "stdout").read_text().split()]
    survivors = [pid for pid in workers if running(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert workers and not survivors
    assert stopped.returncode == 130
    assert (tmp_path / "stderr").read_text() == "fineweb.py: interrupted; rerun the same command to resume\n"
    assert sorted(listdir(out)) == sorted([fineweb.MANIFEST, "edufineweb_val_000000.npy",
                                              "edufineweb_train_000001.npy"])  # no temporary file
    check_rerun_matches_an_uninterrupted_run(args, corpus, out, 1000, docs)


def interrupt_at_third_shard(monkeypatch, corpus, out, prefix, shard_size, chunk_chars):
    """Shards corpus into out, chunk_chars of text a chunk, interrupted (Ctrl-C) as its third shard
    is written; returns the paths of the shards asked for, a list to which later runs add."""
    real_write_shard, written = fineweb.write_shard, []

    def write_shard(path, tokens):
        written.append(path)
        if len(written) == 3:
            raise KeyboardInterrupt
        real_write_shard(path, tokens)
    monkeypatch.setattr(fineweb, "write_shard", write_shard)
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", chunk_chars)
    with pytest.raises(KeyboardInterrupt):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), prefix, shard_size))
    return written


def test_bad_input_on_resume_removes_only_what_the_resumed_run_wrote(tmp_path, monkeypatch):
    docs = shakespeare_speeches(10_000)
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    # Small chunks: shards are written before the source fails.
    written = interrupt_at_third_shard(monkeypatch, corpus, out, "edufineweb", 500, chunk_chars=300)
    before = {name: (out / name).read_bytes() for name in listdir(out)}
    assert json.loads(before[fineweb.MANIFEST])["shards"] == 2 and len(before) == 3

    def fails_at_last_document(path, text_field):  # as an unreachable hub or a read error would
        for number, document in enumerate(fineweb.read_jsonl(path, text_field)):
            if number == len(docs) - 1:
                raise fineweb.InputError(f"{path}: cannot read")
            yield document
    monkeypatch.setitem(fineweb.READERS, ".jsonl", fails_at_last_document)
    with pytest.raises(fineweb.InputError, match="cannot read"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "edufineweb", 500))
    assert len(written) > 4  # the resumed run wrote shards 2, 3, ... before it failed
    assert {name: (out / name).read_bytes() for name in listdir(out)} == before
    monkeypatch.setitem(fineweb.READERS, ".jsonl", fineweb.read_jsonl)
    summary = fineweb.shard_local_files(corpus, ShardingJob(str(out), "edufineweb", 500))
    assert summary["status"] == "resumed"
    check_shards(out, "edufineweb", 500, docs)


def test_rerun_of_a_complete_run_does_nothing_and_another_corpus_is_refused(tmp_path):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    before = {name: (out / name).stat().st_mtime_ns for name in listdir(out)}
    again = run_cli("--input", corpus, "--output_dir", out, "--prefix", "tiny", "--shard_size", 7)
    assert again.returncode == 0 and "already complete" in again.stdout
    one_line_error(run_cli("--input", corpus, "--output_dir", out, "--prefix", "tiny", "--shard_size", 8), "shard_size")
    with pytest.raises(fineweb.InputError, match="another run \\(prefix"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "other", 7))
    with open(corpus, "a") as f:  # the same file, grown: a different corpus
        f.write('{"text": "one more"}\n')
    with pytest.raises(fineweb.InputError, match="another run \\(inputs"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert {name: (out / name).stat().st_mtime_ns for name in listdir(out)} == before


def test_a_prefix_holding_a_split_word_reruns_as_complete(tmp_path):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    fineweb.shard_local_files(corpus, ShardingJob(str(out), "shakes_train_x", 7))
    check_shards(out, "shakes_train_x", 7, DOCS)
    assert fineweb.shard_local_files(corpus, ShardingJob(str(out), "shakes_train_x", 7))["status"] == "already complete"


def test_a_directory_sharded_into_itself_reruns_as_complete(tmp_path):
    write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    first = fineweb.shard_local_files(str(tmp_path), ShardingJob(str(tmp_path), "tiny", 7))
    # Its manifest, written there, is not read back as an input: the rerun is the same run.
    assert first["documents"] == len(DOCS)
    assert fineweb.shard_local_files(str(tmp_path), ShardingJob(str(tmp_path), "tiny", 7))["status"] == "already complete"


def test_shards_without_a_manifest_or_of_another_prefix_are_refused(tmp_path):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    np.save(foreign / "edufineweb_val_000000.npy", np.zeros(7, dtype=np.uint16))
    with pytest.raises(fineweb.InputError, match="no fineweb_manifest.json"):
        fineweb.shard_local_files(corpus, ShardingJob(str(foreign), "edufineweb", 7))
    out = tmp_path / "out"
    fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    np.save(out / "other_train_000001.npy", np.zeros(7, dtype=np.uint16))
    with pytest.raises(fineweb.InputError, match="another prefix"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))


@pytest.mark.parametrize("text", ["[]", '"x"', "null", '{"run": 5}', '{"run": {}, "shards": 1, "document": 0}'])
def test_a_manifest_that_is_json_but_not_ours_is_unreadable(tmp_path, text):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    (out / fineweb.MANIFEST).write_text(text)
    with pytest.raises(fineweb.InputError, match="unreadable manifest"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert listdir(out) == [fineweb.MANIFEST] and (out / fineweb.MANIFEST).read_text() == text


def test_hugging_face_dataset_path(tmp_path):
    """The hub code path (load_dataset, the text column, batches), on a local folder: no network."""
    hub = tmp_path / "hub"
    hub.mkdir()
    write_docs_jsonl(hub / "part.jsonl", DOCS)
    out = tmp_path / "out"
    result = run_cli("--dataset", hub, "--output_dir", out, "--shard_size", 7, "--num_proc", 1,
                     env={"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    check_shards(out, "edufineweb", 7, DOCS)
    manifest = json.loads((out / fineweb.MANIFEST).read_text())
    assert manifest["run"]["dataset"] == str(hub) and manifest["documents"] == len(DOCS)


def test_cli_values_and_flag_combinations(capsys):
    for argv, name in [(["--shard_size=-5"], "--shard_size"), (["--shard_size", "abc"], "--shard_size"),
                       (["--num_proc", "-1"], "--num_proc"), (["--input", SHAKESPEARE, "--version", "100B"], "--version"),
                       (["--dataset", "someone/corpus", "--version", "100B"], "--version"), (["--prefix", "a/b"], "--prefix")]:
        assert fineweb.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fineweb.py: error:") and name in err[0]
    args = fineweb.parse_args(["--version", "100B"])
    assert (args.dataset, args.name, args.split, args.output_dir, args.prefix, args.shard_size) == \
        (fineweb.FINEWEB_EDU, "sample-100BT", "train", "edu_fineweb100B", "edufineweb", 100_000_000)
    args = fineweb.parse_args(["--shard_size", "1_000"])
    assert (args.name, args.output_dir, args.shard_size) == ("sample-10BT", "edu_fineweb10B", 1000) and args.num_proc >= 1


def test_blank_lines_in_jsonl_are_skipped(tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_docs_jsonl(corpus, DOCS[:3])
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    corpus.write_text("\n" + lines[0] + "\n  \n" + "".join(lines[1:]) + "\n", encoding="utf-8")
    summary = fineweb.shard_local_files(str(corpus), ShardingJob(str(tmp_path / "out"), "t", 7))
    assert summary["documents"] == 3
    check_shards(tmp_path / "out", "t", 7, DOCS[:3])


def test_hub_documents_start_at_the_skipped_row(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hub = tmp_path / "hub"
    hub.mkdir()
    write_docs_jsonl(hub / "part.jsonl", DOCS)
    docs = list(fineweb.hub_documents(fineweb.HubDataset(str(hub), name=None), skip=2))
    assert docs == [(text, f"{hub} row {row}") for row, text in enumerate(DOCS) if row >= 2]


def test_a_killed_run_leaves_no_live_workers(tmp_path):
    """SIGKILL (or the OOM killer) gives the main process no chance to shut its pool down: the
    kernel kills the workers with it."""
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", shakespeare_speeches(30_000))
    (tmp_path / "stop.py").write_text(STOP_AT_THIRD_SHARD.format(repo=REPO))
    args = ["--input", corpus, "--output_dir", tmp_path / "out", "--shard_size", 1000, "--num_proc", 2]
    with open(tmp_path / "stdout", "w") as stdout:
        killed = subprocess.run([sys.executable, tmp_path / "stop.py", str(int(signal.SIGKILL)), "process", *map(str, args)],
                                stdout=stdout, stderr=subprocess.DEVNULL, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    workers = [int(pid) for pid in (tmp_path / "stdout").read_text().split()]
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    survivors = [pid for pid in workers if running(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert workers and not survivors


def test_invalid_utf8_in_jsonl_names_its_own_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "x" * 100}).encode() for i in range(50_000)]
    lines[49_999] = b'{"text": "caf\xe9"}'  # latin-1, deep into the file (text mode decodes 8 KB ahead)
    path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "early.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    for name, line in (("bad.jsonl", 50_000), ("early.jsonl", 2)):
        with pytest.raises(fineweb.InputError, match=rf"{name} line {line}: not UTF-8 text"):
            list(fineweb.read_jsonl(str(tmp_path / name), "text"))


def test_a_fifo_among_the_inputs_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    result = run_cli("--input", tmp_path / "pipe.jsonl", "--output_dir", tmp_path / "out", "--shard_size", 1000)
    one_line_error(result, "pipe.jsonl: not a regular file")
    assert not (tmp_path / "out").exists()


def test_a_shard_size_beyond_memory_is_refused_before_anything_is_written(tmp_path):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    result = run_cli("--input", corpus, "--output_dir", tmp_path / "out", "--shard_size", 10**13)
    one_line_error(result, "a shard of 10,000,000,000,000 tokens needs")
    assert not (tmp_path / "out").exists()
    fineweb.shard_local_files(corpus, ShardingJob(str(tmp_path / "out"), "tiny", 7))  # the corrected rerun
    check_shards(tmp_path / "out", "tiny", 7, DOCS)


def sharded_docs(tmp_path):
    """(corpus, output dir, its manifest) of DOCS sharded 7 tokens a shard."""
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    return corpus, out, json.loads((out / fineweb.MANIFEST).read_text())


@pytest.mark.parametrize("progress, problem", [
    ({"shards": -3}, "shards is -3"), ({"document": "2"}, 'document is "2"'), ({"skip": 1.5}, "skip is 1.5"),
    ({"complete": "yes"}, 'complete is "yes"'), ({"documents": 99}, "a document count that disagrees"),
])
def test_a_manifest_with_impossible_progress_is_refused_touching_nothing(tmp_path, progress, problem):
    corpus, out, manifest = sharded_docs(tmp_path)
    (out / fineweb.MANIFEST).write_text(json.dumps({**manifest, **progress}))
    before = {name: (out / name).read_bytes() for name in listdir(out)}
    with pytest.raises(fineweb.InputError, match=f"unreadable manifest \\(impossible progress: .*{problem}"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert {name: (out / name).read_bytes() for name in listdir(out)} == before


def interrupted_at_third_shard(tmp_path, monkeypatch):
    """(corpus, output dir, its manifest) of DOCS sharded 7 tokens a shard, a document a chunk,
    interrupted as its third shard was written: a manifest that agrees with its two shards."""
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    interrupt_at_third_shard(monkeypatch, corpus, out, "tiny", 7, chunk_chars=1)
    monkeypatch.undo()
    return corpus, out, json.loads((out / fineweb.MANIFEST).read_text())


def rewrite_same_size(corpus, docs):
    """Replaces corpus with docs, padded with blank lines (which the reader skips) to its size:
    another corpus that a manifest naming its inputs by path and size alone does not tell apart."""
    size = os.path.getsize(corpus)
    write_docs_jsonl(corpus, docs)
    with open(corpus, "a") as f:
        f.write("\n" * (size - os.path.getsize(corpus)))
    assert os.path.getsize(corpus) == size


def without_hashes(manifest):
    """manifest as a fineweb.py from before the inputs' SHA-256 wrote it: inputs named by path and size."""
    inputs = [{k: v for k, v in entry.items() if k != "sha256"} for entry in manifest["run"]["inputs"]]
    return manifest | {"run": manifest["run"] | {"inputs": inputs}}


def test_an_input_edited_to_its_old_size_is_one_line_naming_it_never_resumed(tmp_path, monkeypatch, capsys):
    corpus, out, manifest = interrupted_at_third_shard(tmp_path, monkeypatch)
    assert [entry["sha256"] for entry in manifest["run"]["inputs"]] == [fineweb.file_sha256(corpus)]
    rewrite_same_size(corpus, DOCS[1:] + DOCS[:1])
    before = {name: (out / name).read_bytes() for name in listdir(out)}
    assert fineweb.main(["--input", corpus, "--output_dir", str(out), "--prefix", "tiny", "--shard_size", "7",
                         "--num_proc", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"fineweb.py: error: {corpus}: changed since the shards in {out} were cut from it (another SHA-256): they "
        f"would mix two corpora; restore it, or delete {out} and rerun\n")
    assert {name: (out / name).read_bytes() for name in listdir(out)} == before


def test_a_manifest_from_before_the_hashes_still_resumes(tmp_path, monkeypatch):
    corpus, out, manifest = interrupted_at_third_shard(tmp_path, monkeypatch)
    (out / fineweb.MANIFEST).write_text(json.dumps(without_hashes(manifest)))
    summary = fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert summary["status"] == "resumed"
    check_shards(out, "tiny", 7, DOCS)


def test_a_manifest_resuming_past_the_corpus_or_missing_a_shard_is_refused(tmp_path, monkeypatch):
    """Of a manifest from before the inputs' SHA-256, whose rerun cannot tell an edited input apart."""
    corpus, out, manifest = interrupted_at_third_shard(tmp_path, monkeypatch)
    assert manifest["shards"] == 2 and manifest["document"] == 0 and manifest["skip"] == 14  # DOCS[0] spans them
    (out / fineweb.MANIFEST).write_text(json.dumps(without_hashes(manifest)))
    rewrite_same_size(corpus, ["short"])
    with pytest.raises(fineweb.InputError, match=r"resumes 12 tokens past the end of"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert (out / "tiny_val_000000.npy").exists()  # the recorded shards stay
    os.remove(out / "tiny_train_000001.npy")
    with pytest.raises(fineweb.InputError, match="records 2 shards, but tiny_train_000001.npy is missing"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))


@pytest.mark.parametrize("progress, problem", [
    ({"complete": False, "shards": 1, "document": 10**12}, "document is 1,000,000,000,000 and skip 0, but its shards "
                                                           "hold 7 tokens and a document is at least one"),
    ({"document": 10**12, "documents": 10**12}, "document is 1,000,000,000,000 and skip 0, but its shards hold"),
    ({"tokens": 10**15}, "tokens is 1,000,000,000,000,000, but"),
])
def test_a_manifest_claiming_more_than_its_shards_hold_is_one_line_touching_nothing(tmp_path, capsys, progress,
                                                                                  problem):
    corpus, out, manifest = sharded_docs(tmp_path)
    (out / fineweb.MANIFEST).write_text(json.dumps({**manifest, **progress}))
    before = {name: (out / name).read_bytes() for name in listdir(out)}
    assert fineweb.main(["--input", corpus, "--output_dir", str(out), "--prefix", "tiny", "--shard_size", "7",
                         "--num_proc", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1  # nothing resumed, nor complete
    assert captured.err.startswith(f"fineweb.py: error: {out / fineweb.MANIFEST}: unreadable manifest "
                                   f"(impossible progress: {problem}")
    assert captured.err.endswith(f"; delete {out} and rerun\n")
    assert {name: (out / name).read_bytes() for name in listdir(out)} == before


def test_a_manifest_claiming_more_shards_than_there_are_files_is_one_line_at_once(tmp_path):
    """10**12 shards: counted through, the missing ones filled the memory (a MemoryError traceback)."""
    corpus, out, manifest = sharded_docs(tmp_path)
    n = len(listdir(out)) - 1  # but the manifest
    (out / fineweb.MANIFEST).write_text(json.dumps({**manifest, "complete": False, "shards": 10**12}))
    before = {name: (out / name).read_bytes() for name in listdir(out)}
    result = run_bounded("fineweb.py", "--input", corpus, "--output_dir", out, "--prefix", "tiny", "--shard_size", 7,
                         "--num_proc", 1)
    one_line_error(result, f"records 1,000,000,000,000 shards, but tiny_train_{n:06d}.npy is missing")
    assert {name: (out / name).read_bytes() for name in listdir(out)} == before


def test_num_proc_past_the_cores_is_capped_at_them_with_a_line(capsys):
    args = fineweb.parse_args(["--input", "corpus.jsonl", "--num_proc", "100000"])
    assert args.num_proc == os.cpu_count()
    assert capsys.readouterr().err == (f"fineweb.py: --num_proc 100,000 is more than this machine's {os.cpu_count()} "
                                       f"cores: tokenizing in {os.cpu_count()} processes\n")
    assert fineweb.parse_args(["--input", "corpus.jsonl", "--num_proc", str(os.cpu_count())]).num_proc == os.cpu_count()
    assert capsys.readouterr().err == ""


def test_a_manifest_resuming_at_a_document_past_the_corpus_is_refused(tmp_path, monkeypatch):
    corpus, out, manifest = interrupted_at_third_shard(tmp_path, monkeypatch)
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 1)  # the interrupted run's chunks: its resume point is at a document
    rewrite_same_size(corpus, DOCS[:1])
    out.joinpath(fineweb.MANIFEST).write_text(json.dumps(without_hashes(manifest) | {"shards": 1, "document": 1,
                                                                                     "skip": 0}))
    os.remove(out / "tiny_train_000001.npy")
    with pytest.raises(fineweb.InputError, match=rf"resumes at document 1 past the end of {corpus}: "):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
    assert sorted(listdir(out)) == sorted([fineweb.MANIFEST, "tiny_val_000000.npy"])  # the recorded shard stays


def test_counters_that_disagree_with_the_shards_are_refused_touching_nothing(tmp_path, monkeypatch):
    """A resume from counters that lie would tokenize the wrong documents into the next shards."""
    corpus, out, manifest = interrupted_at_third_shard(tmp_path, monkeypatch)
    for lie, problem in [
        ({"skip": 0}, "document is 0, but its shards hold 1 documents before its resume point"),  # from the start again
        ({"skip": 3}, "its resume point, 3 tokens before the end of its shards, is not where a document starts"),
        ({"shards": 1, "document": 2, "skip": 0}, "document is 2, but its shards hold 1 documents"),
    ]:
        (out / fineweb.MANIFEST).write_text(json.dumps(manifest | lie))
        before = {name: (out / name).read_bytes() for name in listdir(out)}
        with pytest.raises(fineweb.InputError, match=rf"unreadable manifest \({re.escape(problem)}"):
            fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))
        assert {name: (out / name).read_bytes() for name in listdir(out)} == before
    (out / fineweb.MANIFEST).write_text(json.dumps(manifest))
    fineweb.write_shard(str(out / "tiny_train_000001.npy"), np.full(5, EOT))
    with pytest.raises(fineweb.InputError, match=r"unreadable manifest \(tiny_train_000001.npy holds 5 tokens, not 7\)"):
        fineweb.shard_local_files(corpus, ShardingJob(str(out), "tiny", 7))


def test_a_shard_the_manifest_does_not_list_is_refused(tmp_path):
    corpus, out, manifest = sharded_docs(tmp_path)
    extra = out / shard_name("tiny", "train", 99)
    fineweb.write_shard(str(extra), np.full(7, EOT))
    result = run_cli("--input", corpus, "--output_dir", out, "--prefix", "tiny", "--shard_size", 7)
    one_line_error(result, f"{out} holds tiny_train_000099.npy, which its {fineweb.MANIFEST} does not list; training "
                           f"would read it too")
    assert extra.exists() and json.loads((out / fineweb.MANIFEST).read_text()) == manifest


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "huge"])
def test_a_manifest_that_is_not_a_regular_file_or_too_large_is_one_line(tmp_path, kind):
    corpus, out, _ = sharded_docs(tmp_path)
    os.remove(out / fineweb.MANIFEST)
    target = never_ending_inputs(tmp_path)[kind]
    os.symlink(target, out / fineweb.MANIFEST) if kind == "/dev/zero" else os.rename(target, out / fineweb.MANIFEST)
    result = run_bounded("fineweb.py", "--input", corpus, "--output_dir", out, "--prefix", "tiny", "--shard_size", 7)
    problem = {"/dev/zero": "a device, not a regular file", "fifo": "a FIFO, not a regular file",
               "huge": f"more than {fineweb.MAX_MANIFEST_CHARS:,} characters"}[kind]
    one_line_error(result, f"{out / fineweb.MANIFEST}: unreadable manifest ({problem})")
