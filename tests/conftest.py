"""Shared test fixtures: tiny models and the repository root. Everything runs offline."""
import os
import signal
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reaches for the hub fails fast
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(2)


def make_hf_gpt2(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=128, seed=0, **config):
    """A random Hugging Face GPT-2 whose every parameter (LayerNorms too) is moved off its
    init value, so a loader that skipped or mis-transposed any tensor shows in the logits.
    config: more GPT2Config fields."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        vocab_size=vocab_size, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **config)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.fixture
def hf_gpt2_dir(tmp_path):
    """A tiny perturbed Hugging Face GPT-2 saved with save_pretrained; returns (model, dir)."""
    hf = make_hf_gpt2()
    path = tmp_path / "hf_gpt2"
    hf.save_pretrained(path)
    return hf, str(path)


def write_token_shards(directory, n_train=3, tokens_per_shard=12_000, n_val=4_000, vocab=256, seed=0):
    """Shards of a learnable stream: sentences drawn from a small fixed bank, so a tiny
    model's loss falls within a few steps. Returns the list of paths, val first."""
    import numpy as np

    from data import shard_name, write_shard

    rng = np.random.default_rng(seed)
    bank = [rng.integers(0, vocab, rng.integers(8, 17)) for _ in range(8)]
    def stream(n):
        parts, total = [], 0
        while total < n:
            parts.append(bank[rng.integers(len(bank))])
            total += len(parts[-1])
        return np.concatenate(parts)[:n]
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, shard_name("tiny", "val", 0))]
    write_shard(paths[0], stream(n_val))
    for i in range(1, n_train + 1):
        paths.append(os.path.join(directory, shard_name("tiny", "train", i)))
        write_shard(paths[-1], stream(tokens_per_shard + 37 * i))  # uneven sizes: windows cross boundaries
    return paths


def popen_torchrun(*args, nproc=2, torchrun_flags=()):
    """torchrun on CPU (gloo) in its own process group, so a hung run's workers die with it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_flags, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish_torchrun(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # workers left behind by a failed or timed-out run
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_torchrun(*args, nproc=2, timeout=300):
    return finish_torchrun(popen_torchrun(*args, nproc=nproc), timeout)


def make_tiny_gpt(vocab_size=50304, block_size=64, seed=0):
    """A tiny GPT with every parameter moved off its init value; vocab_size 50304 is the
    padded vocabulary of training."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def make_eot_gpt(block_size=64):
    """make_tiny_gpt's model made to end its texts often: every hidden state leans along e, and
    so does <|endoftext|>'s output row, so its logit is near the best one in many contexts."""
    from tokenizer import EOT

    model = make_tiny_gpt(vocab_size=50304, block_size=block_size)
    e = torch.randn(32, generator=torch.Generator().manual_seed(1))
    e /= e.norm()
    with torch.no_grad():
        model.transformer.ln_f.bias.copy_(2 * e)
        model.lm_head.weight[EOT] = 1.4 * e
    return model


def save_as_checkpoint(model, path):
    """Writes model as train_gpt2.py's checkpoints hold it; returns path."""
    from dataclasses import asdict

    torch.save({"model": model.state_dict(), "config": asdict(model.config), "step": 10}, path)
    return str(path)


def disk_full(*args, **kwargs):
    """Stands in for any write that fails on a full disk."""
    raise OSError(28, "No space left on device")


def run_script(script, *args, cwd=REPO, env=None, timeout=300, preexec_fn=None):
    """Runs one of the repository's scripts (or script, a path) as a user would, offline, with
    env's variables added; returns the CompletedProcess with stdout and stderr as text."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", **(env or {})}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=timeout, preexec_fn=preexec_fn)


def exit_message(capsys, main, *argv):
    """The one-line error that main(argv) exits with, not 0: argparse-style scripts print it
    to stderr (its last line, after any progress bar), sys.exit(message) passes it as the code."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code not in (0, None)
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in message
    return message


def listdir(path):
    """os.listdir(path) but for the lock file of a directory one process writes at a time."""
    from atomic import LOCK_NAME
    return [name for name in os.listdir(path) if name != LOCK_NAME]


def file_size_limit(limit):
    """A preexec_fn: the child may write no file past limit bytes (ulimit -f), and a write past it
    fails with EFBIG, as on a full disk, rather than killing it (SIGXFSZ)."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def memory_limit(limit):
    """A preexec_fn: the child may map no more than limit bytes (ulimit -v), so that a read that
    never ends fails fast with MemoryError rather than filling this machine's memory."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def run_bounded(script, *args, cwd=REPO):
    """run_script for inputs that could hang or fill the memory of a script that reads them
    unbounded: 60 s and 2 GiB at most, so that a test of such an input fails, never hangs."""
    return run_script(script, *args, cwd=cwd, timeout=60, preexec_fn=memory_limit(2 << 30))


def never_ending_inputs(tmp_path):
    """{name: path} of inputs that a read without bounds never finishes: a device that never ends,
    a FIFO that no one writes (open() waits), a directory, and a 4 GiB file of one line (sparse:
    it takes no disk)."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "huge", "wb") as f:
        f.truncate(4 << 30)
    return {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "dir": str(tmp_path / "dir"),
            "huge": str(tmp_path / "huge")}
