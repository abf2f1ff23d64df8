"""What the tests share beside pytest's fixtures (conftest.py): tiny models, tiny data, and
running the repository's scripts as a user would. Everything runs offline."""
import functools
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed (pip install triton)")
# A test that runs loss.py's Triton kernel in Triton's interpreter, on CPU tensors: skipped, with
# interpreter_problem's reason, where the interpreter cannot run it (conftest.py).
interpreted = pytest.mark.interpreted


@functools.cache
def interpreter_problem():
    """Why Triton's interpreter cannot run loss.py's kernel here, in a line, or None where it can.
    The kernel loops over a count its caller passes (its columns), which Triton 3.6's interpreter
    cannot do with numpy 2.4: a tiny kernel that does so is run to find out."""
    if not TRITON:
        return "triton is not installed (pip install triton)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton's interpreter is off: conftest.py sets it only where there is no GPU"
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def count_to(out_ptr, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out_ptr, total)

    try:
        count_to[(1,)](torch.zeros(1, dtype=torch.int32), 3)
    except Exception as e:  # the interpreter's failure: loss.py's kernel is not involved
        return (f"Triton {triton.__version__}'s interpreter fails on a loop over a kernel's argument (numpy "
                f"{numpy.__version__}): {e}")
    return None


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


def write_token_shards(directory, n_train=3, tokens_per_shard=12_000, n_val=4_000, vocab=256, seed=0):
    """Shards of a learnable stream: sentences drawn from a small fixed bank, so a tiny
    model's loss falls within a few steps. Returns the list of paths, val first."""
    import numpy as np

    from gpt2repro.lm.data import shard_name, write_shard

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


def popen_torchrun(*args, nproc=2, torchrun_flags=(), preexec_fn=None):
    """torchrun on CPU (gloo) in its own process group, so a hung run's workers die with it;
    preexec_fn as run_script's (its limits hold for the workers too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_flags, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec_fn)


def finish_torchrun(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # workers left behind by a failed or timed-out run
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_torchrun(*args, nproc=2, timeout=300, preexec_fn=None):
    return finish_torchrun(popen_torchrun(*args, nproc=nproc, preexec_fn=preexec_fn), timeout)


def said_errors(stderr):
    """The error lines that the ranks of a torchrun run said ("error: ..."), not torchrun's summary,
    which gives one of them again as its root cause (torchrun_root_cause)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def torchrun_root_cause(stderr):
    """The message that torchrun's summary of its failed ranks gives as the root cause (the failure
    of the earliest time)."""
    root = stderr[stderr.index("Root Cause (first observed failure):"):]
    return next(line for line in root.splitlines() if line.startswith("  traceback : "))[len("  traceback : "):]


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
    from gpt2repro.lm.tokenizer import EOT

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


def parts_of(model, optimizer, scaler, loader):
    """checkpoint.training_parts of a run of model, optimizer, scaler and loader."""
    from types import SimpleNamespace

    from gpt2repro.runs.checkpoint import training_parts

    return training_parts(SimpleNamespace(raw_model=model, optimizer=optimizer, scaler=scaler), loader)


def as_checkpoint(parts, step, flags):
    """What a one-file checkpoint of parts at step holds, with flags (TrainConfig.flags()) as its record."""
    from gpt2repro.runs.checkpoint import checkpoint_record
    from gpt2repro.runs.checkpoint_files import checkpoint_contents

    return checkpoint_contents(parts, checkpoint_record(parts, step, flags))


def disk_full(*args, **kwargs):
    """Stands in for any write that fails on a full disk."""
    raise OSError(28, "No space left on device")


def run_script(script, *args, cwd=REPO, env=None, timeout=300, preexec_fn=None):
    """Runs one of the repository's scripts (or script, a path) as a user would, offline, with
    env's variables added; returns the CompletedProcess with stdout and stderr as text.
    subprocess.TimeoutExpired past timeout seconds."""
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
    from gpt2repro.common.atomic import LOCK_NAME
    return [name for name in os.listdir(path) if name != LOCK_NAME]


