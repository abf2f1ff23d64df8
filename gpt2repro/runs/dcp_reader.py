"""A sharded checkpoint (a torch.distributed.checkpoint directory) read as plain data. DCP's own
reader unpickles .metadata and "bytes" entries with pickle, which runs whatever code a crafted file
holds; here the metadata is unpickled with named classes only (MetadataUnpickler), every entry
must be of the kind and shape this model holds before a byte of it is read (PlainDataPlanner),
plain data is read with weights_only=True, and every piece must lie within a regular file of the
directory (PlainDataReader). checkpoint_files.py's ShardedCheckpoint reads every sharded checkpoint
through dcp_load."""
import io
import os
import pickle
import re
import stat
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                  TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from gpt2repro.common.inputs import UnreadableFile, brief, first_line, open_regular, read_bytes

# Chunks of one tensor: one per rank that holds a piece of it. Bounds the all-pairs overlap check.
MAX_CHUNKS = 1 << 12
# A .metadata holds a few hundred bytes per chunk: GPT-2 XL's, with AdamW, is ~1 MB per rank.
MAX_METADATA_BYTES = 1 << 30


class CheckpointError(Exception):
    """A checkpoint that is missing, damaged, or not plain data."""


class UnreadableStorage(CheckpointError):
    """A sharded checkpoint whose storage files cannot be read into this model: found only as they are read."""


def dcp_load(tensors, path):
    """DCP's load, reading nothing but plain data: the metadata, every entry's kind and shape, and
    every piece's bounds in its storage file are checked before a byte of the storage files is read
    (PlainDataPlanner, PlainDataReader), on every rank alike. Any refusal or damage is one
    UnreadableStorage."""
    planner, reader = PlainDataPlanner(path), PlainDataReader(path)
    try:
        metadata = reader.read_metadata()
        planner.set_up_planner(tensors, metadata)  # the checks, here rather than inside DCP's collectives
        reader.set_up_storage_reader(metadata, is_coordinator=True)
        with warnings.catch_warnings():  # in one process DCP warns that it reads without torch.distributed, as meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader, planner=planner)
    except CheckpointError as e:
        raise UnreadableStorage(str(e)) from None
    except CheckpointException as e:  # a damaged storage file, on some rank: every rank hears of it
        errors = [error for error, _ in e.failures.values()]
        found = next((str(x) for x in errors if isinstance(x, CheckpointError)), None)
        raise UnreadableStorage(found or f"{path}: damaged sharded checkpoint ({first_line(errors[0])})") from None


class MetadataUnpickler(pickle.Unpickler):
    """DCP reads a checkpoint's .metadata with pickle, which would run whatever code a crafted
    file holds: it is read here instead, where nothing but these named classes can be built.
    Names are matched whole: a dotted one, which pickle would resolve attribute by attribute
    (the module's `os`, then its `system`), is never among them."""
    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                                  "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                                  "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
        "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module, name):
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_metadata(path):
    """The DCP Metadata of the sharded checkpoint at path, built by MetadataUnpickler alone from
    its .metadata, a regular file in path (not a link)."""
    file = os.path.join(path, ".metadata")
    refuse_link(file)
    try:
        data = read_bytes(file, MAX_METADATA_BYTES, "no metadata that DCP writes")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: incomplete sharded checkpoint (no .metadata)") from None
    except UnreadableFile as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read it ({first_line(e)})") from None
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        unsafe = re.search(r"GLOBAL (\S+)", str(e))
        if unsafe:
            raise CheckpointError(f"{path}: refused: its .metadata is not DCP's plain metadata (it would construct "
                                  f"{unsafe.group(1)}); nothing in it was run") from None
        raise CheckpointError(f"{file}: damaged ({first_line(e)})") from None
    except Exception as e:  # truncated, not a pickle at all
        raise CheckpointError(f"{file}: damaged ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{file}: damaged (not DCP's metadata)")
    return metadata


