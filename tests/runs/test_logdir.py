"""logdir.py: nothing a run writes in its log_dir follows a link; a start-over killed at any point
loses nothing; only a checkpoint its reader accepts, not a name, makes an earlier run removable;
which checkpoint is later is what they record (run and step), whatever their files' times; an
earlier run that a run trains in is never removed; --resume auto passes over no checkpoint in
silence; and a run whose log_dir is removed under it stops, writing nothing into what is there now."""
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from contextlib import contextmanager

import pytest
import torch

import train_gpt2
from gpt2repro.common.atomic import claim_directory
from gpt2repro.runs import checkpoint_files, logdir
from helpers import REPO
from helpers.files import WritesAFile, listdir
from helpers.processes import run_ranks, said_errors
from helpers.runs import TINY, error_of, read_log, train

RUN = ["--total_batch_size", "256", "-B", "8", "--max_steps", "4", "--checkpoint_interval", "2"]
EARLIER = "previous_20260101-000000"  # a run that an earlier start-over moved aside
SECOND = 10**9  # in ns
RUN_A, RUN_B = "a" * 32, "b" * 32  # two runs' identities


def fake_checkpoint(path, step, saved, run=None):
    """A one-file checkpoint that loads as one (load_checkpoint), with no weights, of the run whose
    identity is run (None: written before runs had one), its file saved at second `saved` of the
    epoch: where only the times order checkpoints, or where they mislead."""
    torch.save({"model": {}, "config": {}, "step": step, **({"run": run} if run else {})}, path)
    os.utime(path, ns=(saved * SECOND, saved * SECOND))
    return path


def two_runs(log_dir):
    """log_dir as a second run leaves it: the earlier run in EARLIER (a step 12 checkpoint, saved
    first), the current one (steps 4 and 8, its log, a dashboard) in log_dir. Returns the current
    run's files, {path within the run: bytes}."""
    (log_dir / EARLIER).mkdir(parents=True)
    fake_checkpoint(log_dir / EARLIER / "ckpt_000012.pt", 12, saved=1, run=RUN_A)
    (log_dir / EARLIER / "log.jsonl").write_text('{"step": 11, "tokens": 0}\n')
    fake_checkpoint(log_dir / "ckpt_000004.pt", 4, saved=2, run=RUN_B)
    fake_checkpoint(log_dir / "ckpt_000008.pt", 8, saved=3, run=RUN_B)
    (log_dir / "log.jsonl").write_text('{"step": 7, "tokens": 0}\n')
    (log_dir / "tensorboard").mkdir()
    (log_dir / "tensorboard" / "events").write_text("the current run's dashboard")
    return {name: (log_dir / name).read_bytes() for name in ("ckpt_000004.pt", "ckpt_000008.pt", "log.jsonl",
                                                              "tensorboard/events")}


class Killed(BaseException):
    """A kill -9, as the code under test meets it: nothing after it runs, no handler sees it."""


@contextmanager
def killed_at(point, monkeypatch):
    """Every call that changes a directory (rename, mkdir, rmdir, unlink) counted from 0: the one
    numbered point raises Killed instead of running. Yields the count so far."""
    calls = [0]

    def counted(change):
        def call(*args, **kwargs):
            if calls[0] == point:
                raise Killed
            calls[0] += 1
            return change(*args, **kwargs)
        return call
    with monkeypatch.context() as patch:
        for name in ("rename", "mkdir", "rmdir", "unlink", "remove"):
            patch.setattr(os, name, counted(getattr(os, name)))
        yield calls


def tidied(log_dir, resume):
    """What the trainer's start does to log_dir before it builds anything: its lines, and (under
    --resume auto) the checkpoint it resumes, (path, step) or None."""
    lines = []
    logdir.tidy_log_dir(str(log_dir), resume, lines.append, True)
    logdir.check_log_dir(str(log_dir), resume, "scratch", lines.append, True)
    found = checkpoint_files.find_resume(resume, str(log_dir))
    return lines, found and (found[0], found[1]["step"])