def file_size_limit(limit):
    """A preexec_fn: the child may write no file past limit bytes (ulimit -f), and a write past it
    fails with EFBIG, as on a full disk, rather than killing it (SIGXFSZ)."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


# The tiny training run of train_gpt2.py that the trainer's tests share.
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--vocab_size", "256",
        "-T", "32", "--warmup_steps", "2", "--max_lr", "3e-3", "--hellaswag", "0", "--sample_interval", "0",
        "--compile", "0", "--device", "cpu", "--dtype", "float32", "--eval_interval", "0"]
TINY_CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256)


def train(data_dir, log_dir, *flags):
    """train_gpt2.main(TINY + flags) in-process; returns the records of its log.jsonl."""
    import train_gpt2

    train_gpt2.main(TINY + ["--data_dir", data_dir, "--log_dir", str(log_dir), *map(str, flags)])
    return read_log(log_dir)


def read_log(log_dir):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(records):
    return [r for r in records if "train_loss" in r]


def final_weights(log_dir, step):
    from gpt2repro.runs.checkpoint_files import load_checkpoint

    return load_checkpoint(os.path.join(log_dir, f"ckpt_{step:06d}.pt")).state["model"]


def assert_same_run(a, b, rel=1e-5):
    a, b = train_records(a), train_records(b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=rel)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=100 * rel)


def run_cli(*flags):
    """train_gpt2.py TINY flags, as a user runs it."""
    return run_script("train_gpt2.py", *TINY, *flags)


def one_line_error(result):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def error_of(capsys, *flags):
    """The one line on stderr with which train_gpt2.main(TINY + flags) exits non-zero, in-process."""
    import train_gpt2

    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.main(TINY + [str(f) for f in flags])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


COMPILED_TRAIN = """
import functools, sys
import torch
sys.path.insert(0, {repo!r})
# torch.compile's wrapper (and its _orig_mod. prefix) without inductor's minutes of C++ builds on a CPU.
torch.compile = functools.partial(torch.compile, backend="eager")
import train_gpt2
real_build = train_gpt2.build_trainable


def build_trainable(*args, **kwargs):
    t = real_build(*args, **kwargs)
    print(f"the step runs through {{type(t.step_model).__name__}} of {{type(getattr(t.step_model, '_orig_mod', None)).__name__}}")
    return t
