# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The scanner of a ``torch.save`` file's pickle: what torch's weights-only loader would do, counted before it does
it (see :mod:`.torch_file`).

The scanner is the restricted unpickler (:mod:`.unpickler`) with other calls allowed: it builds the containers
(their dict keys and set members are hashed under its counts) and stands for everything else (tensors, storages,
dtypes) with an opaque value. The calls it lets through are the ones ``torch.save`` writes for dense tensors,
parameters and plain containers, each with its arguments checked and what it makes counted against the file's size;
any other call is refused, although torch's loader may allow it (a legacy tensor constructor given a size, a device
tensor copied from a memoized one, a nested tensor's view of a buffer).
"""

import _compat_pickle
import pickle
from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Tuple

import torch

from .errors import PickleScanError
from .reader import HashingReader
from .text import printable
from .unpickler import HASHING_CALLS, PLAIN_CALLS, ArgsCheck, RestrictedUnpickler, check_items

__all__ = ["Opaque", "TorchSaveScanner"]

_UTILS = "torch._utils"
_VIEWS = {  # rebuilds of a tensor viewing a storage: the position of (storage, offset, size, stride), of the dtype
    (_UTILS, "_rebuild_tensor"): None,
    (_UTILS, "_rebuild_tensor_v2"): None,
    (_UTILS, "_rebuild_tensor_v3"): 6,  # an untyped storage and the dtype
}
# Calls on a tensor that make no new data: a parameter around it.
_WRAPPERS = {(_UTILS, "_rebuild_parameter"), (_UTILS, "_rebuild_parameter_with_state")}
# Tensors other than dense ones (wgit's store cannot keep them: numpy has no array for them), refused here: torch's
# rebuilds of them do costly work with arguments the file gives (a layout hashed as a tuple tower, quantizer scales
# as memoized nested lists: gigabytes from a few hundred KB; a review, session 48).
_UNSTORABLE = {
    (_UTILS, "_rebuild_sparse_tensor"): "a sparse tensor (save .to_dense())",
    ("torch.serialization", "_get_layout"): "a sparse tensor (save .to_dense())",
    (_UTILS, "_rebuild_qtensor"): "a quantized tensor (save .dequantize())",
    (_UTILS, "_rebuild_meta_tensor_no_storage"): "a meta tensor (materialize it first)",
    (_UTILS, "_rebuild_nested_tensor"): "a nested tensor (save .unbind() or .to_padded_tensor(0.0))",
}
_MAX_DIMS = 64  # torch's limit on a tensor's dimensions
_FROM_TYPE = ("torch._tensor", "_rebuild_from_type_v2")
_PARAMETER = ("torch.nn.parameter", "Parameter")


class Opaque:
    """What the scanner makes of a value it does not build: a name, a storage (``itemsize`` bytes per element,
    ``nbytes`` in all), a tensor. Hashes by identity, as a tensor does, so as a key it costs what the real value
    costs."""

    def __init__(self, name: Tuple[str, str], kind: str = "name", itemsize: int = 1, nbytes: int = 0) -> None:
        self.name, self.kind, self.itemsize, self.nbytes = name, kind, itemsize, nbytes


def _check_encode(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # pickle protocol 2 writes bytes as _codecs.encode(str, "latin1"): one byte per character. Other codecs cost
    # more (punycode is quadratic: 40 s for an 86 KB file, found by a review).
    if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
        return "pickle writes _codecs.encode(str, 'latin1') only"
    return None


# The calls torch's weights-only loader allows that hash or copy their arguments: run for real, under the restricted
# unpickler's checks and counts. Every other name the pickle uses stands for an opaque value.
_BUILT: Dict[Tuple[str, str], Optional[ArgsCheck]] = {
    **{k: PLAIN_CALLS[k] for k in [("collections", "OrderedDict"), ("builtins", "set"), ("torch", "Size")]},
    **{k: PLAIN_CALLS[k] for k in [("builtins", "complex"), ("builtins", "bytearray"), ("torch", "device")]},
    ("collections", "Counter"): check_items,
    ("_codecs", "encode"): _check_encode,
}


class TorchSaveScanner(RestrictedUnpickler):
    """The restricted unpickler's counts on a checkpoint's pickle; calls of tensors' rebuilds checked and counted.

    Args:
        reader: the pickle's bytes, read at most to its size.
        budget: the checkpoint file's size: storages, bytes and the like may take at most twice that, views of
            storages (tensors) eight times (several tensors may view one storage: tied weights).
    """

    allowed_globals: ClassVar[Dict[Tuple[str, str], Optional[ArgsCheck]]] = _BUILT
    # The wording of the refusals that say why such files are refused: the tensors a reader takes (dense ones) and
    # whether it copies them.
    unstorable: ClassVar[str] = "which fairscale does not load from a file (only dense tensors)"
    dense_only: ClassVar[str] = "the only ones fairscale loads from a file"
    copies: ClassVar[str] = "a file's tensors take no more than its bytes, and a reader may copy each of them"
    hashing_calls: ClassVar[FrozenSet[Tuple[str, str]]] = HASHING_CALLS | {("collections", "Counter")}
    metastack: List[List[Any]]  # pickle's: the stacks below each open MARK
    proto: int

    def __init__(self, reader: HashingReader, budget: int, storage_keys: Dict[str, Tuple[int, int]]) -> None:
        super().__init__(reader, budget)
        self.encoding = "utf-8"  # as torch's loader decodes protocol-0 strings
        # key -> (item size, bytes), for the whole file (a legacy file's pickles share it).
        self._storage_keys = storage_keys
        self._viewed = 0

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # torch's loader maps Python 2 names as pickle does (__builtin__.set is builtins.set)
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) in _BUILT:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype: its item size counts (_rebuild_tensor_v3)
        return Opaque((module, name))  # never imported here: torch's loader decides whether it may be named

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, numel[, view]): torch allocates numel elements for each new key
        # (a legacy file before reading them; a zip one reads the entry of that key). torch.save's keys are strings:
        # others would be hashed by torch (a tuple tower) and are refused.
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and type(pid[2]) is str and type(pid[4]) is int):
            raise PickleScanError(f"it refers to a storage as {_shown_pid(pid)}, which torch.save never writes")
        view = pid[5] if len(pid) == 6 else None
        if view is not None and not (isinstance(view, tuple) and len(view) == 3 and type(view[0]) is str):
            raise PickleScanError("it refers to a storage view torch.save never writes")
        # torch keeps the first storage loaded under a key (and its type) for every later reference to that key.
        if not pid[2] or any(c in pid[2] for c in "/\\\0") or pid[2] in (".", ".."):
            # A zip checkpoint's storage is its record data/<key>: a key naming a folder ("0/") read as a directory
            # gave a tensor of uninitialized memory (a review, session 48). torch.save's keys are numbers.
            raise PickleScanError(f"it names a storage {printable(pid[2][:40])!r}; torch.save numbers them")
        if pid[2] not in self._storage_keys:
            itemsize = _element_size(pid[1])
            self._storage_keys[pid[2]] = (itemsize, max(pid[4], 0) * itemsize)
            self._spend_bytes(self._storage_keys[pid[2]][1], "its storages")
        return Opaque(("persistent", "storage"), "storage", *self._storage_keys[pid[2]])

    def _spend_bytes(self, size: int, what: str) -> None:
        self._allocated += size
        if self._allocated > 2 * self._budget:
            raise PickleScanError(
                f"{what} would take more than {2 * self._budget} bytes, more than twice the file's {self._budget} "
                "bytes (values repeated through pickle's memo, or declared larger than they are)"
            )

    def _spend(self, made: Any) -> None:
        if isinstance(made, bytes):
            self._spend_bytes(len(made), "its values")
        elif isinstance(made, torch.Size):  # a copy of the items: two bytes each in the pickle at least
            self._spend_bytes(2 * len(made), "its values")
        else:
            super()._spend(made)

    def _load_reduce(self) -> None:
        func = self.stack[-2]
        if not isinstance(func, Opaque):
            super()._load_reduce()
            return
        args = self.stack.pop()
        self.stack[-1] = self._opaque_call(func, args)

    def _load_newobj(self) -> None:
        cls, args = self.stack[-2:]
        if not isinstance(cls, Opaque):
            super()._load_newobj()
            return
        # torch's loader makes nn.Parameter(*args), and cls.__new__(cls, *args) of the classes it allows: of a tensor
        # class, an allocation of the size the file gives.
        if cls.name != _PARAMETER or not (isinstance(args, tuple) and 1 <= len(args) <= 2 and _is_tensor(args[0])):
            raise PickleScanError(f"it makes a {'.'.join(cls.name)} by NEWOBJ, which torch.save never writes")
        del self.stack[-1]
        self.stack[-1] = Opaque(cls.name, "tensor")

    def _opaque_call(self, func: Opaque, args: Any) -> Opaque:
        """What a call of ``func`` makes, its arguments checked and its data counted; other calls are refused."""
        if type(args) is not tuple:
            raise PickleScanError(f"it calls {'.'.join(func.name)} with {type(args).__name__} arguments")
        if func.name == _FROM_TYPE:  # _rebuild_from_type_v2(func, new_type, args, state): func(*args) first
            if len(args) != 4 or not isinstance(args[0], Opaque) or args[0].name == _FROM_TYPE:
                raise PickleScanError("it calls _rebuild_from_type_v2 with arguments torch.save never writes")
            _check_tensor_state(args[3])
            return self._opaque_call(args[0], args[2])
        if func.name == (_UTILS, "_rebuild_parameter_with_state"):
            _check_tensor_state(args[3] if len(args) == 4 else None)
        if func.name in _UNSTORABLE:
            raise PickleScanError(f"it holds {_UNSTORABLE[func.name]}, {self.unstorable}")
        if func.name in _VIEWS:
            self._count_view(func.name, args)
        elif func.name in _WRAPPERS:
            if not args or not _is_tensor(args[0]):
                raise PickleScanError(f"it calls {func.name[1]} on what torch.save never writes there")
        else:
            raise PickleScanError(
                f"it calls {'.'.join(func.name)}, which torch.save does not write for dense tensors and plain "
                f"containers ({self.dense_only}); torch's loader would run it with the file's arguments"
            )
        return Opaque(func.name, "tensor")

    def _count_view(self, name: Tuple[str, str], args: Tuple[Any, ...]) -> None:
        """A tensor of ``size`` viewing a storage: its bytes are counted (a view larger than its storage grew a
        legacy storage; a reader may copy every tensor)."""
        dtype_at = _VIEWS[name]
        if len(args) < 4 or not (isinstance(args[0], Opaque) and args[0].kind == "storage"):
            raise PickleScanError(f"it calls {name[1]} without the storage torch.save writes")
        size, stride = args[2], args[3]
        if not isinstance(size, tuple) or not all(type(d) is int and d >= 0 for d in size) or len(size) > _MAX_DIMS:
            raise PickleScanError(f"it calls {name[1]} with a size torch.save never writes")
        if not isinstance(stride, tuple) or len(stride) != len(size) or not all(type(d) is int for d in stride):
            raise PickleScanError(f"it calls {name[1]} with a stride torch.save never writes")
        offset, itemsize = args[1], args[0].itemsize
        if type(offset) is not int or offset < 0:
            raise PickleScanError(f"it calls {name[1]} with a storage offset torch.save never writes")
        if dtype_at is not None:
            dtype = args[dtype_at] if len(args) > dtype_at else None
            if not isinstance(dtype, torch.dtype):
                raise PickleScanError(f"it calls {name[1]} without the dtype torch.save writes")
            itemsize = dtype.itemsize
        # torch keeps a tensor's sizes and strides apart from its data: 16 bytes a dimension, however few elements.
        self._viewed += 16 * len(size)
        limit, nbytes = 8 * self._budget + 2**20, itemsize
        for d in (*size, 1):  # multiplied one dimension at a time, stopping past the limit
            nbytes *= d
            if self._viewed + nbytes > limit:
                raise PickleScanError(
                    f"its tensors would take more than {limit} bytes, eight times the file's {self._budget} bytes "
                    f"(views larger than their storage, or one storage viewed many times): {self.copies}"
                )
        self._viewed += nbytes
        _check_inside(name[1], args[0].nbytes, offset, size, stride, itemsize)

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, Opaque):
            # torch's loader calls Tensor.set_(*state) on a tensor (a view of any size, growing its storage) and
            # updates a storage's attributes (another storage in its place: the one read from the file was not the
            # one the tensors view, which kept uninitialized memory; a review, session 48).
            raise PickleScanError(f"it sets the state of a {inst.kind} (pickle's BUILD), which torch.save never writes")
        super()._load_build()

    def _load_setitem(self, count: Optional[int]) -> None:
        target = self.stack[-3] if count is not None else self._below_mark()
        if not isinstance(target, Opaque):
            super()._load_setitem(count)
            return
        items = self.pop_mark() if count is None else self.stack[-2:]
        if count is not None:
            del self.stack[-2:]
        self._count_hashing(items[0::2], target)

    def _load_append(self, many: bool) -> None:
        target = self._below_mark() if many else self.stack[-2]
        if not isinstance(target, Opaque):
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


def _check_inside(
    call: str, storage_bytes: int, offset: int, size: Tuple[int, ...], stride: Any, itemsize: int
) -> None:
    """A tensor lies inside its storage (torch.save writes no other): a legacy storage declared with 0 elements and
    viewed again larger was handed out unregistered, grown by the view, and never filled (uninitialized memory
    stored), or grown to a gigabyte by one large stride (a review, session 49)."""
    if 0 in size:
        return  # an empty tensor reads nothing of its storage
    if any(s < 0 for s in stride):
        raise PickleScanError(f"it calls {call} with a negative stride, which torch.save never writes")
    last = offset + sum((d - 1) * s for d, s in zip(size, stride))
    if (last + 1) * itemsize > storage_bytes:
        raise PickleScanError(
            f"it calls {call} with a view reaching element {last} of a storage of {storage_bytes} bytes "
            f"({storage_bytes // max(itemsize, 1)} elements): torch.save writes tensors inside their storage"
        )


def _check_tensor_state(state: Any) -> None:
    """The attributes torch's loader sets on a rebuilt tensor or parameter (``setattr`` of each name): a name of a
    tensor's own (``detach``, which wgit calls) made ``wgit add`` fail with a traceback or store other data (a
    review, session 48). torch.save writes the instance's ``__dict__`` (and slots), which holds none of them."""
    dicts = list(state) if isinstance(state, tuple) else [state]
    for d in dicts:
        if d is None:
            continue
        if not isinstance(d, dict) or not all(type(k) is str for k in d):
            raise PickleScanError("it sets a tensor's attributes from a state torch.save never writes")
        shadowing = sorted(k for k in d if k.startswith("__") or hasattr(torch.nn.Parameter, k))
        if shadowing:
            raise PickleScanError(
                f"it sets the attribute(s) {shadowing[:5]} of a tensor, which tensors have themselves; torch.save "
                "writes a tensor's own added attributes only"
            )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Opaque) and value.kind == "tensor"


def _shown_pid(pid: Any) -> str:
    return f"a {type(pid).__name__}" if not isinstance(pid, tuple) else f"a tuple of {len(pid)} items"


def _element_size(storage_type: Any) -> int:
    """Bytes per element of a storage type a checkpoint names (torch.FloatStorage: 4; untyped storages: 1).

    Only a storage class's name is taken: torch reads ``.dtype`` of whatever the file puts there (another storage
    of 16-byte elements was counted as 1 byte each: a review, session 48).
    """
    name = storage_type.name if isinstance(storage_type, Opaque) and storage_type.kind == "name" else ("", "")
    if name == ("torch.storage", "UntypedStorage"):
        return 1
    dtype = None
    if name[0] in ("torch", "torch.cuda") and name[1].endswith("Storage"):
        dtype = getattr(getattr(torch, name[1], None), "dtype", None)  # the typed storage classes warn when read
    if not isinstance(dtype, torch.dtype):
        raise PickleScanError(f"it names a storage of type {_shown_name(storage_type)}, not a torch storage class")
    return dtype.itemsize


def _shown_name(value: Any) -> str:
    return ".".join(value.name) if isinstance(value, Opaque) else f"a {type(value).__name__}"
