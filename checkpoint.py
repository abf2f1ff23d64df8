"""Checkpoints: what they hold, written atomically, read as plain data, never by running pickled code.

A checkpoint is a dict of tensors and plain Python values saved with torch.save:
model (plain GPT keys), optimizer, scaler, step, data-loader position, RNG states,
config (GPTConfig as a dict) and args (training_state). Every reader goes through
load_checkpoint; a run resumes through restore_training.
"""
import glob
import os
import pickle
import re
import shutil
import sys

from dataclasses import asdict

import torch

from atomic import atomic_open
from model import GPT, GPTConfig

CHECKPOINT_RE = re.compile(r"ckpt_(\d+)\.pt$")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP


class CheckpointError(Exception):
    """A checkpoint that is missing, damaged, or not plain data."""


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"ckpt_{step:06d}.pt")


def checkpoint_step(path):
    return int(CHECKPOINT_RE.search(path).group(1))


def list_checkpoints(log_dir):
    """Checkpoint files in log_dir, oldest step first."""
    paths = [p for p in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*.pt")) if CHECKPOINT_RE.search(p)]
    return sorted(paths, key=checkpoint_step)


def plain_state_dict(state_dict):
    """Model keys without the prefixes torch.compile and DDP add, so any script can load them."""
    def strip(key):
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key
    return {strip(k): v for k, v in state_dict.items()}


def save_checkpoint(path, state):
    """Writes state to path through a temporary file, flushed and renamed, so a crash at any
    moment leaves either the complete new file or none. Returns False, keeping older files,
    when the disk lacks room."""
    directory = os.path.dirname(os.path.abspath(path))
    need = 1.1 * sum(t.numel() * t.element_size() for t in _tensors(state)) + (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        print(f"warning: skipping checkpoint {path}: {free / 1e9:.2f} GB free, about {need / 1e9:.2f} GB needed",
              file=sys.stderr)
        return False
    try:
        with atomic_open(path) as f:
            torch.save(state, f)
    except OSError as e:  # a full disk despite the check, a quota, a vanished mount
        print(f"warning: could not write checkpoint {path}: {e}", file=sys.stderr)
        return False
    return True


def training_state(raw_model, optimizer, scaler, step, train_loader, args):
    """Everything an exact resume needs, as tensors and plain Python values."""
    return {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "train_loader": train_loader.state_dict(),
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "config": asdict(raw_model.config),
        "args": vars(args),
    }


def restore_training(state, path, raw_model, optimizer, scaler, train_loader):
    """Puts a run back where training_state found it; returns its step."""
    missing = [key for key in ("optimizer", "scaler", "train_loader", "rng", "step") if key not in state]
    if missing:
        raise CheckpointError(f"{path} holds no {missing[0]}: a model to score or sample, not a run to resume")
    config = asdict(raw_model.config)
    if state["config"] != config:
        diff = ", ".join(f"{k} {v} (this run: {config.get(k)})" for k, v in state["config"].items() if config.get(k) != v)
        raise CheckpointError(f"{path} holds a model of another architecture: {diff}")
    raw_model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    if state["scaler"]:  # empty when saved without fp16 loss scaling: a switch to fp16 starts a fresh scale
        scaler.load_state_dict(state["scaler"])
    train_loader.load_state_dict(state["train_loader"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        # One state per GPU the saving process saw: a run resumed on fewer GPUs takes as many.
        torch.cuda.set_rng_state_all(state["rng"]["cuda"][: torch.cuda.device_count()])
    return state["step"]


KERNEL_FLAGS = ("fused", "foreach", "capturable")  # how AdamW runs here, not what it learned


def load_optimizer_state(optimizer, saved):
    """Loads saved into optimizer, keeping this machine's AdamW kernel (a run saved on a CPU resumes
    fused on a GPU, and back). The flags go into the saved groups before loading: load_state_dict
    places each `step` counter by them (fused and capturable kernels read it as float32 on the
    parameter's device), so flags switched afterwards would leave it where the old kernel wanted it."""
    groups = [{**saved_group, **{k: group[k] for k in KERNEL_FLAGS if k in group}}
              for saved_group, group in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def find_resume(resume, log_dir):
    """(path, state) to resume from, or None to start fresh: resume is "none", "auto" (the newest
    checkpoint in log_dir that loads) or a checkpoint's path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(log_dir)
    return resume, load_checkpoint(resume)


def check_no_later_checkpoints(log_dir, step):
    """Training on from an older checkpoint into a log_dir that holds checkpoints of later steps
    would interleave two runs there, and --resume auto or --keep_last would later take the wrong files."""
    later = [p for p in list_checkpoints(log_dir) if checkpoint_step(p) > step]
    if later:
        raise CheckpointError(f"{log_dir} holds checkpoints past step {step} ({os.path.basename(later[-1])}, ...): "
                              f"training from step {step} there would mix two runs; choose another --log_dir, "
                              f"or delete them to branch off")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def load_checkpoint(path, map_location="cpu"):
    """Loads a checkpoint with weights_only=True: tensors and plain data only. A pickle that
    would construct anything else, code included, is refused before any of it runs."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = re.search(r"GLOBAL (\S+)", str(e))  # a pickle that would build an object: code can hide there
        if unsafe:
            raise CheckpointError(f"{path}: refused: not a plain-data checkpoint (it would construct "
                                  f"{unsafe.group(1)}); nothing in it was run") from None
        raise CheckpointError(f"{path}: not a checkpoint (no file that torch.save writes); nothing in it was run") from None
    except Exception as e:  # truncated, overwritten, not a torch file at all
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint ({type(e).__name__}: {detail})") from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"{path}: not a checkpoint of this project (no model or config)")
    state["model"] = plain_state_dict(state["model"])
    return state


def latest_checkpoint(log_dir, map_location="cpu"):
    """(path, state) of the newest checkpoint in log_dir that loads, or None. A damaged newer
    file (a crash mid-write, a bad disk) is skipped with a warning."""
    for path in reversed(list_checkpoints(log_dir)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            print(f"warning: skipping {e}", file=sys.stderr)
    return None


def prune_checkpoints(log_dir, keep_last):
    """Deletes all but the newest keep_last checkpoints (keep_last <= 0 keeps all)."""
    if keep_last > 0:
        for path in list_checkpoints(log_dir)[:-keep_last]:
            os.remove(path)


def load_model(name_or_path, map_location="cpu"):
    """A GPT from a checkpoint of train_gpt2.py (a .pt file), or from OpenAI's GPT-2
    (gpt2 ... gpt2-xl) or a Hugging Face GPT-2 directory. Any failure is a CheckpointError
    of one line, so every script reports a model it cannot load the same way."""
    # A .pt path that is missing is a missing checkpoint, not a model name for the hub.
    if os.path.isfile(name_or_path) or name_or_path.endswith(".pt"):
        state = load_checkpoint(name_or_path, map_location)
        try:
            model = GPT(GPTConfig(**state["config"]))
            model.load_state_dict(state["model"])
        except (TypeError, RuntimeError) as e:  # a config or weights that are not this GPT's
            raise CheckpointError(f"{name_or_path}: not a checkpoint of this GPT ({_first_line(e)})") from None
        return model
    try:
        return GPT.from_pretrained(name_or_path)
    except (OSError, ValueError, RuntimeError) as e:  # unknown name, offline, not a GPT-2 directory
        raise CheckpointError(f"cannot load {name_or_path}: {_first_line(e)}") from None


def _first_line(error):
    return " ".join(str(error).split()) or type(error).__name__
