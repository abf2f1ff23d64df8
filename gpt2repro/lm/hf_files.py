"""A Hugging Face model's weights as its files declare them, before any tensor is read: each one's
name, shape and dtype, from a model.safetensors' header, or from a pytorch_model.bin unpickled as
plain data with its storages left on disk; of one file, or of the files its index names.
model.GPT.from_pretrained checks them against config.json before it builds anything."""
import os
import stat
import zipfile

import torch

from gpt2repro.common.inputs import brief, parse_json, read_text

# Where a directory (or hub repository) keeps its weights, in transformers' order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_INDEX_CHARS = 1 << 24  # an index names each weight's file: GPT-2 XL's ~600 names take ~40K characters
# safetensors' names of the dtypes a weight may have; any other (BOOL, I8, ...) is declared as its name.
SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def declared_weights(name_or_path, local_files_only=False):
    """(the weights file, {name: (shape, dtype)} of every tensor its files declare) for a Hugging
    Face model (a directory, or a hub id fetched into the cache as transformers fetches it), or
    None where it has none of WEIGHT_FILES: transformers then says so. A dtype is a torch.dtype
    where it is a float one, else safetensors' name for it. ValueError for a file that is not a
    regular one (a FIFO would wait forever) or an index that does not name files beside it; a
    damaged file fails in safetensors or torch, as it would in transformers."""
    for name in WEIGHT_FILES:
        path = weights_file(name_or_path, name, local_files_only)
        if path is None:
            continue
        files = indexed_files(name_or_path, path, local_files_only) if name.endswith(".index.json") else [path]
        declared = {}
        for file in files:
            declared.update(tensors_declared(file))
        return path, declared
    return None


def weights_file(name_or_path, name, local_files_only):
    """The local path of the file name of the model, or None where it has none."""
    from transformers.utils import cached_file

    path = cached_file(name_or_path, name, local_files_only=local_files_only,
                       _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    if path is not None and not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path}: not a regular file")
    return path


def indexed_files(name_or_path, index, local_files_only):
    """The local paths of the files that index (a *.index.json: its weight_map) names."""
    contents = parse_json(read_text(index, MAX_INDEX_CHARS))
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ValueError(f"{index}: its weight_map is {brief(weight_map)}, not weight names mapped to files")
    paths = []
    for file in sorted(set(weight_map.values())):
        if os.path.basename(file) != file or file in ("", ".", ".."):
            raise ValueError(f"{index}: names {brief(file)}, not a file beside it")
        path = weights_file(name_or_path, file, local_files_only)
        if path is None:
            raise ValueError(f"{index}: names {file}, which is missing")
        paths.append(path)
    return paths


def tensors_declared(path):
    """{name: (shape, dtype)} of the tensors in path, a safetensors file or a torch.save one, no tensor read."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:  # its header alone
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: (tuple(s.get_shape()), SAFETENSORS_FLOATS.get(s.get_dtype(), s.get_dtype()))
                    for name, s in slices.items()}
    # Plain data only (weights_only), as transformers reads it; mapped, a zip's storages stay on disk.
    tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    if not isinstance(tensors, dict):
        raise ValueError(f"{path}: not a state dict")
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