def places_of(log_dir, name, data):
    """Where in log_dir (itself, a previous_* but EARLIER, or the unfinished move's folder) the file
    name lies with these bytes."""
    places = [log_dir, log_dir / logdir.MOVING, *(log_dir / p for p in listdir(log_dir)
                                                  if p.startswith("previous_") and p != EARLIER)]
    return [place for place in places if (place / name).is_file() and (place / name).read_bytes() == data]


def test_a_start_over_killed_at_any_point_loses_nothing_and_resume_auto_takes_the_newest(tmp_path, monkeypatch):
    """--resume none, SIGKILLed before each of its changes to log_dir in turn. After each: every
    file of the run being moved aside is whole, in one place; a restart under --resume auto
    resumes step 8, the newest, or (the move complete, only the earlier runs' removal cut short)
    starts afresh and names step 8's checkpoint where it now lies; a second start-over keeps it."""
    point = 0
    while True:
        log_dir = tmp_path / f"killed_at_{point}"
        run = two_runs(log_dir)
        with killed_at(point, monkeypatch):
            try:
                logdir.tidy_log_dir(str(log_dir), "none", print, True)
                break  # no change left to kill it at
            except Killed:
                pass
        assert all(len(places_of(log_dir, name, data)) == 1 for name, data in run.items()), point
        for resume in ("auto", "none"):
            shutil.copytree(log_dir, tmp_path / resume, symlinks=True)  # with the files' times
        lines, found = tidied(tmp_path / "auto", "auto")
        if found:
            assert found == (str(tmp_path / "auto" / "ckpt_000008.pt"), 8), point
        else:
            [aside] = places_of(tmp_path / "auto", "ckpt_000008.pt", run["ckpt_000008.pt"])
            assert aside.name.startswith("previous_") and f"--resume {aside / 'ckpt_000008.pt'} resumes it" in lines[-1]
        tidied(tmp_path / "none", "none")
        [kept] = places_of(tmp_path / "none", "ckpt_000008.pt", run["ckpt_000008.pt"])
        assert kept.name.startswith("previous_"), point
        shutil.rmtree(tmp_path / "auto")
        shutil.rmtree(tmp_path / "none")
        point += 1
    assert point >= 7  # made the folder, moved 4 names into it, renamed it, removed the earlier run
    [aside] = listdir(log_dir)
    assert aside.startswith("previous_") and aside != EARLIER


@pytest.mark.parametrize("runs, times", [((None, None), (2, 3)), ((RUN_A, RUN_A), (3, 2))],
                         ids=["without identities, by time", "one run's, by step, saved in reverse"])
