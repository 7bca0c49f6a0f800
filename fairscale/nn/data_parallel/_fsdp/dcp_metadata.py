# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Reading a DCP checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint`` writes the metadata with ``pickle`` and its ``FileSystemReader`` reads it back with
``pickle.load``, which calls whatever the file names: a checkpoint directory from someone else could run code on
every rank that loads it. :func:`fairscale.nn.data_parallel.dcp.load` reads it with :class:`MetadataUnpickler`
instead, which resolves only what DCP's metadata is made of (its dataclasses and enums, ``torch.Size``, dtypes and
layouts, paths and plain containers) and raises :class:`UntrustedCheckpointError` for anything else. In the data
files each entry is a ``torch.save``'s bytes: the load's reader scans each (:mod:`.dcp_load`), and the objects, which
DCP's planner would read with ``torch.load(weights_only=False)``, are read with ``weights_only=True``.
"""

import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import stat
import struct
from typing import IO, Any, Dict, FrozenSet, List, Optional, Tuple

import torch

from fairscale.internal.errors import FairscaleValueError

__all__ = [
    "UntrustedCheckpointError",
    "MetadataUnpickler",
    "unpickle_metadata",
    "read_metadata",
    "coverage_problem",
    "check_regular_file",
    "storage_problem",
]

# Modules whose dataclasses and enums make up DCP's metadata (Metadata, TensorStorageMetadata, ChunkStorageMetadata,
# TensorProperties, StorageMeta, the memory-format enum ...; the file system reader's _StorageInfo). Older torch
# releases kept TensorProperties and its enum with the sharded-tensor metadata.
_DCP_MODULES: FrozenSet[str] = frozenset(
    [
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed._shard.sharded_tensor.metadata",
        "torch.distributed._shard.metadata",
    ]
)

# Other globals the metadata names: values and constructors that build data, never code to run.
_ALLOWED_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    [
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),  # a layout (torch.strided) from its name
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    ]
)


class UntrustedCheckpointError(FairscaleValueError):
    """A checkpoint file names something to unpickle that a DCP checkpoint never contains; nothing was run."""


# Python's own unpickler (typeshed knows it only as an alias of the C one's type).
_PyUnpickler: Any = getattr(pickle, "_Unpickler")


class MetadataUnpickler(_PyUnpickler):  # type: ignore[misc]
    """Resolves only the globals a DCP ``.metadata`` is made of (module docstring); nothing else can be called.

    Python's own (pure-Python) unpickler, not the C one, for one opcode: BUILD sets the state of the object under it,
    and with a class there (``GLOBAL pathlib.Path``, then a slot state) it sets attributes on that class, for the
    whole process: a checkpoint could make ``Path.is_symlink`` answer anything, and every later symlink check with it.
    The C unpickler cannot be told otherwise. About 1.7 times the C one's time (2 s for 40,000 chunks).
    """

    dispatch: Dict[int, Any] = dict(_PyUnpickler.dispatch)

    def load_build(self) -> None:
        target = self.stack[-2]
        cls = type(target)
        # DCP's metadata builds only instances of its own dataclasses this way.
        if isinstance(target, type) or not dataclasses.is_dataclass(cls) or cls.__module__ not in _DCP_MODULES:
            raise UntrustedCheckpointError(
                f"it sets the state of a {cls.__module__}.{cls.__qualname__} (BUILD), which DCP's metadata never does"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "pathlib._local" and ("pathlib", name) in _ALLOWED_GLOBALS:
            # Python 3.13 moved the path classes into pathlib._local (pickles written there name it); pathlib
            # still exports them, and earlier Pythons have no such module: read them from pathlib.
            return getattr(pathlib, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module in _DCP_MODULES and "." not in name:
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise UntrustedCheckpointError(
            f"it names {module}.{name}, which is not part of a DCP checkpoint's metadata; it was not written by "
            "torch.distributed.checkpoint, and fairscale never runs code from a checkpoint"
        )

    def load_bytearray8(self) -> None:
        # pickle allocates (zero-filled) the declared size before reading: 28 bytes of file declaring 2 GB took 2 GB
        # on every rank reading the checkpoint (found by a security review, session 42). BINBYTES8 and BINUNICODE8
        # read at most what the file holds (unpickle_metadata reads from memory).
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._file_size:
            raise UntrustedCheckpointError(f"it declares a bytearray of {size} bytes, more than the file holds")
        data = bytearray(size)
        self.readinto(data)
        self.append(data)

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8
    _file_size = 0

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError("it refers to external (persistent) objects, which DCP's metadata never does")


def unpickle_metadata(f: IO[bytes], path: str) -> Any:
    """Unpickle a ``.metadata`` file with :class:`MetadataUnpickler`.

    Raises:
        UntrustedCheckpointError: the file names anything DCP's metadata is not made of.
    """
    data = f.read()
    unpickler = MetadataUnpickler(io.BytesIO(data))
    unpickler._file_size = len(data)
    try:
        return unpickler.load()
    except UntrustedCheckpointError as e:
        raise UntrustedCheckpointError(f"refusing {path!r}: {e}") from None


def read_metadata(reader: Any, rank: Optional[int] = None) -> Any:
    """What ``FileSystemReader.read_metadata`` returns, read with :class:`MetadataUnpickler`.

    Args:
        reader: a ``torch.distributed.checkpoint.FileSystemReader``.
        rank: the rank whose own metadata file to read (DCP's argument), or ``None`` for the checkpoint's.
    """
    # As torch's reader does (the helpers are private, so each is looked up with a fallback for other versions).
    get_path = getattr(reader, "_get_metadata_path", None)
    fs = getattr(reader, "fs", None)
    if get_path is not None:
        path = get_path(rank)
    elif fs is not None and hasattr(fs, "concat_path"):
        # torch 2.4-2.6: the reader's file system opens what its own concat_path makes (a Path; a str has no .open).
        path = fs.concat_path(reader.path, ".metadata")
    else:
        path = os.path.join(os.fspath(reader.path), ".metadata")
    if fs is None or type(fs).__name__ == "FileSystem":  # a local directory (not an fsspec file system)
        check_regular_file(os.fspath(path), "metadata file")
    with fs.create_stream(path, "rb") if fs is not None else open(path, "rb") as f:
        metadata = unpickle_metadata(f, os.fspath(path))
    storage_meta_cls = getattr(importlib.import_module("torch.distributed.checkpoint.metadata"), "StorageMeta", None)
    if storage_meta_cls is not None:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = storage_meta_cls()
        metadata.storage_meta.load_id = getattr(reader, "load_id", None)
    return metadata


def check_regular_file(path: str, what: str, end: int = 0) -> None:
    """Raise :class:`UntrustedCheckpointError` unless ``path`` is a regular file (not a symlink, pipe or device) of at
    least ``end`` bytes.

    DCP writes only regular files into the checkpoint's directory. Opened as they come, a ``.metadata`` that is a pipe
    blocked every rank's load, a link to ``/dev/zero`` filled the memory, and a link to another checkpoint's file
    loaded that checkpoint (a security review, session 50; the data files had this check already).
    """
    name = os.path.basename(path)
    try:
        info = os.lstat(path)
    except OSError as e:
        raise UntrustedCheckpointError(f"the checkpoint's {what} {name!r} cannot be read: {e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedCheckpointError(
            f"refusing the checkpoint's {what} {name!r}: it is not a regular file (a symlink, pipe or device); "
            "DCP writes regular files only"
        )
    if info.st_size < end:
        raise UntrustedCheckpointError(
            f"the checkpoint's {what} {name!r} has {info.st_size} bytes, but its metadata reads up to byte {end}: "
            "the checkpoint is truncated or damaged"
        )


def storage_problem(metadata: Any) -> Optional[str]:
    """Why a data file the metadata names is not a plain file name inside the checkpoint's directory, or ``None``.

    Checked on the metadata this package read safely, whichever reader then loads: a caller's own
    ``storage_reader`` (torch's ``FileSystemReader``) opened whatever the metadata named, ``../x`` or an absolute path
    included (a security review, session 50).
    """
    for info in getattr(metadata, "storage_data", {}).values():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and "\\" not in name
        if not plain or os.path.basename(str(name)) != name:
            return (
                f"it names the data file {name!r}: DCP writes plain file names inside the checkpoint directory, "
                "never a path"
            )
    return None


# At most this many pairs of chunks of one tensor are compared for overlap (chunks whose ranges along the swept
# dimension overlap: none for FSDP2's Shard(0) layout, a few per rank for box chunks); beyond it the volume, bounds
# and duplicate checks alone stand.
_MAX_OVERLAP_PAIRS = 20_000


def coverage_problem(metadata: Any) -> Optional[str]:
    """What is wrong with the saved chunks of the checkpoint's tensors, or ``None`` when each tensor's chunks tile it.

    A load reads into staging tensors that are not initialised (a copy of the shards would cost a full extra pass),
    and DCP's reader fills only what the saved chunks cover: an element no chunk covers (a chunk removed or shrunk in
    a tampered or badly merged ``.metadata``) was loaded as whatever memory held, silently. Each tensor's chunks must
    lie inside it, add up to its size and not overlap (compared in a sweep along one dimension).
    """
    # A list of chunks is checked once per shape however many keys share it: pickle writes a shared list once and
    # refers to it in a few bytes per key, so N keys on one list of N chunks cost N * N chunk checks (58 s for a
    # 100 KB file on every rank; a security review, session 50). torch's writer makes one list per key. (Chunks that
    # tile a shape tile no other: the shape is their union.)
    checked = set()
    for key, entry in getattr(metadata, "state_dict_metadata", {}).items():
        chunks = getattr(entry, "chunks", None)
        size = getattr(entry, "size", None)
        if chunks is None or size is None:
            continue  # not a tensor (bytes: read whole)
        shape = [int(d) for d in size]
        if (id(chunks), tuple(shape)) in checked:
            continue
        checked.add((id(chunks), tuple(shape)))
        problem = _tiling_problem(shape, chunks)
        if problem is not None:
            return f"{key}: {problem}"
    return None


def _tiling_problem(shape: List[int], chunks: Any) -> Optional[str]:
    numel = 1
    for d in shape:
        numel *= d
    volume = 0
    boxes: List[Tuple[List[int], List[int]]] = []
    for chunk in chunks:
        offsets, sizes = [int(o) for o in chunk.offsets], [int(n) for n in chunk.sizes]
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"a saved chunk has {len(offsets)} dimensions, the tensor {len(shape)}"
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return f"a saved chunk (offsets {offsets}, sizes {sizes}) lies outside the tensor {shape}"
        box = 1
        for n in sizes:
            box *= n
        if box:
            volume += box
            boxes.append((offsets, sizes))
    if volume < numel:
        return f"the saved chunks cover {volume} of the tensor's {numel} elements (shape {shape}); part of it was never saved"
    if volume > numel:
        return f"the saved chunks hold {volume} elements for the tensor's {numel} (shape {shape}): some of them overlap"
    if shape and len(boxes) > 1:
        if len({(tuple(o), tuple(n)) for o, n in boxes}) < len(boxes):
            return "a saved chunk appears twice: the saved chunks overlap"
        # Swept along the dimension the chunks are cut most along (the first for FSDP2's Shard(0), another for
        # column-wise chunks), so that few pairs share a range of it.
        dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in boxes}))
        boxes.sort(key=lambda b: b[0][dim])
        active: List[Tuple[List[int], List[int]]] = []  # boxes whose range along ``dim`` reaches the current one
        compared = 0
        for offsets, sizes in boxes:
            active = [box for box in active if box[0][dim] + box[1][dim] > offsets[dim]]
            for other_offsets, other_sizes in active:
                if all(a < b + m and b < a + k for a, k, b, m in zip(offsets, sizes, other_offsets, other_sizes)):
                    return f"the saved chunks at offsets {other_offsets} and {offsets} overlap"
            compared += len(active)
            if compared > _MAX_OVERLAP_PAIRS:
                break
            active.append((offsets, sizes))
    return None
