"""What the scripts' command lines share: errors in one line."""
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
