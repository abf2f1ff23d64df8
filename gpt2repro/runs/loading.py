"""A GPT for the scripts (sample.py, hellaswag.py, export_hf.py, train_gpt2.py --init_from) from
whatever the user names: a checkpoint of train_gpt2.py (one file, a sharded directory, or a run's
log_dir, whose newest it takes), a Hugging Face GPT-2 directory, or OpenAI's gpt2 ... gpt2-xl from
the hub, or from its cache where the hub cannot be reached. Every failure is one CheckpointError line.
"""
import os
import socket
import sys
import traceback
import urllib.parse
import warnings
from dataclasses import replace

from gpt2repro.common.devices import pick_device
from gpt2repro.common.inputs import first_line
from gpt2repro.lm.tokenizer import gpt2_vocab_problem
from gpt2repro.runs.checkpoint_files import ShardedCheckpoint, checkpoint_format, load_parts, named_checkpoints
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.model_weights import ModelPart, model_of, non_finite_weights, saved_weights_problem
from model import GPT, PRETRAINED, n_params


def load_model_on(name, device="cpu"):
    """(model in eval mode, device) for anything load_model takes, or a one-line CheckpointError:
    a device this machine lacks, a model that cannot be loaded, one that cannot hold GPT-2's ids."""
    try:
        device = pick_device(device)
    except ValueError as e:
        raise CheckpointError(f"--device {device}: {e}") from None
    model = load_model(name)  # read on the CPU: a training checkpoint also holds AdamW's moments
    problem = gpt2_vocab_problem(model.config.vocab_size)
    if problem:
        raise CheckpointError(f"{name}: {problem}")
    return model.to(device).eval(), device


def load_model(name_or_path, map_location="cpu", dropout=None, **options):
    """A GPT from a checkpoint of train_gpt2.py (a .pt file or a sharded directory; of a run's
    log_dir, its newest, named on stderr), or from OpenAI's GPT-2 (gpt2 ... gpt2-xl) or a Hugging
    Face GPT-2 directory. Any failure is a CheckpointError of one line, so every script reports a
    model it cannot load the same way. dropout: the model's (the trainer's --dropout); None: a
    checkpoint's recorded one, 0 for a Hugging Face model, whose pdrops are never read. options:
    how it runs, as GPT's (the trainer's recompute and attention)."""
    check_source(name_or_path)
    name_or_path = newest_in_log_dir(name_or_path)
    kind = checkpoint_format(name_or_path)
    if kind:
        checkpoint = kind.load(name_or_path, map_location)
        model = model_of(name_or_path, checkpoint.state["config"], dropout, **options)
        if kind is ShardedCheckpoint:  # its weights are in its storage files, read as the trainer reads them
            load_parts(checkpoint, {"model": ModelPart(model)})
        else:
            problem = saved_weights_problem(checkpoint.state["model"])
            if problem:
                raise CheckpointError(f"{name_or_path}: {problem}")
            try:
                model.load_state_dict(checkpoint.state["model"])
            except (TypeError, ValueError, RuntimeError) as e:  # weights that are not this GPT's
                raise CheckpointError(f"{name_or_path}: not a checkpoint of this GPT ({first_line(e)})") from None
    else:
        model = load_pretrained(name_or_path, dropout=dropout or 0.0, **options)
    problem = non_finite_weights(model)
    if problem:
        raise CheckpointError(f"{name_or_path}: {problem}: no model to use")
    return model


def replaced_settings(cfg, loaded):
    """The trainer's line saying what --init_from's model (loaded, a GPTConfig) replaces of the model
    settings of cfg (a TrainConfig: its preset's, config file's and flags'), with both sizes; None
    where the two are one architecture (dropout is the flag's either way)."""
    def described(config):
        return (f"{n_params(config):,} parameters: {config.n_layer} layers, {config.n_head} heads, "
                f"{config.n_embd} wide, context {config.block_size}, vocabulary {config.vocab_size}")
    if replace(loaded, dropout=cfg.model.dropout) == cfg.model:
        return None
    settings = f"--preset {cfg.preset}" + (f" and --config {cfg.config}" if cfg.config else "")
    return (f"note: --init_from {cfg.init_from} replaces the model of {settings} ({described(cfg.model)}) with its "
            f"own ({described(loaded)}); the other settings stay")