def refuse_link(file):
    """CheckpointError if file, of a sharded checkpoint, is a symbolic link: it could lead
    anywhere, as a storage file's could (check_storage_files)."""
    if os.path.islink(file):
        raise CheckpointError(f"{file}: a symbolic link, not a regular file: no {os.path.basename(file)} that "
                              f"train_gpt2.py writes")


class PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, but an entry is read only as the kind that this state holds there (a
    tensor of its shape, or plain data), and plain data is read with weights_only=True: DCP's own
    reads it with weights_only=False, so a crafted entry declared "bytes" would run its pickle."""

    def __init__(self, path):
        super().__init__()
        self.path = path  # for messages

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, value in self.state_dict.items():
            problem = entry_problem(metadata.state_dict_metadata.get(key), value)
            if problem:
                raise CheckpointError(f"{self.path}: refused: its entry {key} {problem}; nothing was read")

    def load_bytes(self, read_item, value):
        try:
            with warnings.catch_warnings():  # torch's about the pickle protocol: the error says enough
                warnings.simplefilter("ignore")
                obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{self.path}: refused: its entry {read_item.dest_index.fqn} is not plain data "
                                  f"({load_error(e)}); nothing in it was run") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class PlainDataReader(FileSystemReader):
    """DCP's file reader, but the metadata is read by read_metadata, every piece it places must lie
    within a regular file of the directory, apart from every other piece, before any is read; a
    tensor is read only as stored in the dtype it is loaded into (read_item), and a storage file
    that fails to load is named."""

    metadata = None  # read once: dcp_load's up-front checks ask for it, then DCP itself

    def read_metadata(self, *args, **kwargs):
        if self.metadata is None:
            self.metadata = read_metadata(str(self.path))
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        check_storage_files(str(self.path), metadata.storage_data)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan, planner):
        by_file = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CheckpointError(f"{self.path}: damaged: its .metadata places {item.storage_index.fqn} "
                                      f"in no storage file")
            by_file.setdefault(info.relative_path, []).append(item)
        for name, items in by_file.items():
            file = os.path.join(self.path, name)
            try:
                with open_regular(file, "rb") as stream:
                    for item in items:
                        self.read_item(file, stream, item, planner)
            except CheckpointError:
                raise
            except Exception as e:  # zeroed or overwritten bytes
                raise CheckpointError(f"{file}: damaged storage file ({load_error(e)})") from None
        done = Future()
        done.set_result(None)
        return done

    def read_item(self, file, stream, item, planner):
        """DCP's read of one item from stream, the storage file at file, as FileSystemReader's
        (no transforms: check_storage_files refuses them), but a tensor stored in another dtype
        than the one it is loaded into is refused: copied, it would be cast (a bool's 0s and 1s)."""
        info = self.storage_data[item.storage_index]
        stream.seek(info.offset)
        data = io.BytesIO(stream.read(info.length))
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, data)
            return
        stored = torch.load(data, map_location="cpu", weights_only=True)
        target = planner.resolve_tensor(item).detach()
        if not isinstance(stored, torch.Tensor) or stored.dtype != target.dtype:
            kind = stored.dtype if isinstance(stored, torch.Tensor) else brief(stored)
            raise CheckpointError(f"{file}: refused: it stores {item.storage_index.fqn} as {kind}, where this "
                                  f"model holds {target.dtype}")
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, offset, length)
        if stored.size() != target.size():
            raise CheckpointError(f"{file}: damaged: it stores {item.storage_index.fqn}'s piece as "
                                  f"{tuple(stored.size())}, read into {tuple(target.size())}")
        target.copy_(stored)
        planner.commit_tensor(item, target)


