"""atomic.py: atomic_open syncs before it renames and replaces only a regular file (never a device,
a FIFO, a directory or a link, whatever script writes it), check_writable leaves nothing behind, no
writer's temporary file is anything but its own (a link planted at its name is never written
through), and claim_directory keeps one writer per directory, as the scripts use it. Faults that must be one
line: a second trainer on a log_dir or a second fineweb.py on an output_dir is refused, naming
the first; the kernel frees the lock however the first ends. A .lock that is not a regular file
we can write (a symlink, a directory, a FIFO, on a read-only file system) is refused and left as
it was. Shards that are not regular files or shrink under the loader, an export onto a full disk
and a second Ctrl-C stop in one line."""
import builtins
import errno
import json
import os
import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import fineweb
import train_gpt2
from gpt2repro.benchmark import step_profile
from gpt2repro.common import atomic
from gpt2repro.common.atomic import LOCK_NAME, claim_directory
from gpt2repro.lm.data import Shard, ShardError, write_shard
from gpt2repro.runs import checkpoint_files, logdir
from helpers import REPO
from helpers.files import DOCS, listdir, write_docs_jsonl
from helpers.limits import file_size_limit
from helpers.models import make_tiny_gpt, save_as_checkpoint
from helpers.processes import exit_message
from helpers.runs import TINY, error_of, train


def test_a_second_trainer_on_a_log_dir_is_refused_naming_the_first(tmp_path, capsys):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "log.jsonl").write_text('{"step": 0, "tokens": 0, "train_loss": 5.0}\n')
    with claim_directory(str(log_dir), "train_gpt2.py run"):  # the first run, alive
        message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir, "--resume", "none")
    assert message == (f"error: --log_dir {log_dir} is in use by another train_gpt2.py run (pid {os.getpid()}): two "
                       f"would interleave their files; wait for it to end, or choose another directory")
    assert sorted(listdir(log_dir)) == ["log.jsonl"]  # not moved aside, not rewritten
    assert (log_dir / "log.jsonl").read_text().startswith('{"step": 0')


def test_a_second_fineweb_on_an_output_dir_is_refused_and_writes_nothing(tmp_path):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    with claim_directory(str(out), "fineweb.py"):
        with pytest.raises(fineweb.InputError, match=rf"in use by another fineweb.py \(pid {os.getpid()}\)"):
            fineweb.shard_local_files(corpus, fineweb.ShardingJob(str(out), "tiny", 7))
    assert listdir(out) == []
    fineweb.shard_local_files(corpus, fineweb.ShardingJob(str(out), "tiny", 7))  # free once the first has let go


def test_the_lock_dies_with_its_holder_even_by_sigkill(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {REPO!r}); from gpt2repro.common import atomic; "
                               f"lock = atomic.claim_directory({str(tmp_path)!r}, 'x'); print(flush=True); input()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()  # it holds the lock now
    with pytest.raises(Exception, match=f"pid {holder.pid}"):
        claim_directory(str(tmp_path), "x")
    holder.kill()
    holder.wait()
    claim_directory(str(tmp_path), "y").close()
    assert (tmp_path / LOCK_NAME).exists()


NOTES = b"notes that a lock must never overwrite\n"
NOT_A_FILE = {"symlink": "a symbolic link", "dangling symlink": "a symbolic link", "directory": "a directory",
              "FIFO": "a FIFO"}


def make_bad_lock(directory, kind, tmp_path):
    """directory/.lock made a kind of NOT_A_FILE; returns a snapshot of it and what it points at,
    to compare with afterwards."""
    lock, target = directory / LOCK_NAME, tmp_path / "notes.txt"
    target.write_bytes(NOTES)
    if kind == "symlink":
        lock.symlink_to(target)
    elif kind == "dangling symlink":  # opening it with O_CREAT would create its target
        lock.symlink_to(tmp_path / "created_through_the_link")
    elif kind == "directory":
        lock.mkdir()
        (lock / "kept").write_bytes(NOTES)
    else:
        os.mkfifo(lock)
    return lock_snapshot(directory, tmp_path)


