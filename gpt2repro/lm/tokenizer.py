"""GPT-2's byte-pair encoding, built offline from the vendored BPE ranks.

tiktoken.get_encoding("gpt2") downloads its files on first use; the same ranks
ship in data/gpt2.tiktoken (see data/README.md), so training, sharding and
evaluation work on machines with no network. The ids are exactly tiktoken's.
"""
import base64
import hashlib
import os
from functools import lru_cache

import tiktoken

from gpt2repro import REPO

BPE_FILE = os.path.join(REPO, "data", "gpt2.tiktoken")
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256  # <|endoftext|>: separates documents, the last id of the vocabulary
N_VOCAB = 50257  # real tokens; training pads the embedding to 50304 for speed
PADDED_VOCAB = 50304  # N_VOCAB rounded up to a multiple of 128, for faster matmuls


@lru_cache(maxsize=None)
def get_encoding() -> tiktoken.Encoding:
    """GPT-2's tiktoken encoding (cached per process, so worker processes build their own)."""
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=read_ranks(BPE_FILE),
        special_tokens={"<|endoftext|>": EOT},
    )
    assert enc.n_vocab == N_VOCAB
    return enc


def read_ranks(path):
    """The BPE ranks of a .tiktoken file (a base64 token and its rank a line), checked against
    BPE_SHA256. Read here, not by tiktoken's load_tiktoken_bpe, which also copies the file into a
    cache in the system's temporary directory: building the tokenizer writes nothing."""
    with open(path, "rb") as f:
        contents = f.read()
    if hashlib.sha256(contents).hexdigest() != BPE_SHA256:
        raise ValueError(f"{path}: not GPT-2's BPE ranks (its SHA-256 is not {BPE_SHA256})")
    lines = (line.split() for line in contents.splitlines() if line)
    return {base64.b64decode(token): int(rank) for token, rank in lines}


def gpt2_vocab_problem(vocab_size):
    """Why a model of vocab_size cannot read or write GPT-2's token ids, or None if it can."""
    if vocab_size < N_VOCAB:
        return f"a vocabulary of {vocab_size} cannot hold GPT-2's {N_VOCAB} token ids"
    return None
