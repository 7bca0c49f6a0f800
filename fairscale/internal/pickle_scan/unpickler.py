# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A restricted unpickler: what a pickle may name, call and allocate, counted against the bytes it holds.

Pickle's pure-Python unpickler with its handlers replaced: allowed globals are called only with the arguments pickle
writes for them, BUILD sets the state of OrderedDicts only (subclasses allow more), dict keys and set members are
hashed under a count, and nothing is read or allocated past the pickle's size. wgit's store unpickler and the scanner
of ``torch.save`` files (:mod:`.torch_scan`) are built on it.
"""

import collections
import pickle
import struct
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from .errors import PickleScanError
from .hashing import HASHING_FLOOR, hash_steps
from .reader import HashingReader
from .text import described, shown

__all__ = ["ArgsCheck", "HASHING_CALLS", "PLAIN_CALLS", "RestrictedUnpickler", "check_complex", "check_items"]

# The check of the arguments an allowed global may be called with (REDUCE): the reason they are refused, or None.
# The arguments allowed are the ones pickle writes: a callable such as bytearray(n) would otherwise allocate n bytes
# for a few bytes of pickle.
ArgsCheck = Callable[[Tuple[Any, ...], int], Optional[str]]


def _no_check(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    return None  # what it makes is no bigger than its arguments, which the object's bytes hold


def _check_bytearray(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    if len(args) != 1 or not isinstance(args[0], bytes):
        return "pickle writes bytearray(bytes) only, and bytearray(n) allocates n bytes"
    return None


def check_complex(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    if len(args) != 2 or not all(type(a) is float for a in args):
        return "pickle writes complex(float, float) only"
    return None


def check_items(args: Tuple[Any, ...], budget: int) -> Optional[str]:
    # set, frozenset, OrderedDict and torch.Size are made from the items pickle wrote, or from nothing.
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset, dict))):
        return "pickle writes it with a list, a tuple or no argument only"
    return None


# The plain values torch's weights-only loading lets a checkpoint hold (complex, bytearray, set, torch.Size,
# torch.device; frozensets and OrderedDicts too), each with the check of its arguments.
PLAIN_CALLS: Dict[Tuple[str, str], Optional[ArgsCheck]] = dict.fromkeys(
    [("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("torch", "Size")], check_items
)
PLAIN_CALLS.update({("builtins", "complex"): check_complex, ("builtins", "bytearray"): _check_bytearray})
PLAIN_CALLS[("torch", "device")] = _no_check
# The calls that hash their argument's items: set and frozenset members, an OrderedDict's keys.
HASHING_CALLS = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")})


def _refused_opcode(opcode: str) -> Callable[[Any], None]:
    def load(unpickler: Any) -> None:
        raise PickleScanError(f"it uses pickle's {opcode} opcode, which {unpickler.objects} never hold")

    return load


class RestrictedUnpickler(pickle._Unpickler):
    """pickle's unpickler restricted to plain values: nothing in a pickle runs, poisons a class or takes more memory
    (or hashing) than the pickle's bytes hold. Refusals raise :class:`~.errors.PickleScanError`.

    The pure-Python unpickler, whose opcode handlers can be replaced (the C one's cannot):

    * globals resolve only from :attr:`allowed_globals` (and torch dtypes);
    * calls (REDUCE, NEWOBJ) go only to the callables allowed there, with the arguments pickle writes for them;
    * BUILD (setting an object's state) only applies to OrderedDicts here (subclasses allow more): pickle's own sets
      attributes on whatever it is given, so on an allowed class it would change that class for the whole process;
    * INST, OBJ (protocols 0 and 1) and NEWOBJ_EX are refused;
    * nothing larger than ``budget`` bytes (the most the pickle can hold) is allocated: the reader refuses longer
      reads, and bytearrays are sized before they are made;
    * dict keys and set members are hashed under a count (:func:`~.hashing.hash_steps`).
    """

    dispatch: ClassVar[Dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)  # completed below
    # What may be named and called, made by NEWOBJ, and which calls hash their argument's items.
    allowed_globals: ClassVar[Dict[Tuple[str, str], Optional[ArgsCheck]]] = PLAIN_CALLS
    newobj_calls: ClassVar[Dict[Tuple[str, str], ArgsCheck]] = {("builtins", "complex"): check_complex}
    hashing_calls: ClassVar[FrozenSet[Tuple[str, str]]] = HASHING_CALLS
    # The wording of the refusals: who writes the pickles read, what they may name, what BUILD may set, who reads.
    objects: ClassVar[str] = "torch.save's files"
    nameable: ClassVar[str] = "a tensor or a plain container"
    buildable: ClassVar[str] = "OrderedDicts"
    reader: ClassVar[str] = "fairscale"
    # Set by load(): the unpickler's stack, and reads through pickle's frames.
    stack: List[Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readinto: Callable[[bytearray], int]
    pop_mark: Callable[[], List[Any]]

    def __init__(self, reader: HashingReader, budget: int) -> None:
        super().__init__(reader)
        self._budget = budget
        # Every global resolved, by identity: what REDUCE, NEWOBJ and BUILD meet on the stack is checked by its name.
        self._names: Dict[int, Tuple[Any, Tuple[str, str]]] = {}
        # Bytes allocated by the calls and BUILDs so far: each is sized against the budget, and so is their sum. Per
        # call only, the memo let one object repeat bytearray(<the same memoized bytes>) for 5 bytes a copy: 2.4 GB
        # from 1.9 KB (a security fuzz, session 46). What a writer writes allocates at most what its bytes hold.
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
            raise PickleScanError(f"it names {module}.{name}, which is not {self.nameable}")
        self._names[id(obj)] = (obj, (module, name))
        return obj

    def _name_of(self, obj: Any) -> Optional[Tuple[str, str]]:
        entry = self._names.get(id(obj))
        return entry[1] if entry is not None and entry[0] is obj else None

    def _check_call(self, func: Any, args: Any, check: Optional[ArgsCheck]) -> None:
        name = self._name_of(func)
        called = ".".join(name) if name is not None else described(func)
        if check is None:
            raise PickleScanError(f"it calls {called}, which {self.objects} never call")
        if type(args) is not tuple:
            raise PickleScanError(f"it calls {called} with {shown(args)}, not a tuple of arguments")
        problem = check(args, self._budget)
        if problem is not None:
            raise PickleScanError(f"it calls {called}{shown(args)}: {problem}")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        name = self._name_of(func)
        self._check_call(func, args, self.allowed_globals.get(name) if name is not None else None)
        if args and name in self.hashing_calls and isinstance(args[0], (list, tuple, set, frozenset, dict)):
            # A set's members, a dict's pairs, or another container's keys (OrderedDict(a dict) hashes them again).
            pairs = name == ("collections", "OrderedDict") and not isinstance(args[0], dict)
            if pairs and not all(isinstance(p, (list, tuple)) for p in args[0]):  # a dict item re-hashed its key
                raise PickleScanError("it makes an OrderedDict of items that are not (key, value) pairs")
            self._count_hashing(p[0] if pairs and isinstance(p, (list, tuple)) and p else p for p in args[0])
        self.stack[-1] = func(*args)
        self._spend(self.stack[-1])
        self._made(name, args, self.stack[-1])

    def _made(self, name: Optional[Tuple[str, str]], args: Tuple[Any, ...], made: Any) -> None:
        """Called after each allowed call (REDUCE) made ``made``: for a subclass that tracks what was made."""

    def _size_of(self, made: Any) -> int:
        """The memory ``made`` holds, of the values that hold data (a bytearray here; subclasses add arrays)."""
        return len(made) if isinstance(made, bytearray) else 0

    def _spend(self, made: Any) -> None:
        """Count the memory ``made`` (see :meth:`_size_of`) against the budget."""
        self._allocated += self._size_of(made)
        if self._allocated > 2 * self._budget:  # twice: slack for what a reader may hold twice, never more
            raise PickleScanError(
                f"its values take more than {2 * self._budget} bytes, more than the object's {self._budget} bytes "
                "can hold (the same data repeated through pickle's memo)"
            )

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
            raise PickleScanError(f"it assigns items into {described(target)}; pickle does so into dicts only")
        self._count_hashing(items[0::2], target)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _count_hashing(self, keys: Iterable[Any], target: Any = None) -> None:
        """Count the steps Python may take to hash ``keys`` (dict keys or set members) and compare them with equal
        keys before it does (see :func:`~.hashing.hash_steps`): refuse them past what the object's bytes can hold.

        A tuple's hash is not cached: it hashes its items again each time, so a tuple shared at every level
        (``t = (t, t)``, a few bytes per level through pickle's memo) as a key hashed ``2**depth`` tuples, forever
        for a few hundred bytes (a security fuzz, session 46); two equal frozenset towers in one set were compared
        member by member as long (a review, session 47), and a big int was hashed digit by digit at each use.
        Keys of equal hashes (ints ``k * (2**61 - 1)`` all hash to 0; int and tuple hashes are not randomized) are
        probed one past the other: each costs the number of earlier keys of its hash in ``target`` (the dict or set
        they go into; ``None``: a new one made of ``keys`` alone).
        """
        # What a writer writes hashes each key's items about once per occurrence in the data; a key shared through the
        # memo (2 bytes a use) costs its size each time, hence the floor (a few seconds of counting at most).
        limit = max(2 * self._budget + 1024, HASHING_FLOOR)
        costs: Dict[int, int] = {}
        depths: Dict[int, int] = {}  # nesting depth of each container costed (kept as long as costs)
        # Earlier keys by hash, per container (by identity; a new one for each call without a target).
        buckets = self._buckets.setdefault(id(target), {}) if target is not None else {}
        for key in keys:
            self._hashing += hash_steps(key, costs, limit + 1, depths, self.reader)
            if self._hashing <= limit and type(key) not in (str, bytes):  # those hashes are randomized per process
                try:
                    h = hash(key)  # its steps were just counted
                except TypeError:  # unhashable: the insertion raises
                    continue
                self._hashing += buckets.get(h, 0)
                buckets[h] = buckets.get(h, 0) + 1
            if self._hashing > limit:
                raise PickleScanError(
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
            raise PickleScanError(f"it adds members to {described(target)}; pickle does so to sets only")
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
            raise PickleScanError(f"it appends to {described(target)}; pickle does so to lists only")
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
            raise PickleScanError(
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
        if problem is not None:
            raise PickleScanError(f"it sets the state of {described(inst)} (pickle's BUILD): {problem}")
        if isinstance(state, dict):  # attributes of this instance only
            inst.__dict__.update(state)
        else:  # the class's own __setstate__ (of a class a subclass allows), never one the instance could carry
            type(inst).__setstate__(inst, state)
            self._spend(inst)

    def _build_problem(self, inst: Any, state: Any) -> Optional[str]:
        """Why BUILD may not set ``inst``'s state to ``state`` (``None``: it may)."""
        if type(inst) is collections.OrderedDict:  # torch's state dicts carry a _metadata attribute, nothing else
            # Any other name could shadow a method (keys, items) that the checks and the conversion call.
            if not isinstance(state, dict) or set(state) - {"_metadata"}:
                return "not attributes pickle writes for an OrderedDict (torch's _metadata only)"
            return None
        return f"{self.objects} set the state of {self.buildable} only (on a class it would change it)"


# Called by name, so a subclass's handler is the one that runs.
RestrictedUnpickler.dispatch[pickle.REDUCE[0]] = lambda u: u._load_reduce()
RestrictedUnpickler.dispatch[pickle.NEWOBJ[0]] = lambda u: u._load_newobj()
RestrictedUnpickler.dispatch[pickle.BUILD[0]] = lambda u: u._load_build()
RestrictedUnpickler.dispatch[pickle.BYTEARRAY8[0]] = lambda u: u._load_bytearray8()
RestrictedUnpickler.dispatch[pickle.SETITEM[0]] = lambda u: u._load_setitem(1)
RestrictedUnpickler.dispatch[pickle.SETITEMS[0]] = lambda u: u._load_setitem(None)
RestrictedUnpickler.dispatch[pickle.DICT[0]] = lambda u: u._load_dict()
RestrictedUnpickler.dispatch[pickle.ADDITEMS[0]] = lambda u: u._load_additems()
RestrictedUnpickler.dispatch[pickle.FROZENSET[0]] = lambda u: u._load_frozenset()
RestrictedUnpickler.dispatch[pickle.APPEND[0]] = lambda u: u._load_append(False)
RestrictedUnpickler.dispatch[pickle.APPENDS[0]] = lambda u: u._load_append(True)
for _opcode in ("INST", "OBJ", "NEWOBJ_EX"):
    RestrictedUnpickler.dispatch[getattr(pickle, _opcode)[0]] = _refused_opcode(_opcode)