def lock_snapshot(directory, tmp_path):
    lock = directory / LOCK_NAME
    inside = sorted(os.listdir(lock)) if lock.is_dir() and not lock.is_symlink() else None
    return (os.lstat(lock).st_mode, lock.is_symlink() and os.readlink(lock), inside,
            (tmp_path / "notes.txt").read_bytes(), (tmp_path / "created_through_the_link").exists())


@pytest.mark.parametrize("kind", NOT_A_FILE)
def test_a_lock_that_is_not_a_regular_file_stops_the_trainer_in_one_line_touching_nothing(tmp_path, capsys, kind):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "log.jsonl").write_text('{"step": 0, "tokens": 0, "train_loss": 5.0}\n')
    before = make_bad_lock(log_dir, kind, tmp_path)
    message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir, "--resume", "none")
    assert message == (f"error: --log_dir {log_dir}: its lock file .lock is {NOT_A_FILE[kind]}, not a regular file; "
                       f"move it away, or choose another directory")
    assert lock_snapshot(log_dir, tmp_path) == before and (tmp_path / "notes.txt").read_bytes() == NOTES
    assert sorted(listdir(log_dir)) == ["log.jsonl"]  # not moved aside


@pytest.mark.parametrize("kind", NOT_A_FILE)
def test_a_lock_that_is_not_a_regular_file_stops_fineweb_in_one_line_touching_nothing(tmp_path, capsys, kind):
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    before = make_bad_lock(out, kind, tmp_path)
    assert fineweb.main(["--input", corpus, "--output_dir", str(out), "--shard_size", "7", "--num_proc", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (f"fineweb.py: error: {out}: its lock file .lock is {NOT_A_FILE[kind]}, "
                                                   f"not a regular file; move it away, or choose another directory\n")
    assert lock_snapshot(out, tmp_path) == before and (tmp_path / "notes.txt").read_bytes() == NOTES
    assert listdir(out) == []


def refuse_the_lock(monkeypatch, code):
    """Opening any .lock fails with code, as the kernel fails it on a read-only file system
    (EROFS) or in a directory we may not write (EACCES), whichever call opens it; as root, the
    tests cannot meet EACCES for real."""
    def refusing(opener):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.path.basename(file) == LOCK_NAME:
                raise OSError(code, os.strerror(code), os.fspath(file))
            return opener(file, *args, **kwargs)
        return open_
    monkeypatch.setattr(os, "open", refusing(os.open))
    monkeypatch.setattr(builtins, "open", refusing(builtins.open))


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_log_dir_or_output_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, code):
    log_dir, out = tmp_path / "log", tmp_path / "out"
    log_dir.mkdir()
    out.mkdir()
    corpus = write_docs_jsonl(tmp_path / "c.jsonl", DOCS)
    refuse_the_lock(monkeypatch, code)
    message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir)
    assert message == f"error: --log_dir {log_dir}: cannot write its lock file .lock ({os.strerror(code)})"
    assert fineweb.main(["--input", corpus, "--output_dir", str(out), "--shard_size", "7", "--num_proc", "1"]) == 1
    assert capsys.readouterr().err == f"fineweb.py: error: {out}: cannot write its lock file .lock ({os.strerror(code)})\n"
    assert os.listdir(log_dir) == [] and os.listdir(out) == []


def test_a_lock_whose_pid_cannot_be_written_is_refused(tmp_path):
    claim = (f"import sys; sys.path.insert(0, {REPO!r}); from gpt2repro.common import atomic\n"
             f"try: atomic.claim_directory({str(tmp_path)!r}, 'x')\n"
             f"except Exception as e: print(type(e).__name__, e)")
    result = subprocess.run([sys.executable, "-c", claim], capture_output=True, text=True, timeout=60,
                            preexec_fn=file_size_limit(2))  # room for no pid: as on a full disk
    assert result.stdout == f"UnusableLock {tmp_path}: cannot write its lock file .lock (File too large)\n"


