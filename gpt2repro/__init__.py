"""The library under the scripts at the repository's root, one sub-package for each concern:

    common/     what every script shares: devices, processes, command lines, safe reads and writes
    lm/         the model's pieces beside model.py: tokenizer, token shards, loss, generation
    training/   the step and what it is built from: config, optimizers, FSDP, memory plan, faults
    runs/       a run on disk: its log directory, checkpoints and the models read out of them
    evals/      what HellaSwag and CORE share: continuations scored through the KV cache, CORE's tasks
    benchmark/  what only bench.py uses: the peers' trainers and the step's profile
"""
import os

# The repository's root: the configs, data and caches that scripts name by relative paths.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
