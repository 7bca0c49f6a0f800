# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The store's unpickler: what a store object may name, call and allocate (see :mod:`.safety`, which says what wgit
trusts and why).

The restricted unpickler of :mod:`fairscale.internal.pickle_scan.unpickler` (pickle's pure-Python unpickler with its
handlers replaced) with wgit's names: allowed globals are called only with the arguments pickle and numpy write for
them, BUILD sets the state of numpy arrays and dtypes, wgit records and OrderedDicts only, and nothing is read or
allocated past the object's size.
"""

import gzip
import pickle
import zlib
from typing import IO, Any, ClassVar, Dict, Optional, Tuple

from fairscale.internal.pickle_scan import PickleScanError
from fairscale.internal.pickle_scan.reader import PICKLE_ERRORS
from fairscale.internal.pickle_scan.reader import HashingReader as _HashingReader
from fairscale.internal.pickle_scan.text import shown as _shown
from fairscale.internal.pickle_scan.unpickler import PLAIN_CALLS, ArgsCheck, RestrictedUnpickler, check_complex

from .safety import CorruptStoreError, UntrustedContentError, nesting_problem

__all__ = ["load_store_object", "store_object_limit"]

# What a store object may name and call (see _StoreUnpickler). Each allowed (module, name) maps to None (it may only
# be named: an argument or a value) or to the check of the arguments it may be called with (REDUCE): the reason they
# are refused, or None. wgit writes numpy arrays (numpy 1 and 2 module paths, pickle protocols 2-5), the values that
# torch's weights-only loading lets a checkpoint hold (complex, bytearray, set, torch.Size, torch.device, torch
# dtypes) and its record of a tensor kept in the store; numpy scalars, frozensets and OrderedDicts were kept as
# upstream's store accepted them. The arguments allowed are the ones pickle and numpy write: a callable such as
# bytearray(n) would otherwise allocate n bytes for a few bytes of object.
_ArgsCheck = ArgsCheck


def _array_problem(shape: Any, spec: Any, budget: int) -> Optional[str]:
    """Why an array of ``shape`` and dtype ``spec`` cannot be in an object of ``budget`` bytes (``None``: it can).

    numpy allocates an array before it reads the array's data, so the size is checked against the bytes the object
    holds (wgit's arrays fit: their data is in those bytes). Arrays of Python objects never come from a tensor.
    """
    import numpy as np

    dims = shape if isinstance(shape, tuple) else (shape,)
    if not all(type(d) is int and d >= 0 for d in dims):
        return "the shape is not one numpy writes (dimensions are non-negative ints)"
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError):
        return f"{_shown(spec)} is not a numpy dtype"
    # A structured, subarray or void dtype never comes from a tensor either: through one a BUILD hid an object field
    # (a pointer read from the file, a segfault when read) and multiplied the size checked below (found by a
    # security review, session 42).
    if dtype.hasobject or dtype.kind in "OV" or dtype.fields is not None or dtype.subdtype is not None:
        return "an array of Python objects, or of a structured, subarray or void dtype, never comes from a tensor"
    if dtype.kind not in "biufc":  # strings, dates: torch.from_numpy failed on them with its own TypeError
        return f"an array of {dtype} never comes from a tensor"
    if 0 in dims:
        return None
    # Multiplied one dimension at a time, stopping past the budget: math.prod of a thousand 80,000-bit dimensions
    # (one memoized int) took minutes for a 12 KB object (found by a review, session 47).
    nbytes = dtype.itemsize
    for i, d in enumerate(dims):
        nbytes *= d
        if nbytes > budget:
            more = "at least " if i < len(dims) - 1 else ""
            shown = str(nbytes) if nbytes.bit_length() <= 64 else "more than 2**64"  # str() of a huge int raises
            return f"the array would take {more}{shown} bytes, more than the {budget} bytes the object can hold"
    return None


def _check_reconstruct(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    import numpy as np

    # numpy writes _reconstruct(ndarray, (0,), b"b"): an empty array, which BUILD then fills.
    if len(args) != 3 or args[0] is not np.ndarray:
        return "numpy writes _reconstruct(ndarray, shape, dtype) only"
    return _array_problem(args[1], args[2], budget)


def _check_scalar(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # numpy writes scalar(dtype, bytes); without the bytes it allocates the dtype's item size, zero-filled.
    if len(args) not in (1, 2) or (len(args) == 2 and not isinstance(args[1], bytes)):
        return "numpy writes scalar(dtype, bytes) only"
    return _array_problem((), args[0], budget)


def _check_dtype(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # copy=True: BUILD then sets the state of a new dtype, never of one that numpy shares.
    if len(args) != 3 or not isinstance(args[0], str) or args[2] is not True:
        return "numpy writes dtype(str, align, True) only"
    return None


def _check_frombuffer(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # numpy writes _frombuffer(buffer, dtype, shape, order): a view of a buffer the object holds.
    if len(args) != 4 or not isinstance(args[0], (bytes, bytearray, pickle.PickleBuffer)) or args[3] not in "CF":
        return "numpy writes _frombuffer(buffer, dtype, shape, order) only"
    return _array_problem(args[2], args[1], budget)


def _check_record_args(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    return None if args == () else "pickle writes wgit's record without arguments (its fields come by BUILD)"


_RECORD = ("fairscale.experimental.wgit.repo", "_SHA1_Tensor")
_ALLOWED_GLOBALS: Dict[Tuple[str, str], Optional[_ArgsCheck]] = {
    ("numpy", "ndarray"): None,
    ("numpy", "dtype"): _check_dtype,
    ("numpy.core.multiarray", "_reconstruct"): _check_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _check_reconstruct,
    ("numpy.core.multiarray", "scalar"): _check_scalar,
    ("numpy._core.multiarray", "scalar"): _check_scalar,
    ("numpy.core.numeric", "_frombuffer"): _check_frombuffer,  # a view of a buffer the object holds (protocol 5)
    ("numpy._core.numeric", "_frombuffer"): _check_frombuffer,
    **PLAIN_CALLS,
    _RECORD: None,
}
# What NEWOBJ (cls.__new__(cls, *args)) may make: wgit's records, and complex numbers (pickle protocol 2).
_NEWOBJ: Dict[Tuple[str, str], _ArgsCheck] = {_RECORD: _check_record_args, ("builtins", "complex"): check_complex}


def _is_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


class _StoreUnpickler(RestrictedUnpickler):
    """The restricted unpickler (:class:`fairscale.internal.pickle_scan.unpickler.RestrictedUnpickler`) for what wgit
    writes: nothing in a store object runs, poisons a class or takes more memory than the object's bytes hold.

    On top of the restricted unpickler's rules:

    * globals resolve only from :data:`_ALLOWED_GLOBALS` (numpy arrays, plain containers, wgit records; and torch
      dtypes);
    * BUILD (setting an object's state) applies to numpy arrays and dtypes, wgit's records and OrderedDicts only:
      pickle's own sets attributes on whatever it is given, so on an allowed class (``_SHA1_Tensor``) it would change
      that class for the whole process;
    * arrays are sized before they are made, and counted with the bytearrays against ``budget`` bytes (the most the
      object's pickle can hold).
    """

    allowed_globals: ClassVar[Dict[Tuple[str, str], Optional[_ArgsCheck]]] = _ALLOWED_GLOBALS
    newobj_calls: ClassVar[Dict[Tuple[str, str], _ArgsCheck]] = _NEWOBJ
    objects: ClassVar[str] = "wgit's objects"
    nameable: ClassVar[str] = "a numpy array, a plain container or a wgit record"
    buildable: ClassVar[str] = "numpy arrays, dtypes and wgit records"
    reader: ClassVar[str] = "wgit"

    def __init__(self, reader: _HashingReader, budget: int) -> None:
        super().__init__(reader, budget)
        # Dtypes made here and not yet used or BUILT, by identity: numpy BUILDs each dtype once, right after making
        # it. A dtype an array already used and BUILT again (a larger item size) made numpy write past the array's
        # buffer: a heap overflow from a 142-byte object (a security fuzz, session 46).
        self._fresh_dtypes: Dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedContentError("it refers to external (persistent) objects, which wgit never writes")

    def _made(self, name: Optional[Tuple[str, str]], args: Tuple[Any, ...], made: Any) -> None:
        self._mark_used(args)
        if name == ("numpy", "dtype"):
            self._fresh_dtypes[id(made)] = made

    def _size_of(self, made: Any) -> int:
        return getattr(made, "nbytes", 0) if _is_array(made) else super()._size_of(made)

    def _mark_used(self, values: Any) -> None:
        """Dtypes among ``values`` (a call's arguments, an array's state) are used: no BUILD may change them now."""
        if self._fresh_dtypes and isinstance(values, tuple):
            for v in values:
                self._fresh_dtypes.pop(id(v), None)

    def _build_problem(self, inst: Any, state: Any) -> Optional[str]:
        import numpy as np

        problem = self._state_problem(inst, state)
        if problem is None and isinstance(inst, np.dtype):
            if self._fresh_dtypes.pop(id(inst), None) is not inst:
                problem = "numpy sets a dtype's state once, right after making it, before any array uses it"
        elif problem is None and isinstance(state, tuple):
            self._mark_used(state)
        return problem

    def _state_problem(self, inst: Any, state: Any) -> Optional[str]:
        import numpy as np

        if type(inst) is np.ndarray:
            if not isinstance(state, tuple) or len(state) not in (4, 5):
                return "not an array state numpy writes"
            return _array_problem(state[-4], state[-3], self._budget)
        if isinstance(inst, np.dtype):  # an instance (a dtype class is not one): made with copy=True
            # A plain numeric dtype's state has no subarray, names or fields; numpy's __setstate__ takes any of them
            # (an object field hidden by its flags, a subarray multiplying the size: security review, session 42).
            if not isinstance(state, tuple) or len(state) not in (8, 9) or any(x is not None for x in state[2:5]):
                return "not the state numpy writes for a plain numeric dtype"
            return _array_problem((), inst, self._budget)
        if self._name_of(type(inst)) == _RECORD:
            fields = getattr(type(inst), "__dataclass_fields__", {})
            if not isinstance(state, dict) or not set(state) <= set(fields):
                return f"wgit's records have the fields {sorted(fields)} only"
            return None
        return super()._build_problem(inst, state)  # OrderedDicts, and the refusal of anything else


# Deflate (gzip's format) expands its input at most 1032 times (258 bytes from one 2-bit code, and some), so a
# compressed object's pickle is at most this many times its file's size.
_MAX_DEFLATE_RATIO = 1032


def store_object_limit(file_size: int, compressed: bool, recorded: int) -> int:
    """The most bytes a store object's pickle can hold: its file's size (times deflate's largest ratio when
    compressed), and no more than ``recorded``, its size in the store's metadata, when that is recorded (> 0)."""
    limit = file_size * _MAX_DEFLATE_RATIO + 1024 if compressed else file_size
    return min(limit, recorded) if recorded > 0 else limit


def load_store_object(f: IO[bytes], what: str, sha1: Optional[str] = None, *, limit: int) -> Any:
    """Unpickle one SHA1 store object from ``f`` with the restricted unpickler.

    Args:
        f (IO[bytes]): the object's (uncompressed) bytes.
        what (str): what it is, for the messages.
        sha1 (Optional[str]): its key, the SHA1 of those bytes: checked against what was read (and the rest of ``f``).
        limit (int): the most bytes its pickle can hold (:func:`store_object_limit`): nothing larger is read or
            allocated.

    Raises:
        UntrustedContentError: the object names anything but numpy arrays, plain containers and wgit records, calls
            or sets the state of anything with what wgit never writes, declares more data than ``limit``, nests too
            deep (:func:`nesting_problem`), or is not a valid pickle.
        CorruptStoreError: the bytes do not hash to ``sha1``.
    """
    reader = _HashingReader(f, limit)
    try:
        # Unpickled before the hash is known: the restricted unpickler runs nothing, so tampered bytes are harmless
        # until the check below, and a hostile pickle is named as such.
        obj = _StoreUnpickler(reader, limit).load()
        actual = reader.hexdigest() if sha1 is not None else None
    except (UntrustedContentError, PickleScanError) as e:
        raise UntrustedContentError(
            f"wgit: refusing {what}: {e}. wgit never runs code from its store; this object was not written by wgit"
        ) from None
    except PICKLE_ERRORS as e:
        raise UntrustedContentError(f"wgit: {what} is corrupt or not a wgit store object ({e})") from None
    except (gzip.BadGzipFile, zlib.error) as e:  # a compressed object with damaged or foreign bytes
        raise UntrustedContentError(f"wgit: {what} is corrupt or not a wgit store object ({e})") from None
    if actual != sha1:
        raise CorruptStoreError(
            f"wgit: {what} is corrupted: its content hashes to {actual}, not to its key, so it is not the object that "
            "was stored (the file was changed after wgit wrote it). The SHA1 store is damaged: restore the object "
            "file from a backup, or add the checkpoint again in a new repository"
        )
    problem = nesting_problem(obj)
    if problem is not None:
        raise UntrustedContentError(f"wgit: refusing {what}: it {problem}; this object was not written by wgit")
    return obj