def test_a_checkpoint_left_aside_newer_than_log_dirs_is_named_by_resume_auto_and_kept_by_a_start_over(
        tmp_path, capsys, runs, times):
    """As a start-over killed mid-move before this rule left it, or files moved by hand (mkdir
    previous_...; mv ckpt_000008.pt into it): --resume auto would resume step 4 while a later
    checkpoint of its run lies aside. Of one run, the later is the later step, whatever the times;
    checkpoints written before runs had an identity are ordered by their times, as then."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    fake_checkpoint(log_dir / "ckpt_000004.pt", 4, saved=times[0], run=runs[0])
    (log_dir / EARLIER).mkdir()
    newer = fake_checkpoint(log_dir / EARLIER / "ckpt_000008.pt", 8, saved=times[1], run=runs[1])
    message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir)
    assert message == (f"error: {newer} is a later checkpoint of the run of {log_dir / 'ckpt_000004.pt'}, the newest "
                       f"checkpoint in {log_dir}, which --resume auto would take (a start-over cut short, a copy put "
                       f"back?): name the one to resume with --resume PATH")
    error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir, "--resume", "none")  # no shards, once moved
    assert newer.is_file() and checkpoint_files.list_checkpoints(str(log_dir)) == []
    [aside] = [name for name in listdir(log_dir) if name.startswith("previous_") and name != EARLIER]
    assert listdir(log_dir / aside) == ["ckpt_000004.pt"]


@pytest.mark.parametrize("times", [(1, 2), (2, 2)], ids=["copied back: a newer time", "restored without times"])
def test_a_start_over_keeps_the_earlier_run_that_holds_a_later_step_of_the_moved_one_whatever_the_times(tmp_path,
                                                                                                         times):
    """The run moved aside is a copy of an older checkpoint of the earlier run put back in log_dir
    (cp gives it the time of the copy, as a clock ahead does), or both come from a backup restored
    without their times: by the times, the earlier run, which holds step 8, was removable."""
    log_dir = tmp_path / "log"
    (log_dir / EARLIER).mkdir(parents=True)
    for step in (4, 8):
        fake_checkpoint(log_dir / EARLIER / f"ckpt_{step:06d}.pt", step, saved=times[0], run=RUN_A)
    shutil.copy(log_dir / EARLIER / "ckpt_000004.pt", log_dir / "ckpt_000004.pt")
    os.utime(log_dir / "ckpt_000004.pt", ns=(times[1] * SECOND, times[1] * SECOND))
    lines, _ = tidied(log_dir, "none")
    [aside] = [name for name in listdir(log_dir) if name.startswith("previous_") and name != EARLIER]
    assert lines == [f"--resume none: moved the earlier run ({logdir.megabytes(log_dir / aside)}) to {log_dir / aside}; "
                     f"kept {log_dir / EARLIER} ({logdir.megabytes(log_dir / EARLIER)}): it holds ckpt_000008.pt, a "
                     f"later checkpoint of the moved run than its newest, ckpt_000004.pt"]
    assert sorted(listdir(log_dir / EARLIER)) == ["ckpt_000004.pt", "ckpt_000008.pt"]


@pytest.mark.parametrize("aside", [RUN_A, RUN_B], ids=["another run's", "a later step of the same run"])
def test_resume_auto_in_a_log_dir_copied_with_cp_r_takes_what_the_records_say(tmp_path, capsys, aside):
    """cp -r gives each file the time of its copy, in the order it copies them: here step 4 after
    step 8, and the earlier run's step 12 last. Another run's checkpoint aside is older (its run was
    moved aside before this one began): --resume auto takes step 8. A later checkpoint of log_dir's
    run aside is named beside step 8, the one --resume auto would take."""
    log_dir = tmp_path / "copy"
    (log_dir / EARLIER).mkdir(parents=True)
    fake_checkpoint(log_dir / "ckpt_000008.pt", 8, saved=1, run=RUN_B)
    fake_checkpoint(log_dir / "ckpt_000004.pt", 4, saved=2, run=RUN_B)
    later = fake_checkpoint(log_dir / EARLIER / "ckpt_000012.pt", 12, saved=3, run=aside)
    if aside == RUN_A:
        assert tidied(log_dir, "auto") == ([], (str(log_dir / "ckpt_000008.pt"), 8))
        return
    message = error_of(capsys, "--data_dir", tmp_path / "none", "--log_dir", log_dir)
    assert message.startswith(f"error: {later} is a later checkpoint of the run of {log_dir / 'ckpt_000008.pt'}, ")


@pytest.mark.slow
def test_each_checkpoint_records_its_runs_identity_kept_by_a_resume_new_at_a_fresh_start(shards, tmp_path):
    """A run's identity is made at its start and kept by every resume of it; a start-over, or a
    resume of a checkpoint written before runs had one, starts a run of a new one."""
    def run_of(path):
        return checkpoint_files.read_saved(str(path)).run

    log_dir = tmp_path / "log"
    train(shards, log_dir, *RUN)
    first = run_of(log_dir / "ckpt_000004.pt")
    assert run_of(log_dir / "ckpt_000002.pt") == first and checkpoint_files.RUN_IDENTITY.fullmatch(first)
    train(shards, log_dir, *RUN, "--max_steps", "2", "--resume", "none")
    train(shards, log_dir, *RUN)  # --resume auto, to step 4
    second = run_of(log_dir / "ckpt_000002.pt")
    assert run_of(log_dir / "ckpt_000004.pt") == second != first
    state = torch.load(log_dir / "ckpt_000002.pt", weights_only=True)
    del state["run"]  # as written before runs had an identity
    torch.save(state, tmp_path / "old.pt")
    train(shards, tmp_path / "resumed", *RUN, "--resume", tmp_path / "old.pt")
    assert run_of(tmp_path / "resumed" / "ckpt_000004.pt") not in (first, second, None)


def test_an_earlier_run_that_a_run_trains_in_is_never_removed(tmp_path):
    """A run resumed in a previous_* folder holds its lock: a start-over in log_dir keeps that
    folder, which it would otherwise remove (another run's, and older), and says why."""
    log_dir = tmp_path / "log"
    (log_dir / EARLIER).mkdir(parents=True)
    fake_checkpoint(log_dir / EARLIER / "ckpt_000004.pt", 4, saved=1, run=RUN_A)
    fake_checkpoint(log_dir / "ckpt_000008.pt", 8, saved=2, run=RUN_B)
    with claim_directory(str(log_dir / EARLIER), "train_gpt2.py run"):  # the run training there
        lines, _ = tidied(log_dir, "none")
        [aside] = [name for name in listdir(log_dir) if name.startswith("previous_") and name != EARLIER]
        assert lines == [f"--resume none: moved the earlier run ({logdir.megabytes(log_dir / aside)}) to "
                         f"{log_dir / aside}; kept {log_dir / EARLIER} ({logdir.megabytes(log_dir / EARLIER)}): a run "
                         f"is training in it (pid {os.getpid()})"]
        assert listdir(log_dir / EARLIER) == ["ckpt_000004.pt"]
    fake_checkpoint(log_dir / "ckpt_000002.pt", 2, saved=3, run="c" * 32)
    tidied(log_dir, "none")  # once that run has ended, a start-over removes it
    assert not (log_dir / EARLIER).exists()


def junk_zip(path, marker):
    """A zip that holds torch.save's names, archive/data.pkl and archive/version, and in data.pkl a
    pickle that would create marker."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(WritesAFile(str(marker)), protocol=2))
        archive.writestr("archive/version", "3\n")


def zero_data_pkl(path):
    """path, torch.save's zip, with the bytes of its data.pkl zeroed in place."""
    with zipfile.ZipFile(path) as archive:
        [info] = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_length + extra_length)
        f.write(bytes(info.compress_size))


