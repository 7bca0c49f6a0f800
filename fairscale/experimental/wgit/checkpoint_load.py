# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How wgit loads a checkpoint one adds: scanned, then ``torch.load(weights_only=True)`` (see :mod:`.safety`).

torch's weights-only loader runs no code, but it does what the file's pickle says with the calls it allows: it hashes
whatever dict keys the pickle builds (a tuple shared at every level as a key hashed ``2**depth`` tuples: ``wgit add``
of a 500-byte file never returned) and calls the legacy tensor constructors with the sizes the file gives
(``torch.FloatTensor(2**30)`` allocated 4 GB for a 100-byte file). So the pickle is first walked by a scanner that
builds nothing but its containers: every name stands for an opaque value, except the few calls that hash or copy
their arguments, which run under the store unpickler's counts (:mod:`.store_pickle`).
"""

import os
import pickle
import stat
import warnings
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, ClassVar, Dict, FrozenSet, List, Optional, Set, Tuple

import torch

from fairscale.internal.errors import FairscaleValueError

from .safety import UntrustedContentError, _kind, nesting_problem
from .store_pickle import (
    _ALLOWED_GLOBALS,
    _HASHING_CALLS,
    PICKLE_ERRORS,
    _ArgsCheck,
    _check_items,
    _HashingReader,
    _StoreUnpickler,
)

__all__ = ["load_checkpoint"]


def load_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, after :func:`scan_checkpoint`; a file either refuses raises
    :class:`UntrustedContentError`, and so does one whose containers nest too deep or hold themselves
    (:func:`nesting_problem`).

    The message keeps upstream's leading ``"incorrect input"`` (its store rejected plain pickles with an assert).
    """
    try:
        with _open_checkpoint(path) as f, warnings.catch_warnings():
            # torch warns about the pickle protocol of files it then refuses (the error says what matters), and about
            # its typed storages, which the scan names.
            warnings.simplefilter("ignore")
            scan_checkpoint(f, os.fstat(f.fileno()).st_size)
            f.seek(0)
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise  # a missing or unreadable file: the system's error names it
    except FairscaleValueError as e:
        if isinstance(e, UntrustedContentError):  # the scan's refusal, named like torch's below
            raise UntrustedContentError(f"incorrect input {path}: {e}. {_WHAT_TO_ADD}") from None
        raise  # not a regular file: _open_checkpoint says so
    except Exception as e:  # noqa: B902  # whatever torch.load raises on a bad file, the file is refused
        raise UntrustedContentError(f"incorrect input {path}: {_torch_refusal(e)}. {_WHAT_TO_ADD}") from None
    # torch's loader builds any nesting without recursing; wgit's walks (and copy.deepcopy, pickle) recurse.
    problem = nesting_problem(obj)
    if problem is not None:
        raise UntrustedContentError(
            f"incorrect input {path}: it {problem}. wgit stores checkpoints of tensors in dicts and lists nested a few "
            "levels deep, none inside itself"
        )
    return obj


_WHAT_TO_ADD = (
    "wgit loads checkpoints with torch.load(weights_only=True) and never runs code from them: add files written by "
    "torch.save of tensors, dicts and lists (e.g. torch.save(model.state_dict(), path))"
)