def test_a_shard_that_is_not_a_regular_file_or_shrinks_while_training_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "x_train_000001.npy")
    with pytest.raises(ShardError, match="x_train_000001.npy: not a regular file"):
        Shard(str(tmp_path / "x_train_000001.npy"))  # never opened: that would wait for a writer
    path = str(tmp_path / "x_train_000002.npy")
    write_shard(path, np.arange(1000, dtype=np.uint16))
    shard = Shard(path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ShardError, match=r"truncated while training: 950 of 1000 tokens at position 0"):
        shard.read(0, 1000)


@pytest.mark.slow
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    checkpoint = save_as_checkpoint(make_tiny_gpt(), tmp_path / "tiny.pt")
    out = tmp_path / "exports"
    out.mkdir()
    result = subprocess.run([sys.executable, os.path.join(REPO, "export_hf.py"), checkpoint, out / "hf"],
                            capture_output=True, text=True, timeout=120, preexec_fn=file_size_limit(1 << 20))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"export_hf.py: error: exporting to {out / 'hf'}:") and "File too large" in line
    assert os.listdir(out) == []


def test_a_second_ctrl_c_is_one_line_and_exit_code_130(tmp_path, monkeypatch, capsys):
    def interrupted_again(args):
        raise KeyboardInterrupt  # what StopSignal raises on a second SIGINT
    monkeypatch.setattr(train_gpt2, "train", interrupted_again)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(TINY + ["--log_dir", str(tmp_path)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == ("error: interrupted again: stopped without a checkpoint; "
                                       "`--resume auto` continues from the newest\n")


def test_atomic_open_syncs_the_file_before_renaming_it(tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append((os.fstat(fd).st_size, os.path.exists(path)))
        real_fsync(fd)
    monkeypatch.setattr(atomic.os, "fsync", fsync)
    with atomic.atomic_open(path) as f:
        f.write(b"12345")
    assert synced == [(5, False)] and os.listdir(tmp_path) == ["f.bin"]


def test_check_writable_leaves_nothing_behind(tmp_path):
    path = tmp_path / "new" / "out.json"
    atomic.check_writable(str(path))
    assert os.listdir(tmp_path / "new") == []
    with pytest.raises(IsADirectoryError):
        atomic.check_writable(str(tmp_path / "new"))


OUTSIDE = "the user's own file, outside the run\n"


def planted(tmp_path, names, link):
    """At each of names, a link (symbolic or hard) to a file of the user's outside what is written;
    returns that file."""
    outside = tmp_path / "outside.txt"
    outside.write_text(OUTSIDE)
    for name in names:
        os.symlink(outside, name) if link == "symbolic" else os.link(outside, name)
    return outside


def old_temporary_names(path):
    """Where writers wrote before their temporary names were random: beside path, from the pid
    (atomic_open's and check_writable's; bench.py's trace, which torch writes NAME.tmp of)."""
    pid = os.getpid()
    return [f"{path}.tmp{pid}", f"{path}.partial{pid}", f"{path}.partial{pid}.tmp"]


def checkpoint(path):
    return checkpoint_files.save_checkpoint(path, {"step": 2}) and torch.load(path, weights_only=True) == {"step": 2}


def token_shard(path):
    write_shard(path, np.arange(1000))
    return Shard(path).read(0, 1000).tolist() == list(range(1000))


def manifest(path):
    fineweb.write_manifest(os.path.dirname(path), {"shards": 1})
    with open(path) as f:
        return json.load(f) == {"shards": 1}


def log_cut_back(path):
    """A run's start rewrites log.jsonl, without the half line a killed run left."""
    with open(path, "w") as f:
        f.write('{"step": 0}\n{"st')
    logdir.MetricsLog(os.path.dirname(path), keep_before=None, enabled=True)
    with open(path) as f:
        return f.read() == '{"step": 0}\n'


def json_results(path):
    """sample.py's, hellaswag.py's, bench.py's --json and checkpoint.py's OUT: checked writable
    before the work, written after it."""
    atomic.check_writable(path)
    with atomic.atomic_open(path, "w") as f:
        json.dump({"samples": []}, f)
    with open(path) as f:
        return json.load(f) == {"samples": []}


def trace(path):
    with torch.profiler.profile() as prof:
        torch.ones(3).add(1)
    return step_profile.export_trace(prof, path) is None and os.path.getsize(path) > 0


# Each writer that goes through a temporary name, by what it writes: writes path as its script does,
# and returns whether path then holds what it wrote.
WRITERS = {"checkpoint": checkpoint, "token shard": token_shard, "fineweb.py's manifest": manifest,
           "log.jsonl": log_cut_back, "--json": json_results, "bench.py's trace": trace}
NAMES = {"fineweb.py's manifest": fineweb.MANIFEST, "log.jsonl": "log.jsonl"}  # else any name


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("writer", WRITERS)
def test_no_writer_writes_through_a_link_planted_at_its_temporary_name(tmp_path, writer, link):
    """Links at every name the temporary files once had (from the pid: a shell's `exec` gives its $$
    to the script) are neither written through nor in the way: the write succeeds, the user's file
    is as it was, and the links are left as they were."""
    out = tmp_path / "out"
    out.mkdir()
    path = str(out / NAMES.get(writer, "output"))
    names = old_temporary_names(path)
    outside = planted(tmp_path, names, link)
    assert WRITERS[writer](path)
    assert outside.read_text() == OUTSIDE
    assert sorted(os.listdir(out)) == sorted(os.path.basename(name) for name in [path, *names])


def test_a_temporary_name_taken_already_is_passed_over_never_written_through(tmp_path, monkeypatch):
    """Were the random name guessed and a link planted there first, it is not written through: the
    writer takes another; and where every try meets one, it writes nothing."""
    path = tmp_path / "out.json"
    taken = [f"{path}.tmp-symbolic", f"{path}.tmp-hard"]
    outside = planted(tmp_path, taken[:1], "symbolic")
    os.link(outside, taken[1])
    names = iter([*taken, f"{path}.tmp-free", *taken, f"{path}.tmp-free"])
    monkeypatch.setattr(atomic, "temporary_path", lambda path: next(names))
    atomic.check_writable(str(path))
    with atomic.atomic_open(str(path), "w") as f:
        f.write("results")
    assert path.read_text() == "results" and outside.read_text() == OUTSIDE
    monkeypatch.setattr(atomic, "temporary_path", lambda path: taken[1])
    with pytest.raises(FileExistsError, match="no free temporary name beside it in 10 tries"):
        with atomic.atomic_open(str(path), "w") as f:
            f.write("other results")
    with pytest.raises(FileExistsError):
        atomic.check_writable(str(path))
    assert path.read_text() == "results" and outside.read_text() == OUTSIDE
    assert sorted(os.listdir(tmp_path)) == sorted(["out.json", "outside.txt", *(os.path.basename(t) for t in taken)])


def test_temporary_names_are_random_and_those_of_killed_saves_are_tidied_away(tmp_path):
    path = str(tmp_path / "ckpt_000002.pt")
    names = {atomic.temporary_path(path) for _ in range(1000)}
    assert len(names) == 1000 and all(re.fullmatch(rf"{re.escape(path)}\.tmp[0-9a-f]{{16}}", name) for name in names)
    tmp, fd = atomic.create_temporary(path)  # as a save killed mid-write leaves it
    os.close(fd)
    checkpoint_files.remove_unfinished(str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_sample_json_is_not_written_through_a_link_planted_at_the_shells_pid(tmp_path):
    """As the issue's attacker did: bash -c 'ln -s OUTSIDE out.json.tmp$$; exec python sample.py ...'."""
    checkpoint = save_as_checkpoint(make_tiny_gpt(), tmp_path / "tiny.pt")
    outside = planted(tmp_path, [], "symbolic")
    script = (f"ln -s {outside} out.json.tmp$$ && exec {sys.executable} {REPO}/sample.py --model {checkpoint} "
              f"--device cpu --max_new_tokens 5 --num_return_sequences 1 --json out.json")
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert outside.read_text() == OUTSIDE and len(json.loads((tmp_path / "out.json").read_text())["results"]) == 1


@pytest.mark.slow
def test_the_trainers_log_and_checkpoints_are_not_written_through_hard_links_planted_at_their_pid(shards, tmp_path,
                                                                                                  monkeypatch):
    """Hard links at log.jsonl.tmp<pid> (before the run: its start cuts the log back) and at
    ckpt_000002.pt.tmp<pid> (once under way: its start removes what killed saves left): the user's
    files never become the run's log or checkpoint."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    outside = planted(tmp_path, [f"{log_dir / 'log.jsonl'}.tmp{os.getpid()}"], "hard")
    real_log_step = train_gpt2.log_step

    def log_step(run, step, *args):
        real_log_step(run, step, *args)
        if step == 1:
            os.link(outside, f"{log_dir / 'ckpt_000002.pt'}.tmp{os.getpid()}")
    monkeypatch.setattr(train_gpt2, "log_step", log_step)
    records = train(shards, log_dir, "--total_batch_size", "256", "-B", "8", "--max_steps", "2")
    assert [r["step"] for r in records] == [0, 1] and outside.read_text() == OUTSIDE
    assert checkpoint_files.list_checkpoints(str(log_dir)) == [str(log_dir / "ckpt_000002.pt")]


def not_a_regular_file(tmp_path, kind):
    """tmp_path/out.json made a file of kind that a rename onto it would replace: a character
    device (a twin of /dev/null: mknod needs root, which CI has), a FIFO, a directory, or a
    symbolic link to a regular file."""
    path = tmp_path / "out.json"
    if kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device needs root")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "target").write_text("kept")
        path.symlink_to(tmp_path / "target")
    return str(path)


def file_type(path):
    return stat.S_IFMT(os.lstat(path).st_mode)


KINDS = ["device", "FIFO", "directory", "symbolic link"]


@pytest.mark.parametrize("kind", KINDS)
def test_atomic_open_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    path = not_a_regular_file(tmp_path, kind)
    before = file_type(path)
    files = sorted(os.listdir(tmp_path))
    with pytest.raises(OSError, match=f"a {kind}, not a regular file"):
        with atomic.atomic_open(path) as f:
            f.write(b"results")
    with pytest.raises(OSError, match=f"a {kind}, not a regular file"):
        atomic.check_writable(path)
    assert file_type(path) == before and sorted(os.listdir(tmp_path)) == files
    if kind == "symbolic link":
        assert (tmp_path / "target").read_text() == "kept"


@pytest.mark.slow
def test_no_script_replaces_a_device_named_as_its_output(tmp_path, capsys):
    """--json /dev/null, as a user might write to discard the results, is refused before any work:
    replaced by a file, /dev/null would be broken for the whole machine."""
    import checkpoint as converter
    import hellaswag
    import sample
    from gpt2repro.runs import checkpoint_files
    device = not_a_regular_file(tmp_path, "device")
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / checkpoint_files.TRAIN_STATE).write_bytes(b"")
    scripts = {"sample.py": (sample.main, ["--prompt", "x", "--json", device]),
               "hellaswag.py": (hellaswag.main, ["--json", device]),
               "checkpoint.py": (converter.main, [tmp_path / "sharded", device])}
    for script, (main, argv) in scripts.items():
        flag = "out" if script == "checkpoint.py" else "--json"
        assert exit_message(capsys, main, *argv) == \
            f"{script}: error: {flag} {device}: cannot write there (a device, not a regular file)"
        assert file_type(device) == stat.S_IFCHR
    result = subprocess.run([sys.executable, "bench.py", "--parts", "tokenize", "--quick", "--json", device],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"bench.py: error: --json {device}: cannot write there (a device, not a regular file)"]
    assert file_type(device) == stat.S_IFCHR