@pytest.mark.parametrize("kind", ["empty file", "empty folder", "link to a checkpoint", "truncated copy", "junk zip",
                                  "zeroed data.pkl", "model without a step"])
def test_only_a_real_checkpoint_makes_the_earlier_run_removable(tmp_path, kind):
    """A run that left only something named as a checkpoint, which its reader refuses (or, without
    a step, takes for a model, not a run's checkpoint), is a run without one: the start-over keeps
    the earlier run whose checkpoint is real. The junk zip's pickle never runs."""
    log_dir = tmp_path / "log"
    (log_dir / EARLIER).mkdir(parents=True)
    real = fake_checkpoint(log_dir / EARLIER / "ckpt_000008.pt", 8, saved=1)
    (log_dir / "log.jsonl").write_text("")
    named = log_dir / ("ckpt_000002" if kind == "empty folder" else "ckpt_000002.pt")
    if kind == "empty file":
        named.write_bytes(b"")
    elif kind == "empty folder":
        named.mkdir()
    elif kind == "link to a checkpoint":
        os.symlink(fake_checkpoint(tmp_path / "elsewhere.pt", 2, saved=2), named)
    elif kind == "truncated copy":
        named.write_bytes(fake_checkpoint(tmp_path / "whole.pt", 2, saved=2).read_bytes()[:-100])
    elif kind == "junk zip":
        junk_zip(named, tmp_path / "ran")
    elif kind == "zeroed data.pkl":
        zero_data_pkl(fake_checkpoint(named, 2, saved=2))
    else:
        torch.save({"model": {}, "config": {}}, named)
    assert checkpoint_files.named_checkpoints(str(log_dir)) == [str(named)] and checkpoint_files.list_checkpoints(str(log_dir)) == []
    lines, _ = tidied(log_dir, "none")
    [aside] = [name for name in listdir(log_dir) if name.startswith("previous_") and name != EARLIER]
    assert lines == [f"--resume none: moved the earlier run ({logdir.megabytes(log_dir / aside)}, no checkpoint) to "
                     f"{log_dir / aside}; kept {log_dir / EARLIER} ({logdir.megabytes(log_dir / EARLIER)}): a run "
                     f"without a checkpoint never replaces one with"]
    assert real.is_file() and not (tmp_path / "ran").exists()