def _open_checkpoint(path: Path) -> BinaryIO:
    """``path`` opened for binary reading, refused with ``FairscaleValueError`` unless it is a regular file.

    A checkpoint is the user's own file, so a link to one is followed (unlike entries inside ``.wgit``); but a named
    pipe, a device or a socket is refused: ``torch.load`` on a named pipe blocked ``wgit add`` forever. It is opened
    without waiting for a pipe's writer and checked on the open file, so an entry swapped in meanwhile is refused too.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FairscaleValueError(
                f"incorrect input {path}: it is {_kind(mode)}, not a regular file; wgit adds checkpoint files written by "
                "torch.save"
            )
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def _torch_refusal(error: BaseException) -> str:
    text = str(error)
    marker = "GLOBAL "
    if marker in text:
        name = text.split(marker, 1)[1].split()[0]
        return f"it holds {name}, which is not a tensor or a plain container"
    if isinstance(error, pickle.UnpicklingError):
        return "not a torch.save checkpoint of tensors and plain containers (a plain pickle, or other objects)"
    first = text.strip().splitlines()[0][:160] if text.strip() else type(error).__name__
    return f"not a readable torch.save checkpoint ({first})"


def scan_checkpoint(f: BinaryIO, size: int) -> None:
    """Walk the pickle(s) torch's loader would run on ``f`` (``size`` bytes) without building their objects.

    A zip checkpoint (what ``torch.save`` writes) has one pickle, ``<name>/data.pkl``, and stores its entries
    uncompressed; a legacy one (``_use_new_zipfile_serialization=False``) starts with four pickles in a row.

    Raises:
        UntrustedContentError: the pickle's dict keys and set members take more hashing than its bytes can hold, a
            call would allocate or copy more than the file holds, it calls a tensor or storage class (torch.save
            never does), a zip entry is compressed, or the bytes are not such a checkpoint.
    """
    try:
        if zipfile.is_zipfile(f):
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                entries = [e for e in archive.infolist() if e.filename.endswith("data.pkl")]
                packed = next((e for e in archive.infolist() if e.compress_type != zipfile.ZIP_STORED), None)
                if packed is not None:  # torch's reader inflates it whole: a zip bomb
                    raise UntrustedContentError(
                        f"its entry {packed.filename!r} is compressed; torch.save stores its entries uncompressed"
                    )
                if len(entries) != 1:
                    raise UntrustedContentError("it is a zip file without the one data.pkl that torch.save writes")
                with archive.open(entries[0]) as pickled:
                    _CheckpointScanner(_HashingReader(pickled, entries[0].file_size), size).load()
        else:
            f.seek(0)
            reader = _HashingReader(f, size)
            for _ in range(4):  # magic number, protocol, system info, then the objects
                _CheckpointScanner(reader, size).load()
    except UntrustedContentError:
        raise
    except (*PICKLE_ERRORS, zipfile.BadZipFile) as e:
        raise UntrustedContentError(f"not a readable torch.save checkpoint ({str(e)[:160] or type(e).__name__})")


class _Opaque:
    """What the scanner makes of anything it does not build: a name, a call's result, a storage. Hashes by
    identity, so as a key it costs what Python's own objects of those kinds cost (a tensor hashes by identity)."""

    def __init__(self, name: Tuple[str, str]) -> None:
        self.name = name


