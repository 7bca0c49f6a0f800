# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The store's unpickler: what a store object may name, call and allocate (see :mod:`.safety`, which says what wgit
trusts and why).

Pickle's pure-Python unpickler with its handlers replaced: allowed globals are called only with the arguments pickle
and numpy write for them, BUILD sets the state of numpy arrays and dtypes, wgit records and OrderedDicts only, and
nothing is read or allocated past the object's size.
"""

import collections
import gzip
import hashlib
import pickle
import reprlib
import struct
import zlib
from typing import IO, Any, Callable, ClassVar, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from .safety import MAX_NESTING, CorruptStoreError, UntrustedContentError, nesting_problem

__all__ = ["load_store_object", "store_object_limit"]

# What a store object may name and call (see _StoreUnpickler). Each allowed (module, name) maps to None (it may only
# be named: an argument or a value) or to the check of the arguments it may be called with (REDUCE): the reason they
# are refused, or None. wgit writes numpy arrays (numpy 1 and 2 module paths, pickle protocols 2-5), the values that
# torch's weights-only loading lets a checkpoint hold (complex, bytearray, set, torch.Size, torch.device, torch
# dtypes) and its record of a tensor kept in the store; numpy scalars, frozensets and OrderedDicts were kept as
# upstream's store accepted them. The arguments allowed are the ones pickle and numpy write: a callable such as
# bytearray(n) would otherwise allocate n bytes for a few bytes of object.
_ArgsCheck = Callable[[Tuple[Any, ...], int], Optional[str]]
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


def _shown(value: Any) -> str:
    """A short repr of ``value`` for a message; one that cannot be made (an int past Python's 4300 digits for
    ``str``) is named by its type."""
    try:
        return _SHORT_REPR.repr(value)
    except ValueError:
        return f"<a {type(value).__name__} too large to show>"


def _no_check(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    return None  # what it makes is no bigger than its arguments, which the object's bytes hold


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


def _check_bytearray(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    if len(args) != 1 or not isinstance(args[0], bytes):
        return "pickle writes bytearray(bytes) only, and bytearray(n) allocates n bytes"
    return None


def _check_complex(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    if len(args) != 2 or not all(type(a) is float for a in args):
        return "pickle writes complex(float, float) only"
    return None


def _check_items(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # set, frozenset, OrderedDict and torch.Size are made from the items pickle wrote, or from nothing.
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset, dict))):
        return "pickle writes it with a list, a tuple or no argument only"
    return None


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
    ("collections", "OrderedDict"): _check_items,
    ("builtins", "set"): _check_items,
    ("builtins", "frozenset"): _check_items,
    ("builtins", "complex"): _check_complex,
    ("builtins", "bytearray"): _check_bytearray,
    ("torch", "Size"): _check_items,
    ("torch", "device"): _no_check,
    _RECORD: None,
}
# What NEWOBJ (cls.__new__(cls, *args)) may make: wgit's records, and complex numbers (pickle protocol 2).
_NEWOBJ: Dict[Tuple[str, str], _ArgsCheck] = {_RECORD: _check_record_args, ("builtins", "complex"): _check_complex}


_HASHING_FLOOR = 10**6  # steps of hashing and key comparison any object may take (about 4 s counted here)
# The calls that hash their argument's items: set and frozenset members, an OrderedDict's keys.
_HASHING_CALLS = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")})


_NESTED = (tuple, frozenset)  # what _hash_steps looks into


def _leaf_steps(value: Any) -> int:
    """The steps of hashing a value _hash_steps does not look into: an int reads every digit, the rest is cached."""
    return 1 + value.bit_length() // 64 if type(value) is int else 1


def _hash_steps(value: Any, costs: Dict[int, int], cap: int, depths: Dict[int, int]) -> int:
    """The steps Python may take on ``value`` as a dict key or set member: hashing it, and comparing it with an equal
    key already there (hashes equal). Tuples (``torch.Size`` too) hash their items again each time, frozensets cache
    their hash but compare member by member, and an int's hash reads every digit: such a value costs the sum over
    its items, each counted as often as it occurs (a tower ``t = (t, t)`` of 60 levels is ``2**61`` steps).
    Anything else costs 1 (strings and bytes cache their hash). Each container's count is worked out once in
    ``costs`` (by identity) and capped at ``cap``, its depth in ``depths``: nesting deeper than
    :data:`~.safety.MAX_NESTING` is refused before Python recurses into it. Iterative."""
    if not isinstance(value, _NESTED):
        return _leaf_steps(value)
    pending: List[Tuple[Any, bool]] = [(value, False)]
    while pending:
        node, ready = pending.pop()
        if id(node) in costs:
            continue
        if ready:  # its containers are counted: they were pushed above it
            steps = 1 + sum(costs[id(c)] if isinstance(c, _NESTED) else _leaf_steps(c) for c in node)
            costs[id(node)] = min(cap, steps)
            # Python hashes (and compares) a tuple by recursing in C with no depth check: a key 300,000 tuples deep
            # crashed the process (a security review, session 48). The depth is kept beside the cost.
            depth = 1 + max((depths[id(c)] for c in node if isinstance(c, _NESTED)), default=0)
            if depth > MAX_NESTING:
                raise UntrustedContentError(
                    f"its dict keys or set members nest more than {MAX_NESTING} deep (wgit handles at most "
                    f"{MAX_NESTING} levels)"
                )
            depths[id(node)] = depth
        else:
            pending.append((node, True))
            pending.extend((c, False) for c in node if isinstance(c, _NESTED) and id(c) not in costs)
    return costs[id(value)]


def _is_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _refused_opcode(opcode: str) -> Callable[[Any], None]:
    def load(unpickler: Any) -> None:
        raise UntrustedContentError(f"it uses pickle's {opcode} opcode, which wgit's objects never hold")

    return load


def _described(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


class _StoreUnpickler(pickle._Unpickler):
    """pickle's unpickler restricted to what wgit writes: nothing in a store object runs, poisons a class or takes
    more memory than the object's bytes hold.

    The pure-Python unpickler, whose opcode handlers can be replaced (the C one's cannot):

    * globals resolve only from :data:`_ALLOWED_GLOBALS` (and torch dtypes);
    * calls (REDUCE, NEWOBJ) go only to the callables allowed there, with the arguments pickle writes for them;
    * BUILD (setting an object's state) only applies to numpy arrays and dtypes, wgit's records and OrderedDicts:
      pickle's own sets attributes on whatever it is given, so on an allowed class (``_SHA1_Tensor``) it would change
      that class for the whole process;
    * INST, OBJ (protocols 0 and 1) and NEWOBJ_EX, which wgit never writes, are refused;
    * nothing larger than ``budget`` bytes (the most the object's pickle can hold) is allocated: the reader refuses
      longer reads, and arrays and bytearrays are sized before they are made.
    """

    dispatch: ClassVar[Dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)  # completed below
    # What may be named and called, made by NEWOBJ, and which calls hash their argument's items (a subclass that
    # scans other pickles allows other names).
    allowed_globals: ClassVar[Dict[Tuple[str, str], Optional[_ArgsCheck]]] = _ALLOWED_GLOBALS
    newobj_calls: ClassVar[Dict[Tuple[str, str], _ArgsCheck]] = _NEWOBJ
    hashing_calls: ClassVar[FrozenSet[Tuple[str, str]]] = _HASHING_CALLS
    # Set by load(): the unpickler's stack, and reads through pickle's frames.
    stack: List[Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readinto: Callable[[bytearray], int]
    pop_mark: Callable[[], List[Any]]

    def __init__(self, reader: "_HashingReader", budget: int) -> None:
        super().__init__(reader)
        self._budget = budget
        # Every global resolved, by identity: what REDUCE, NEWOBJ and BUILD meet on the stack is checked by its name.
        self._names: Dict[int, Tuple[Any, Tuple[str, str]]] = {}
        # Dtypes made here and not yet used or BUILT, by identity: numpy BUILDs each dtype once, right after making
        # it. A dtype an array already used and BUILT again (a larger item size) made numpy write past the array's
        # buffer: a heap overflow from a 142-byte object (a security fuzz, session 46).
        self._fresh_dtypes: Dict[int, Any] = {}
        # Bytes allocated by the calls and BUILDs so far: each is sized against the budget, and so is their sum. Per
        # call only, the memo let one object repeat bytearray(<the same memoized bytes>) for 5 bytes a copy: 2.4 GB
        # from 1.9 KB (a security fuzz, session 46). What wgit writes allocates at most what its bytes hold.
        self._allocated = 0
        # Steps Python takes to hash the dict keys and set members so far (see _count_hashing), by the same rule,
        # and the keys of each dict or set so far by hash (probes past keys of the same hash).
        self._hashing = 0
        self._buckets: Dict[int, Dict[int, int]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed_globals:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        else:
            raise UntrustedContentError(
                f"it names {module}.{name}, which is not a numpy array, a plain container or a wgit record"
            )
        self._names[id(obj)] = (obj, (module, name))
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedContentError("it refers to external (persistent) objects, which wgit never writes")

    def _name_of(self, obj: Any) -> Optional[Tuple[str, str]]:
        entry = self._names.get(id(obj))
        return entry[1] if entry is not None and entry[0] is obj else None

    def _check_call(self, func: Any, args: Any, check: Optional[_ArgsCheck]) -> None:
        name = self._name_of(func)
        shown = ".".join(name) if name is not None else _described(func)
        if check is None:
            raise UntrustedContentError(f"it calls {shown}, which wgit's objects never call")
        if type(args) is not tuple:
            raise UntrustedContentError(f"it calls {shown} with {_shown(args)}, not a tuple of arguments")
        problem = check(args, self._budget)
        if problem is not None:
            raise UntrustedContentError(f"it calls {shown}{_shown(args)}: {problem}")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        name = self._name_of(func)
        self._check_call(func, args, self.allowed_globals.get(name) if name is not None else None)
        if args and name in self.hashing_calls and isinstance(args[0], (list, tuple, set, frozenset, dict)):
            # A set's members, a dict's pairs, or another container's keys (OrderedDict(a dict) hashes them again).
            pairs = name == ("collections", "OrderedDict") and not isinstance(args[0], dict)
            if pairs and not all(isinstance(p, (list, tuple)) for p in args[0]):  # a dict item re-hashed its key
                raise UntrustedContentError("it makes an OrderedDict of items that are not (key, value) pairs")
            self._count_hashing(p[0] if pairs and isinstance(p, (list, tuple)) and p else p for p in args[0])
        self._mark_used(args)
        self.stack[-1] = func(*args)
        self._spend(self.stack[-1])
        if name == ("numpy", "dtype"):
            self._fresh_dtypes[id(self.stack[-1])] = self.stack[-1]

    def _spend(self, made: Any) -> None:
        """Count the memory ``made`` (a bytearray or an array: the values that hold data) against the budget."""
        size = len(made) if isinstance(made, bytearray) else getattr(made, "nbytes", 0) if _is_array(made) else 0
        self._allocated += size
        if self._allocated > 2 * self._budget:  # twice: slack for what a reader may hold twice, never more
            raise UntrustedContentError(
                f"its values take more than {2 * self._budget} bytes, more than the object's {self._budget} bytes "
                "can hold (the same data repeated through pickle's memo)"
            )

    def _mark_used(self, values: Any) -> None:
        """Dtypes among ``values`` (a call's arguments, an array's state) are used: no BUILD may change them now."""
        if self._fresh_dtypes and isinstance(values, tuple):
            for v in values:
                self._fresh_dtypes.pop(id(v), None)

    def _load_setitem(self, count: Optional[int]) -> None:
        """SETITEM and SETITEMS on dicts only: pickle's own assign into whatever is below (an array: raw bytes
        written into it)."""
        if count is None:  # SETITEMS: every pair above the mark
            items = self.pop_mark()
            target = self.stack[-1]
        else:
            items = self.stack[-2:]
            del self.stack[-2:]
            target = self.stack[-1]
        if type(target) not in (dict, collections.OrderedDict):
            raise UntrustedContentError(f"it assigns items into {_described(target)}; pickle does so into dicts only")
        self._count_hashing(items[0::2], target)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _count_hashing(self, keys: Iterable[Any], target: Any = None) -> None:
        """Count the steps Python may take to hash ``keys`` (dict keys or set members) and compare them with equal
        keys before it does (see :func:`_hash_steps`): refuse them past what the object's bytes can hold.

        A tuple's hash is not cached: it hashes its items again each time, so a tuple shared at every level
        (``t = (t, t)``, a few bytes per level through pickle's memo) as a key hashed ``2**depth`` tuples, forever
        for a few hundred bytes (a security fuzz, session 46); two equal frozenset towers in one set were compared
        member by member as long (a review, session 47), and a big int was hashed digit by digit at each use.
        Keys of equal hashes (ints ``k * (2**61 - 1)`` all hash to 0; int and tuple hashes are not randomized) are
        probed one past the other: each costs the number of earlier keys of its hash in ``target`` (the dict or set
        they go into; ``None``: a new one made of ``keys`` alone).
        """
        # What wgit writes hashes each key's items about once per occurrence in the data; a key shared through the
        # memo (2 bytes a use) costs its size each time, hence the floor (a few seconds of counting at most).
        limit = max(2 * self._budget + 1024, _HASHING_FLOOR)
        costs: Dict[int, int] = {}
        depths: Dict[int, int] = {}  # nesting depth of each container costed (kept as long as costs)
        # Earlier keys by hash, per container (by identity; a new one for each call without a target).
        buckets = self._buckets.setdefault(id(target), {}) if target is not None else {}
        for key in keys:
            self._hashing += _hash_steps(key, costs, limit + 1, depths)
            if self._hashing <= limit and type(key) not in (str, bytes):  # those hashes are randomized per process
                try:
                    h = hash(key)  # its steps were just counted
                except TypeError:  # unhashable: the insertion raises
                    continue
                self._hashing += buckets.get(h, 0)
                buckets[h] = buckets.get(h, 0) + 1
            if self._hashing > limit:
                raise UntrustedContentError(
                    f"its dict keys and set members take more than {limit} steps to hash and compare, more than the "
                    f"object's {self._budget} bytes can hold (a value repeated inside itself through pickle's memo)"
                )

    def _load_dict(self) -> None:
        items = self.pop_mark()
        self._count_hashing(items[0::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            raise UntrustedContentError(f"it adds members to {_described(target)}; pickle does so to sets only")
        self._count_hashing(items, target)
        target.update(items)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        self._count_hashing(items)
        self.append(frozenset(items))

    def _load_append(self, many: bool) -> None:
        """APPEND and APPENDS on lists only (pickle's own calls ``append``/``extend`` of whatever is below)."""
        items = self.pop_mark() if many else [self.stack.pop()]
        target = self.stack[-1]
        if type(target) is not list:
            raise UntrustedContentError(f"it appends to {_described(target)}; pickle does so to lists only")
        target.extend(items)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        name = self._name_of(cls)
        self._check_call(cls, args, self.newobj_calls.get(name) if name is not None else None)
        self.append(cls.__new__(cls, *args))

    def _load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._budget:  # sized before it is made: pickle allocates it, then reads into it
            raise UntrustedContentError(
                f"it declares a bytearray of {size} bytes, more than the {self._budget} bytes the object can hold"
            )
        data = bytearray(size)
        self._spend(data)
        self.readinto(data)
        self.append(data)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        problem = self._build_problem(inst, state)
        import numpy as np

        if problem is None and isinstance(inst, np.dtype):
            if self._fresh_dtypes.pop(id(inst), None) is not inst:
                problem = "numpy sets a dtype's state once, right after making it, before any array uses it"
        elif problem is None and isinstance(state, tuple):
            self._mark_used(state)
        if problem is not None:
            raise UntrustedContentError(f"it sets the state of {_described(inst)} (pickle's BUILD): {problem}")
        if isinstance(state, dict):  # a record or an OrderedDict: attributes of this instance only
            inst.__dict__.update(state)
        else:  # a numpy array or dtype: the class's own __setstate__, never one the instance could carry
            type(inst).__setstate__(inst, state)
            self._spend(inst)

    def _build_problem(self, inst: Any, state: Any) -> Optional[str]:
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
        if type(inst) is collections.OrderedDict:  # torch's state dicts carry a _metadata attribute, nothing else
            # Any other name could shadow a method (keys, items) that the checks and the conversion call.
            if not isinstance(state, dict) or set(state) - {"_metadata"}:
                return "not attributes pickle writes for an OrderedDict (torch's _metadata only)"
            return None
        return (
            "wgit's objects set the state of numpy arrays, dtypes and wgit records only (on a class it would change it)"
        )


# Called by name, so a subclass's handler is the one that runs.
_StoreUnpickler.dispatch[pickle.REDUCE[0]] = lambda u: u._load_reduce()
_StoreUnpickler.dispatch[pickle.NEWOBJ[0]] = lambda u: u._load_newobj()
_StoreUnpickler.dispatch[pickle.BUILD[0]] = lambda u: u._load_build()
_StoreUnpickler.dispatch[pickle.BYTEARRAY8[0]] = lambda u: u._load_bytearray8()
_StoreUnpickler.dispatch[pickle.SETITEM[0]] = lambda u: u._load_setitem(1)
_StoreUnpickler.dispatch[pickle.SETITEMS[0]] = lambda u: u._load_setitem(None)
_StoreUnpickler.dispatch[pickle.DICT[0]] = lambda u: u._load_dict()
_StoreUnpickler.dispatch[pickle.ADDITEMS[0]] = lambda u: u._load_additems()
_StoreUnpickler.dispatch[pickle.FROZENSET[0]] = lambda u: u._load_frozenset()
_StoreUnpickler.dispatch[pickle.APPEND[0]] = lambda u: u._load_append(False)
_StoreUnpickler.dispatch[pickle.APPENDS[0]] = lambda u: u._load_append(True)
for _opcode in ("INST", "OBJ", "NEWOBJ_EX"):
    _StoreUnpickler.dispatch[getattr(pickle, _opcode)[0]] = _refused_opcode(_opcode)


class _HashingReader:
    """What the unpickler reads from ``f``, fed to a SHA1 on the way (checking an object's key costs no second read),
    and refused past ``limit`` bytes."""

    def __init__(self, f: IO[bytes], limit: int) -> None:
        self._f = f
        self._sha1 = hashlib.sha1()
        self._limit = limit
        self._left = limit

    def _refuse(self, what: str) -> UntrustedContentError:
        return UntrustedContentError(
            f"it declares {what}, more than the {self._left} bytes left of the {self._limit} bytes it can hold"
        )

    def read(self, n: int) -> bytes:
        # Checked before reading: a file's read(n) allocates n bytes first, however few the file holds (an object of
        # a few bytes declaring 10**14 bytes of data raised a bare MemoryError).
        if n > self._left:
            raise self._refuse(f"{n} bytes of data")
        data = self._f.read(n)
        self._left -= len(data)
        self._sha1.update(data)
        return data

    def readline(self) -> bytes:
        data = self._f.readline(self._left + 1)
        if len(data) > self._left:
            raise self._refuse("a longer line")
        self._left -= len(data)
        self._sha1.update(data)
        return data

    def hexdigest(self) -> str:
        """The SHA1 of all of ``f``: what the unpickler read, and what it left after the pickle's end."""
        while True:
            data = self._f.read(1024 * 1024)
            if not data:
                return self._sha1.hexdigest()
            self._sha1.update(data)


# Deflate (gzip's format) expands its input at most 1032 times (258 bytes from one 2-bit code, and some), so a
# compressed object's pickle is at most this many times its file's size.
_MAX_DEFLATE_RATIO = 1032


def store_object_limit(file_size: int, compressed: bool, recorded: int) -> int:
    """The most bytes a store object's pickle can hold: its file's size (times deflate's largest ratio when
    compressed), and no more than ``recorded``, its size in the store's metadata, when that is recorded (> 0)."""
    limit = file_size * _MAX_DEFLATE_RATIO + 1024 if compressed else file_size
    return min(limit, recorded) if recorded > 0 else limit


# What the pure-Python unpickler raises on bytes that are not a valid pickle (a truncated or damaged one).
PICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    OverflowError,
    struct.error,
)


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
    except UntrustedContentError as e:
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
