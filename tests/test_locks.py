"""One writer per directory, and faults that must be one line: a second trainer on a log_dir or a
second fineweb.py on an output_dir is refused, naming the first; the kernel frees the lock
however the first ends. Shards that are not regular files or shrink under the loader, an
export onto a full disk and a second Ctrl-C stop in one line."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fineweb
import train_gpt2
from atomic import LOCK_NAME, claim_directory
from conftest import REPO, file_size_limit, listdir, make_tiny_gpt, save_as_checkpoint
from data import Shard, ShardError, write_shard
from test_fineweb import DOCS, write_jsonl
from test_train import TINY, error_of


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
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    with claim_directory(str(out), "fineweb.py"):
        with pytest.raises(fineweb.InputError, match=rf"in use by another fineweb.py \(pid {os.getpid()}\)"):
            fineweb.shard_local_files(corpus, str(out), "tiny", 7)
    assert listdir(out) == []
    fineweb.shard_local_files(corpus, str(out), "tiny", 7)  # free once the first has let go


def test_the_lock_dies_with_its_holder_even_by_sigkill(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {REPO!r}); import atomic; "
                               f"lock = atomic.claim_directory({str(tmp_path)!r}, 'x'); print(flush=True); input()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()  # it holds the lock now
    with pytest.raises(Exception, match=f"pid {holder.pid}"):
        claim_directory(str(tmp_path), "x")
    holder.kill()
    holder.wait()
    claim_directory(str(tmp_path), "y").close()
    assert (tmp_path / LOCK_NAME).exists()


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
