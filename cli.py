"""What the scripts' command lines share: errors in one line, and a model loaded onto a device."""
import argparse

from atomic import check_writable
from tokenizer import N_VOCAB


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a usage error exits 2 (argparse's code), a run error 1."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def fail(self, message):
        self.exit(1, f"{self.prog}: error: {message}\n")

    def check_output(self, flag, path):
        """A one-line exit unless path can be written: found out before the work, not after it."""
        try:
            check_writable(path)
        except OSError as e:
            self.fail(f"{flag} {path}: cannot write there ({e.strerror})")


def gpt2_vocab_problem(vocab_size):
    """Why a model of vocab_size cannot read or write GPT-2's token ids, or None if it can."""
    if vocab_size < N_VOCAB:
        return f"a vocabulary of {vocab_size} cannot hold GPT-2's {N_VOCAB} token ids"
    return None


def load_model_onto(parser, name, device="cpu"):
    """(model in eval mode, device) for anything load_model takes, or a one-line exit: a device
    this machine lacks, a model that cannot be loaded, one that cannot hold GPT-2's token ids."""
    from checkpoint import CheckpointError, load_model  # here, so that fineweb.py's parser needs no torch
    from devices import pick_device
    try:
        device = pick_device(device)
    except ValueError as e:
        parser.fail(f"--device {device}: {e}")
    try:
        # Read on the CPU: a training checkpoint also holds AdamW's moments, twice the model's size.
        model = load_model(name)
    except CheckpointError as e:
        parser.fail(str(e))
    problem = gpt2_vocab_problem(model.config.vocab_size)
    if problem:
        parser.fail(f"{name}: {problem}")
    return model.to(device).eval(), device