train_gpt2.build_trainable = build_trainable
train_gpt2.main()
"""


# Hand-written in HellaSwag's format, of mixed lengths, labels as ints and as digit strings.
EXAMPLES = [
    {"ind": 1, "activity_label": "Baking bread", "ctx_a": "A woman kneads dough on a floured counter.",
     "ctx_b": "she", "ctx": "A woman kneads dough on a floured counter. she", "split": "val",
     "split_type": "indomain", "label": 2, "source_id": "handwritten-1",
     "endings": ["throws the dough at the ceiling fan.", "sings.",
                 "shapes it into a round loaf and sets it in a tin to rise.", "paints the dough blue with a small brush."]},
    {"ind": 2, "activity_label": "Riding a bike", "ctx_a": "A boy pushes his bicycle up a steep hill.",
     "ctx_b": "he", "ctx": "A boy pushes his bicycle up a steep hill. he", "split": "val",
     "split_type": "indomain", "label": "0", "source_id": "handwritten-2",
     "endings": ["reaches the top, climbs on and rolls down the other side.", "eats the handlebars.",
                 "turns into a bird.", "is underwater."]},
    {"ind": 3, "activity_label": "Home and Garden",
     "ctx_a": "[header] How to repot a houseplant [title] Choose a new pot. [step] Pick a pot one size larger "
              "than the old one, with a drainage hole in the bottom so that water does not collect around the roots.",
     "ctx_b": "", "ctx": "[header] How to repot a houseplant [title] Choose a new pot. [step] Pick a pot one size larger "
                         "than the old one, with a drainage hole in the bottom so that water does not collect around the roots.",
     "split": "val", "split_type": "zeroshot", "label": 1, "source_id": "handwritten-3",
     "endings": ["[title] Fill the pot with sand and leave it in the freezer overnight.",
                 "[title] Loosen the plant from its old pot. [step] Tip the pot on its side and ease the root ball out.",
                 "Plants do not like pots.", "[title] Water the ceiling."]},
    {"ind": 4, "activity_label": "Swimming", "ctx_a": "A swimmer dives into the pool.", "ctx_b": "",
     "ctx": "A swimmer dives into the pool.", "split": "val", "split_type": "indomain", "label": "3",
     "source_id": "handwritten-4",
     "endings": ["She flies.", "The pool is a desert.", "He eats a sandwich on the diving board while it rains upwards.",
                 "She swims two lengths and climbs out."]},
    {"ind": 5, "activity_label": "Tennis", "ctx_a": "Two players stand on a clay court.", "ctx_b": "the first",
     "ctx": "Two players stand on a clay court. the first", "split": "val", "split_type": "indomain",
     "label": 0, "source_id": "handwritten-5",
     "endings": ["serves the ball over the net.", "player", "knits a scarf.", "falls asleep standing up in the sun."]},
]


def write_jsonl(path, lines):
    """lines: dicts (written as JSON) or raw strings."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


# Documents for fineweb.py's corpora: empty, non-ASCII, with a literal <|endoftext|>, long.
DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "",  # an empty document is still its <|endoftext|>
    "héllo wörld, naïve café 🙂 — 日本語",
    "a literal <|endoftext|> in a document is ordinary text",
    "  spaces\n\n\n and newlines  \n",
    "All: Speak, speak. " * 40,  # long enough to span several tiny shards
]


def write_docs_jsonl(path, docs, field="text"):
    """docs as fineweb.py reads a .jsonl corpus: one {"id": i, field: doc} a line."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs))
    return str(path)


class WritesAFile:
    """A pickle that, unpickled by a trusting loader, creates a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def read_metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own file: trusted


def declare_bytes(ckpt, key, payload_file):
    """Rewrites ckpt's .metadata (only DCP's own classes) so that its entry key is a bytes item
    stored in payload_file, which holds a pickle that would create a marker file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = read_metadata(ckpt)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(os.path.basename(payload_file), 0,
                                                             os.path.getsize(payload_file))
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def memory_limit(limit):
    """A preexec_fn: the child may map no more than limit bytes (ulimit -v), so that a read that
    never ends fails fast with MemoryError rather than filling this machine's memory."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


@functools.cache
def torch_address_space():
    """The bytes of address space a fresh interpreter maps to import torch: under 1 GiB for a CPU
    build, over 3 GiB for a CUDA build (its libraries), used or not."""
    code = "import re, torch; print(re.search(r'VmPeak:\\s+(\\d+) kB', open('/proc/self/status').read())[1])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) << 10


def run_bounded(script, *args, cwd=REPO):
    """run_script for inputs that could hang or fill the memory of a script that reads them
    unbounded: 60 s, and 2 GiB beyond what importing torch maps, at most, so that a test of such an
    input fails, never hangs."""
    return run_script(script, *args, cwd=cwd, timeout=60, preexec_fn=memory_limit(torch_address_space() + (2 << 30)))


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


class FixedBatches:
    """A loader that serves the same batches in the same order, for two runs to compare."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0
        self.B, self.T = batches[0][0].shape
        self.tokens_per_index = batches[0][0].numel()

    def micro_steps(self, tokens_per_step):
        from gpt2repro.lm.data import ShardLoader

        return ShardLoader.micro_steps(self, tokens_per_step)  # the loader's own count, of these batches

    def next_batch(self):
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]
