"""Files the tests write as users' inputs would be: token shards, HellaSwag examples, corpora,
crafted pickles and checkpoint metadata, and inputs a read without bounds never finishes."""
import json
import os
import pickle


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


def listdir(path):
    """os.listdir(path) but for the lock file of a directory one process writes at a time."""
    from gpt2repro.common.atomic import LOCK_NAME
    return [name for name in os.listdir(path) if name != LOCK_NAME]


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
