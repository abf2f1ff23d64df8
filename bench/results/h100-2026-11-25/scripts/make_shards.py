"""Shards for GPU runs: Tiny Shakespeare's GPT-2 tokens, repeated: a learnable stream."""
import os, sys
import numpy as np
sys.path.insert(0, os.getcwd())
from bench import TINY_SHAKESPEARE
from gpt2repro.lm.data import shard_name, write_shard
from gpt2repro.lm.tokenizer import EOT, get_encoding

out, n_train, per_shard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokens = np.array([EOT] + get_encoding().encode_ordinary(open(TINY_SHAKESPEARE).read()), dtype=np.uint16)
os.makedirs(out, exist_ok=True)
for i in range(n_train + 1):
    n = per_shard if i else per_shard // 10
    write_shard(os.path.join(out, shard_name("shakes", "val" if i == 0 else "train", i)),
                np.roll(np.resize(tokens, n), -i * 1000))
print(out, "tokens in corpus", len(tokens))