def check_storage_files(path, storage_data):
    """Raises CheckpointError unless every piece that storage_data (of DCP's metadata) places lies
    within a regular file directly in path (not a link), apart from every other piece, stored as
    this project writes it (no transforms). Messages show the metadata's values only as brief text."""
    sizes, spans = {}, {}
    for index, info in storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not is_file_name(name):
            raise CheckpointError(f"{path}: refused: its .metadata names {brief(name)} as a storage file, "
                                  f"not a file directly in the directory")
        file = os.path.join(path, name)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{file}: refused: stored through transforms, which this project never writes")
        if name not in sizes:
            try:
                mode_size = os.lstat(file)  # a link could lead anywhere
            except OSError as e:
                raise CheckpointError(f"{file}: missing storage file ({first_line(e)})") from None
            if not stat.S_ISREG(mode_size.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(mode_size.st_mode) else "not a regular file"
                raise CheckpointError(f"{file}: {kind}, not a regular file: no storage file that train_gpt2.py writes")
            sizes[name] = mode_size.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            raise CheckpointError(f"{file}: truncated or damaged storage file ({brief(length)} bytes at "
                                  f"{brief(offset)} in its .metadata; the file holds {sizes[name]})")
        spans.setdefault(name, []).append((offset, offset + length, getattr(index, "fqn", index)))
    for name, pieces in spans.items():  # DCP writes each piece once, after the one before
        pieces.sort(key=lambda piece: piece[:2])
        for (_, end, first), (start, _, second) in zip(pieces, pieces[1:]):
            if start < end:
                raise CheckpointError(f"{os.path.join(path, name)}: refused: its .metadata places {brief(second)} in "
                                      f"bytes of {brief(first)} (at {start:,}): each piece is stored apart")


def is_file_name(name):
    """Whether name (from a .metadata) names a file directly in a directory."""
    return isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") \
        and os.path.basename(name) == name and "\0" not in name


def entry_problem(entry, value):
    """Why a checkpoint's entry (DCP's metadata of it) cannot be read into value, or None."""
    if entry is None:
        return "is missing (a checkpoint of another model or optimizer)"
    if isinstance(value, torch.Tensor):
        if not isinstance(entry, TensorStorageMetadata):
            return "is declared plain data where this model holds a tensor"
        size = getattr(entry, "size", None)
        if not isinstance(size, torch.Size) or size != value.size():
            shape = tuple(size) if isinstance(size, torch.Size) and len(size) <= 8 else "of another kind"
            return f"has shape {shape}, not this model's {tuple(value.size())} (another model size)"
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if dtype != value.dtype:  # the load would cast it: a bool's 0s and 1s as moments
            declared = dtype if isinstance(dtype, torch.dtype) else brief(dtype)
            return f"is declared {declared}, where this model holds {value.dtype}"
        return tiling_problem(getattr(entry, "chunks", None), size)
    if not isinstance(entry, BytesStorageMetadata):
        return "is declared a tensor where this model holds plain data"
    return None


def tiling_problem(chunks, size):
    """Why chunks (DCP's ChunkStorageMetadata of a tensor of size) do not tile it exactly, or None:
    a gap would leave that part of the tensor as it was before the load (a fresh init), and DCP
    never writes chunks that overlap (pieces read into one place, and often a gap elsewhere)."""
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        return f"has no list of at most {MAX_CHUNKS} chunks"
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (isinstance(chunk, ChunkStorageMetadata) and isinstance(offsets, torch.Size)
                and isinstance(sizes, torch.Size) and len(offsets) == len(sizes) == len(size)):
            return "has a chunk that is not a block of its shape"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            return f"has a chunk outside it ({tuple(sizes)} at {tuple(offsets)})"
    starts = torch.tensor([list(c.offsets) for c in chunks], dtype=torch.int64).reshape(len(chunks), len(size))
    ends = starts + torch.tensor([list(c.sizes) for c in chunks], dtype=torch.int64).reshape(len(chunks), len(size))
    volumes = (ends - starts).prod(dim=1)
    nonempty = volumes > 0
    overlaps = ((starts[:, None] < ends[None]) & (starts[None] < ends[:, None])).all(dim=2)
    overlaps &= nonempty[:, None] & nonempty[None]
    overlaps.fill_diagonal_(False)
    if overlaps.any():
        return "has chunks that overlap"
    if volumes.sum() != size.numel():
        return "has chunks that leave part of it unread"
    return None


def load_error(error):
    """Why torch.load failed, in one short line: without its advice to try weights_only=False."""
    detail = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", first_line(error))
    return f"{type(error).__name__}: {detail.group(1) if detail else first_line(error)}"