def test_pruning_counts_only_real_checkpoints(tmp_path):
    """An empty ckpt_000012.pt newer than the run's checkpoints never costs the newest real one."""
    for step in (4, 8):
        fake_checkpoint(tmp_path / f"ckpt_{step:06d}.pt", step, saved=step)
    (tmp_path / "ckpt_000012.pt").write_bytes(b"")
    checkpoint_files.prune_checkpoints(str(tmp_path), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000008.pt", "ckpt_000012.pt"]


# ----------------------------------------------------------------------------- links

@pytest.mark.parametrize("name, expected", [
    ("log.jsonl", "a symbolic link, not the run's log"),
    ("tensorboard", "a symbolic link, not the run's TensorBoard folder"),
    ("ckpt_000004.pt", "a symbolic link, not a checkpoint the run may write over"),
])
def test_a_link_where_the_run_writes_is_refused_before_it_starts_and_never_written_through(shards, tmp_path, capsys,
                                                                                           name, expected):
    """Refused even where the run would not write there (no --tensorboard): it would, another time."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("the user's own\n")
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    os.symlink(outside if name == "tensorboard" else outside / "notes.txt", log_dir / name)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", log_dir, *RUN)
    assert message == f"error: {log_dir / name} is {expected}: move it out of --log_dir"
    assert os.listdir(outside) == ["notes.txt"] and (outside / "notes.txt").read_text() == "the user's own\n"


def test_a_log_linked_once_the_run_is_under_way_is_not_appended_through(tmp_path, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own\n")
    metrics = logdir.MetricsLog(str(tmp_path), keep_before=None, enabled=True)
    metrics.write(step=0, tokens=0)
    os.remove(tmp_path / "log.jsonl")
    os.symlink(outside, tmp_path / "log.jsonl")
    metrics.write(step=1, tokens=256)
    assert f"warning: could not append to {tmp_path / 'log.jsonl'}" in capsys.readouterr().err
    assert outside.read_text() == "the user's own\n"


# ----------------------------------------------------------------------------- a log_dir removed under a run

def lost_log_dir(log_dir):
    return (f"--log_dir {log_dir} was removed or replaced while the run was writing there (its .lock is not this "
            f"run's): stopped, writing nothing into what is there now")


SECOND_RUN = """
import os, sys
sys.path.insert(0, {repo!r})
from gpt2repro.common import atomic
os.makedirs({log_dir!r})
lock = atomic.claim_directory({log_dir!r}, "train_gpt2.py run")
print(flush=True)
input()
"""


@pytest.mark.parametrize("write", ["log line", "checkpoint"])
def test_a_run_whose_log_dir_is_removed_under_it_stops_at_its_next_write_and_writes_nothing_there(
        shards, tmp_path, capsys, monkeypatch, write):
    """rm -rf of log_dir under a running trainer, then a second run starting there, in a directory
    made anew that it holds the lock of: the first stops at its next write (step 3's log line, or
    step 2's checkpoint) in one line, and leaves the second's directory as it found it, though it
    made a log_dir of that name itself."""
    log_dir = tmp_path / "log"
    second = []
    real_log_step = train_gpt2.log_step

    def log_step(run, step, *args):
        real_log_step(run, step, *args)
        if step == (2 if write == "log line" else 1):
            shutil.rmtree(log_dir)
            second.append(subprocess.Popen([sys.executable, "-c", SECOND_RUN.format(repo=REPO, log_dir=str(log_dir))],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            second[0].stdout.readline()  # it holds the new log_dir's lock now
    monkeypatch.setattr(train_gpt2, "log_step", log_step)
    try:
        assert error_of(capsys, "--data_dir", shards, "--log_dir", log_dir, *RUN) == f"error: {lost_log_dir(log_dir)}"
        assert os.listdir(log_dir) == [".lock"] and (log_dir / ".lock").read_text() == f"{second[0].pid}\n"
    finally:
        for process in second:
            process.kill()
            process.wait()


REMOVED_ON_RANK_0 = """
import os, shutil, sys
sys.path.insert(0, {repo!r})
import train_gpt2
real_log_step = train_gpt2.log_step


def log_step(run, step, *args):
    real_log_step(run, step, *args)
    if step == 2 and os.environ["RANK"] == "0":  # rm -rf, and a second run's log in a directory made anew
        shutil.rmtree({log_dir!r})
        os.makedirs({log_dir!r})
        with open(os.path.join({log_dir!r}, "log.jsonl"), "w") as f:
            f.write({second!r})
train_gpt2.log_step = log_step
train_gpt2.main()
"""


@pytest.mark.slow
def test_on_two_ranks_a_log_dir_removed_under_the_run_stops_every_rank_in_one_line(shards, tmp_path):
    """Rank 0 alone writes in log_dir and finds it gone: it says so, naming itself, and rank 1,
    whose next collective then fails, stops with it, quietly."""
    log_dir, second = tmp_path / "log", '{"step": 0, "tokens": 0}\n'
    script = tmp_path / "removed_on_rank_0.py"
    script.write_text(REMOVED_ON_RANK_0.format(repo=REPO, log_dir=str(log_dir), second=second))
    result = run_ranks(script, *TINY, *RUN, "-B", "4", "--data_dir", shards, "--log_dir", log_dir, timeout=180)
    assert result.returncode == 1
    assert said_errors(result.stderr) == [f"error: rank 0: {lost_log_dir(log_dir)}"]
    assert os.listdir(log_dir) == ["log.jsonl"] and (log_dir / "log.jsonl").read_text() == second


# ----------------------------------------------------------------------------- checkpoints under other names

@pytest.mark.slow
def test_a_checkpoint_copied_in_as_ckpt_pt_is_named_by_resume_auto_with_how_to_resume_it(shards, tmp_path, capsys):
    train(shards, tmp_path / "run", *RUN)
    copy = tmp_path / "log" / "ckpt.pt"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "run" / "ckpt_000002.pt", copy)
    message = error_of(capsys, "--data_dir", shards, "--log_dir", copy.parent, *RUN)
    assert message == (f"error: {copy} is a checkpoint under a name that --resume auto does not take (ckpt_XXXXXX.pt, "
                       f"ckpt_XXXXXX/), and {copy.parent} holds none that it does: resume it with --resume {copy}, or "
                       f"move it out of --log_dir to start from step 0")
    train(shards, copy.parent, *RUN, "--resume", copy)
    assert f"resuming from {copy} at step 2" in capsys.readouterr().out
    assert [r["step"] for r in read_log(copy.parent) if "train_loss" in r] == [2, 3]
    train(shards, copy.parent, *RUN)  # --resume auto: its own checkpoints now, and a line on the other
    assert (f"note: {copy} is a checkpoint under a name that --resume auto does not take: --resume {copy} resumes it"
            in capsys.readouterr().out)


def test_a_sharded_checkpoint_under_another_name_is_named_but_not_the_run_it_starts_from(tmp_path):
    log_dir = tmp_path / "log"
    folder = log_dir / "step_2"
    with warnings.catch_warnings():  # DCP's, that it saves in one process, as meant
        warnings.simplefilter("ignore")
        checkpoint_files.save_dcp(str(folder), {}, {"model": {}, "config": {}, "step": 2})
    with pytest.raises(logdir.RunError, match=f"^{re.escape(str(folder))} is a checkpoint under a name that --resume"):
        tidied(log_dir, "auto")
    logdir.check_log_dir(str(log_dir), "auto", str(folder), print, True)  # --init_from it: nothing to say
    (folder / ".metadata").write_bytes(b"")  # a copy cut short: not a checkpoint
    assert tidied(log_dir, "auto") == ([], None)