def _check_encode(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # pickle protocol 2 writes bytes as _codecs.encode(str, "latin1"): as many bytes as the string has characters.
    if len(args) != 2 or not all(isinstance(a, str) for a in args):
        return "pickle writes _codecs.encode(str, encoding) only"
    return None


# The calls torch's weights-only loader allows that hash or copy their arguments: run for real, under the store
# unpickler's checks and counts. Every other name the pickle uses stands for an opaque value.
_BUILT: Dict[Tuple[str, str], Optional[_ArgsCheck]] = {
    **{k: _ALLOWED_GLOBALS[k] for k in [("collections", "OrderedDict"), ("builtins", "set"), ("torch", "Size")]},
    **{k: _ALLOWED_GLOBALS[k] for k in [("builtins", "complex"), ("builtins", "bytearray"), ("torch", "device")]},
    ("collections", "Counter"): _check_items,
    ("_codecs", "encode"): _check_encode,
}
_TENSOR_MODULES = ("torch", "torch.cuda", "torch.sparse", "torch.storage")


class _CheckpointScanner(_StoreUnpickler):
    """The store unpickler's counts on a checkpoint's pickle, with every name it does not build opaque."""

    allowed_globals: ClassVar[Dict[Tuple[str, str], Optional[_ArgsCheck]]] = _BUILT
    metastack: List[List[Any]]  # pickle's: the stacks below each open MARK
    hashing_calls: ClassVar[FrozenSet[Tuple[str, str]]] = _HASHING_CALLS | {("collections", "Counter")}

    def __init__(self, reader: _HashingReader, budget: int) -> None:
        super().__init__(reader, budget)
        self._storages: Set[Any] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _BUILT:
            return super().find_class(module, name)
        return _Opaque((module, name))  # never imported here: torch's loader decides whether it may be named

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, numel[, view]): torch allocates numel elements for each new key
        # (a legacy file, with the view, before reading them; a zip one reads the entry of that key). A key other
        # than a string is told apart by identity: it is never hashed here.
        if isinstance(pid, tuple) and len(pid) in (5, 6) and type(pid[4]) is int:
            key = pid[2] if type(pid[2]) is str else id(pid[2])
            if key not in self._storages:
                self._storages.add(key)
                self._spend_bytes(max(pid[4], 0) * _element_size(pid[1]), "its storages")
        return _Opaque(("persistent", "storage"))

    def _spend_bytes(self, size: int, what: str) -> None:
        self._allocated += size
        if self._allocated > 2 * self._budget:
            raise UntrustedContentError(
                f"{what} would take more than {2 * self._budget} bytes, more than the file's {self._budget} bytes "
                "hold (values repeated through pickle's memo, or declared larger than they are)"
            )

    def _spend(self, made: Any) -> None:
        if isinstance(made, bytes):
            self._spend_bytes(len(made), "its values")
        elif isinstance(made, torch.Size):  # a copy of the items it was made from
            self._spend_bytes(8 * len(made), "its values")
        else:
            super()._spend(made)

    def _load_reduce(self) -> None:
        self._call(super()._load_reduce)

    def _load_newobj(self) -> None:
        self._call(super()._load_newobj)

    def _call(self, store_handler: Callable[[], None]) -> None:
        """REDUCE or NEWOBJ: a built name's call is the store unpickler's; an opaque one's makes an opaque value."""
        func = self.stack[-2]
        if not isinstance(func, _Opaque):
            store_handler()
            return
        args = self.stack.pop()
        self._check_opaque_call(func, args)
        self.stack[-1] = _Opaque(func.name)

    def _check_opaque_call(self, func: _Opaque, args: Any) -> None:
        # torch.save writes tensors as _rebuild_* calls on storages; a legacy tensor or storage constructor takes its
        # size from the file, and torch's loader also calls one that _rebuild_from_type_v2 is given.
        called = [func, *(args[:1] if func.name == ("torch._tensor", "_rebuild_from_type_v2") else ())]
        for c in called:
            if isinstance(c, _Opaque) and c.name[0] in _TENSOR_MODULES and c.name[1].endswith(("Tensor", "Storage")):
                raise UntrustedContentError(
                    f"it calls {'.'.join(c.name)}, which allocates what the file asks for; torch.save never writes "
                    "such a call"
                )

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], _Opaque):
            self.stack.pop()
            return
        super()._load_build()

    def _load_setitem(self, count: Optional[int]) -> None:
        target = self.stack[-3] if count is not None else self._below_mark()
        if not isinstance(target, _Opaque):
            super()._load_setitem(count)
            return
        items = self.pop_mark() if count is None else self.stack[-2:]
        if count is not None:
            del self.stack[-2:]
        self._count_hashing(items[0::2], target)

    def _load_append(self, many: bool) -> None:
        target = self._below_mark() if many else self.stack[-2]
        if not isinstance(target, _Opaque):
            super()._load_append(many)
        elif many:
            self.pop_mark()
        else:
            self.stack.pop()

    def _below_mark(self) -> Any:
        """What lies below the last MARK: what SETITEMS and APPENDS add to."""
        if not self.metastack or not self.metastack[-1]:
            raise pickle.UnpicklingError("SETITEMS or APPENDS with nothing to add to")
        return self.metastack[-1][-1]


def _element_size(storage_type: Any) -> int:
    """Bytes per element of a storage type a checkpoint names (torch.FloatStorage: 4; untyped storages: 1)."""
    name = storage_type.name if isinstance(storage_type, _Opaque) else ("", "")
    dtype = getattr(getattr(torch, name[1], None), "dtype", None) if name[0] in ("torch", "torch.cuda") else None
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 1