def check_run_sources(init_from, resume):
    """The trainer's --init_from (check_source's checks) and --resume (a path, unless auto or none),
    checked before anything is written or downloaded: a CheckpointError naming the flag."""
    if resume not in ("auto", "none") and not os.path.exists(resume):
        raise CheckpointError(f"--resume {resume}: no such checkpoint")
    if init_from == "scratch":
        return
    try:
        check_source(init_from)
    except CheckpointError as e:
        raise CheckpointError(f"--init_from: {e}") from None


def check_source(name):
    """Raises a one-line CheckpointError, at once and before anything is read or downloaded, for a
    name that cannot be a model load_model takes: a path that is missing or not a file or directory,
    a directory with neither checkpoints nor a Hugging Face model, or a bare name that is neither
    OpenAI's GPT-2 (gpt2 ... gpt2-xl) nor a hub id (OWNER/NAME). Every script calls it on its
    -m/--model/--init_from before its downloads."""
    if os.path.exists(name):
        if os.path.isdir(name):
            if not (checkpoint_format(name) or named_checkpoints(name)
                    or os.path.exists(os.path.join(name, "config.json"))):
                raise CheckpointError(f"{name}: a directory with neither checkpoints (ckpt_XXXXXX.pt, or "
                                      f"ckpt_XXXXXX/ sharded) nor a Hugging Face GPT-2 model (config.json) in it")
        elif not os.path.isfile(name):
            raise CheckpointError(f"{name}: not a regular file or a directory")
    elif name.endswith(".pt"):
        raise CheckpointError(f"{name}: no such checkpoint")
    elif name in PRETRAINED or is_hub_id(name):
        return
    elif "/" in name or name.startswith((os.sep, ".", "~")):  # only a path can be written so
        raise CheckpointError(f"{name}: no such file or directory")
    else:  # a bare name: a mistyped run folder, more likely than a hub model of no owner
        raise CheckpointError(f"no such checkpoint or directory {name!r} (and not a GPT-2 model name: "
                              f"{', '.join(PRETRAINED)})")


def is_hub_id(name):
    """Whether name can be a Hugging Face hub id, OWNER/NAME, rather than a path."""
    owner, _, repo = name.partition("/")
    return bool(owner and repo) and "/" not in repo and not owner.startswith((".", "~"))


def newest_in_log_dir(path):
    """path, or the newest checkpoint in it if it is a directory that holds checkpoints (a run's
    log_dir), named on stderr."""
    checkpoints = [] if not os.path.isdir(path) or checkpoint_format(path) else named_checkpoints(path)
    if checkpoints:
        print(f"{path}: loading its newest checkpoint, {checkpoints[-1]}", file=sys.stderr)
        return checkpoints[-1]
    return path


def load_pretrained(name_or_path, **options):
    """GPT.from_pretrained, every failure one line: an unknown name, no network, a directory that
    is not GPT-2's, or one damaged (a truncated safetensors file, a pickle that is not plain tensors)."""
    unreachable = not os.path.isdir(name_or_path) and hub_unreachable()
    try:
        with warnings.catch_warnings():  # torch's multi-line warning about a file it refused: the error says it
            warnings.simplefilter("ignore")
            return GPT.from_pretrained(name_or_path, local_files_only=unreachable is not None, **options)
    except Exception as e:
        if raised_by_torch_load(e):  # transformers reads pytorch_model.bin with weights_only=True
            raise CheckpointError(f"{os.path.join(name_or_path, 'pytorch_model.bin')}: refused: not plain tensors "
                                  f"(damaged, or a pickle that would run code); nothing in it was run") from None
        if unreachable:
            raise CheckpointError(f"cannot load {name_or_path}: it is not in the Hugging Face cache, and {unreachable}")
        where = name_or_path
        if type(e).__name__ == "SafetensorError":
            where = os.path.join(name_or_path, "model.safetensors")
        raise CheckpointError(f"cannot load {where}: {first_line(e)}") from None


def hub_unreachable(timeout=5):
    """Why the Hugging Face hub cannot be reached, or None if it can (or through a proxy, which this
    cannot test). Asked once, up front: offline, huggingface_hub retries each file for a minute."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"{url.hostname} cannot be reached ({first_line(e)}): no network?"
    return None


def raised_by_torch_load(error):
    """Damaged bytes fail in torch's weights-only unpickler as UnpicklingError, IndexError, KeyError..."""
    torch_files = (os.path.join("torch", "serialization.py"), os.path.join("torch", "_weights_only_unpickler.py"))
    return any(frame.f_code.co_filename.endswith(torch_files) for frame, _ in traceback.walk_tb(error.__traceback__))
