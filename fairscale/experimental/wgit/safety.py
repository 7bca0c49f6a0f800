# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What wgit trusts: the paths it writes and the bytes it loads.

A ``.wgit`` directory may come from someone else (a shared drive, an archive, a copied experiment), and so may the
checkpoints one adds. wgit therefore:

* reads and writes only real files inside the repository's ``.wgit`` directory: a symbolic link anywhere inside
  ``.wgit`` (the directory itself, ``.git``, the SHA1 store, its sub-directories, a metadata file), an entry that is
  not a regular file or a directory (a named pipe, whose reading blocks forever, a device, a socket), a ``..`` or
  an absolute part in a path built from stored data, or an object key that is not a SHA1 is refused with
  :class:`UnsafeRepositoryError` before anything is written. So is a ``.git`` that sends git elsewhere (see
  :mod:`fairscale.experimental.wgit.pygit`). Files are replaced (written beside, then renamed), so a hard link
  planted inside ``.wgit`` cannot carry a write to the file it shares with;
* loads checkpoints with ``torch.load(weights_only=True)`` and its own store objects with an unpickler that accepts
  numpy arrays, plain containers and wgit's own record type only, so a file whose pickle would run code is refused
  with :class:`UntrustedContentError` and the code never runs; a store object whose bytes do not hash to its key,
  or a store ``metadata.json`` of the wrong shape, is refused with :class:`CorruptStoreError`;
* allocates no more for a store object than its bytes can hold (its file's size, or the size the store records):
  the unpickler calls its allowed globals only with the arguments pickle writes (``bytearray(n)`` allocated ``n``
  bytes), sizes arrays before numpy makes them, reads no declared length past that size, and sets the state of
  numpy arrays and dtypes, wgit records and OrderedDicts only (pickle's BUILD on an allowed class changed it for the
  whole process);
* walks each container once, however many times it is shared (a list shared at every level made ``2**depth``
  steps), and refuses containers nested more than :data:`MAX_NESTING` deep or inside themselves (they reached the
  recursion limit) with :class:`UntrustedContentError`;
* looks at no checkpoint path a metadata file records outside the directory that holds ``.wgit`` (``wgit status``
  told whether ``/root/...`` exists): such a file is refused with :class:`UnsafeRepositoryError`.

It does not defend against another process changing ``.wgit`` while wgit runs (a check-then-write race), nor does it
hide the modification time of the files one adds.
"""

import collections
import errno
import gzip
import hashlib
import math
import os
import pickle
import reprlib
import stat
import struct
import uuid
import warnings
import zlib
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, ClassVar, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from fairscale.internal.errors import FairscaleValueError

__all__ = ["WgitSafetyError", "UnsafeRepositoryError", "UntrustedContentError", "CorruptStoreError"]


class WgitSafetyError(ValueError):
    """Base of wgit's refusals to write or load something (a ``ValueError``)."""


class UnsafeRepositoryError(WgitSafetyError):
    """A path inside ``.wgit`` is a symbolic link or not a regular file, ``.git`` sends git to another repository,
    or a stored path or key (or a checkpoint path a metadata file records) would lead outside the repository."""


class UntrustedContentError(WgitSafetyError, FairscaleValueError):
    """A checkpoint or store object holds something other than tensors and plain containers (it could run code),
    would make wgit allocate more than its bytes hold, or nests its containers too deep or inside themselves.

    Also an ``AssertionError``: upstream rejected such files (plain pickles) with an assert.
    """


class CorruptStoreError(WgitSafetyError, FairscaleValueError):
    """The SHA1 store's bytes are not what wgit wrote: an object that does not hash to its key, or a ``metadata.json``
    that is not valid JSON or not of the shape wgit writes. Also an ``AssertionError``, like the store's other
    refusals of bad metadata."""


_REMOVE_HINT = "remove it (or the whole .wgit directory if you did not create it) and retry"


def unsafe(path: Path, why: str) -> UnsafeRepositoryError:
    """The :class:`UnsafeRepositoryError` refusing ``path`` because ``why`` (what it is, and what it would make wgit
    do), with the promise wgit keeps and what to do."""
    return UnsafeRepositoryError(
        f"wgit: refusing to use {path}: {why}. wgit only reads and writes real files inside the repository's .wgit "
        f"directory; {_REMOVE_HINT}"
    )


def _link_error(path: Path, what: str) -> UnsafeRepositoryError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return unsafe(path, f"{what} is a symbolic link{target}, and a link there could make wgit write outside")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "not a regular file"


def _special_error(path: Path, what: str, mode: int) -> UnsafeRepositoryError:
    # wgit never creates these; reading a named pipe blocks until someone writes to it (forever, for a planted one).
    return unsafe(path, f"{what} is {_kind(mode)}, not a regular file, and reading it could block forever")


def check_not_link(path: Path, what: str) -> None:
    """Raise :class:`UnsafeRepositoryError` if ``path`` itself is a symbolic link (dangling or not)."""
    if path.is_symlink():
        raise _link_error(path, what)


def check_tree(root: Path, what: str) -> None:
    """Raise :class:`UnsafeRepositoryError` if anything inside ``root`` (or ``root`` itself) is a symbolic link, a
    named pipe or a device.

    wgit never creates such entries, so one found there was planted (a pipe blocks whoever reads it). Sockets pass:
    git's file-system monitor keeps one in ``.git`` on some systems, and opening a socket fails at once, never blocks
    (:func:`open_regular` refuses it as any other non-regular file). The walk reads directory entries only (no
    ``stat`` per file where the file system reports entry types), does not follow links, and skips a directory it
    cannot list (as ``os.walk`` does).
    """
    check_not_link(root, what)
    if not root.is_dir():
        return
    pending = [root]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            inside = f"{path.relative_to(root)} inside {what}"
            if entry.is_symlink():
                raise _link_error(path, inside)
            if entry.is_dir(follow_symlinks=False):
                pending.append(path)
            elif not entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode
                if not stat.S_ISSOCK(mode):
                    raise _special_error(path, inside, mode)


def open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` opened for binary reading, refused with :class:`UnsafeRepositoryError` unless it is a regular file.

    Checked before opening (``lstat``: nothing is opened for a link, a named pipe or a device) and again on the open
    file: it is opened without following a final link and without waiting for a pipe's writer, then ``fstat``-ed, so
    an entry swapped in between is refused too, and never blocks.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsafeRepositoryError: ``path`` is a symbolic link or not a regular file.
    """
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _link_error(path, what)
    if not stat.S_ISREG(mode):
        raise _special_error(path, what, mode)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link swapped in after the lstat
            raise _link_error(path, what) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _special_error(path, what, mode)
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def contained(root: Path, parts: Iterable[str], what: str, reserved: FrozenSet[str] = frozenset()) -> Path:
    """``root`` joined with ``parts``, refusing any part that leaves ``root`` and any link on the way.

    Args:
        root (Path): a directory the caller trusts (already checked not to be a link).
        parts (Iterable[str]): relative path components, e.g. from stored data; none may be empty, ``.``, ``..``,
            absolute or contain a separator.
        what (str): what the path is, for the messages.
        reserved (FrozenSet[str]): first components that are refused (e.g. ``.git`` for a metadata file).

    Raises:
        UnsafeRepositoryError: a bad part, a reserved first part, or an existing component that is a link.
    """
    path = root
    parts = list(parts)
    if not parts:
        raise UnsafeRepositoryError(f"wgit: {what}: an empty path inside {root}")
    for i, part in enumerate(parts):
        if part in ("", ".", "..") or os.sep in part or (os.altsep and os.altsep in part) or "\0" in part:
            raise UnsafeRepositoryError(
                f"wgit: refusing {what} {'/'.join(parts)!r}: the part {part!r} would lead outside {root}"
            )
        if i == 0 and part in reserved:
            raise UnsafeRepositoryError(
                f"wgit: refusing {what} {'/'.join(parts)!r}: it would land in {root / part}, which wgit keeps for "
                "itself (run wgit from a directory with another name)"
            )
        path = path / part
        if path.is_symlink():
            raise _link_error(path, what)
    return path


def replace_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write a new file at ``path`` through ``write(f)``: into a fresh file beside it, then renamed over it.

    The rename replaces the directory entry, so whatever ``path`` was before (a hard link to a file elsewhere, a
    half-written file) is not written into; a failed write leaves the old file as it was.
    """
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as f:  # "x": never an existing file
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a file it refuses raises :class:`UntrustedContentError`,
    and so does one whose containers nest too deep or hold themselves (:func:`nesting_problem`).

    The message keeps upstream's leading ``"incorrect input"`` (its store rejected plain pickles with an assert).
    """
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of files it then refuses; the error says what matters.
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # a missing or unreadable file: torch's error names it
    except Exception as e:  # noqa: B902  # whatever torch.load raises on a bad file, the file is refused
        reason = _torch_refusal(e)
        raise UntrustedContentError(
            f"incorrect input {path}: {reason}. wgit loads checkpoints with torch.load(weights_only=True) and never "
            "runs code from them: add files written by torch.save of tensors, dicts and lists (e.g. "
            "torch.save(model.state_dict(), path))"
        ) from None
    # torch's loader builds any nesting without recursing; wgit's walks (and copy.deepcopy, pickle) recurse.
    problem = nesting_problem(obj)
    if problem is not None:
        raise UntrustedContentError(
            f"incorrect input {path}: it {problem}. wgit stores checkpoints of tensors in dicts and lists nested a few "
            "levels deep, none inside itself"
        )
    return obj


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


# How deep containers may nest in a checkpoint or a store object. wgit's own walks, copy.deepcopy and pickle recurse
# once or twice per level: much deeper, they reach Python's recursion limit and fail with a RecursionError traceback
# instead of a clear refusal. State dicts nest a few levels.
MAX_NESTING = 100
_END = object()


def _children(obj: Any) -> Optional[List[Any]]:
    """What copy.deepcopy and pickle would recurse into (``None``: ``obj`` is not a container)."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    return None


def nesting_problem(obj: Any) -> Optional[str]:
    """What is wrong with how ``obj``'s containers nest (``None``: nothing), worded to follow "it".

    Refused: nesting deeper than :data:`MAX_NESTING`, and a container inside itself (wgit's walks never end on one).
    A container shared by several parents is fine and expanded once, so the walk costs the number of containers and
    references, not the number of paths (``2**depth`` for a list shared at every level: a file of a few hundred
    bytes). Iterative, so it never reaches the recursion limit itself.
    """
    top = _children(obj)
    if top is None:
        return None
    deep = f"nests containers more than {MAX_NESTING} deep (wgit handles at most {MAX_NESTING} levels)"
    heights: Dict[int, int] = {}  # id of a container walked to the end -> its levels (itself and below)
    path: List[List[Any]] = [[obj, iter(top), 0]]  # open containers: [container, its children, levels below]
    on_path = {id(obj)}
    while path:
        frame = path[-1]
        child = next(frame[1], _END)
        if child is _END:
            path.pop()
            on_path.discard(id(frame[0]))
            heights[id(frame[0])] = frame[2] + 1
            if path:
                path[-1][2] = max(path[-1][2], frame[2] + 1)
            continue
        if id(child) in on_path:
            return "holds a container inside itself (a cycle)"
        if id(child) in heights:  # shared: walked once already
            if len(path) + heights[id(child)] > MAX_NESTING:
                return deep
            frame[2] = max(frame[2], heights[id(child)])
            continue
        items = _children(child)
        if items is None:
            continue
        if len(path) >= MAX_NESTING:
            return deep
        path.append([child, iter(items), 0])
        on_path.add(id(child))
    return None


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
        return f"the shape {_SHORT_REPR.repr(shape)} is not one numpy writes"
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError):
        return f"{_SHORT_REPR.repr(spec)} is not a numpy dtype"
    if dtype.hasobject:
        return "an array of Python objects never comes from a tensor"
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > budget:
        return f"the array would take {nbytes} bytes, more than the {budget} bytes the object can hold"
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
    ("numpy.core.numeric", "_frombuffer"): _no_check,  # a view of a buffer the object holds (protocol 5)
    ("numpy._core.numeric", "_frombuffer"): _no_check,
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
    # Set by load(): the unpickler's stack, and reads through pickle's frames.
    stack: List[Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readinto: Callable[[bytearray], int]

    def __init__(self, reader: "_HashingReader", budget: int) -> None:
        super().__init__(reader)
        self._budget = budget
        # Every global resolved, by identity: what REDUCE, NEWOBJ and BUILD meet on the stack is checked by its name.
        self._names: Dict[int, Tuple[Any, Tuple[str, str]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
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
            raise UntrustedContentError(f"it calls {shown} with {_SHORT_REPR.repr(args)}, not a tuple of arguments")
        problem = check(args, self._budget)
        if problem is not None:
            raise UntrustedContentError(f"it calls {shown}{_SHORT_REPR.repr(args)}: {problem}")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        name = self._name_of(func)
        self._check_call(func, args, _ALLOWED_GLOBALS.get(name) if name is not None else None)
        self.stack[-1] = func(*args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        name = self._name_of(cls)
        self._check_call(cls, args, _NEWOBJ.get(name) if name is not None else None)
        self.append(cls.__new__(cls, *args))

    def _load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._budget:  # sized before it is made: pickle allocates it, then reads into it
            raise UntrustedContentError(
                f"it declares a bytearray of {size} bytes, more than the {self._budget} bytes the object can hold"
            )
        data = bytearray(size)
        self.readinto(data)
        self.append(data)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        problem = self._build_problem(inst, state)
        if problem is not None:
            raise UntrustedContentError(f"it sets the state of {_described(inst)} (pickle's BUILD): {problem}")
        if isinstance(state, dict):  # a record or an OrderedDict: attributes of this instance only
            inst.__dict__.update(state)
        else:  # a numpy array or dtype: the class's own __setstate__, never one the instance could carry
            type(inst).__setstate__(inst, state)

    def _build_problem(self, inst: Any, state: Any) -> Optional[str]:
        import numpy as np

        if type(inst) is np.ndarray:
            if not isinstance(state, tuple) or len(state) not in (4, 5):
                return "not an array state numpy writes"
            return _array_problem(state[-4], state[-3], self._budget)
        if isinstance(inst, np.dtype):  # an instance (a dtype class is not one): made with copy=True
            return None if isinstance(state, tuple) else "not a dtype state numpy writes"
        if self._name_of(type(inst)) == _RECORD:
            fields = getattr(type(inst), "__dataclass_fields__", {})
            if not isinstance(state, dict) or not set(state) <= set(fields):
                return f"wgit's records have the fields {sorted(fields)} only"
            return None
        if type(inst) is collections.OrderedDict:  # torch's state dicts carry a _metadata attribute
            if not isinstance(state, dict) or not all(isinstance(k, str) and not k.startswith("__") for k in state):
                return "not attributes pickle writes for an OrderedDict"
            return None
        return (
            "wgit's objects set the state of numpy arrays, dtypes and wgit records only (on a class it would change it)"
        )


_StoreUnpickler.dispatch[pickle.REDUCE[0]] = _StoreUnpickler._load_reduce
_StoreUnpickler.dispatch[pickle.NEWOBJ[0]] = _StoreUnpickler._load_newobj
_StoreUnpickler.dispatch[pickle.BUILD[0]] = _StoreUnpickler._load_build
_StoreUnpickler.dispatch[pickle.BYTEARRAY8[0]] = _StoreUnpickler._load_bytearray8
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
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        OverflowError,
        struct.error,
    ) as e:
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


def check_sha1(sha1: Any) -> Optional[str]:
    """``None`` if ``sha1`` is 40 lowercase hex digits, else what is wrong with it (for the caller's message)."""
    if not isinstance(sha1, str):
        return f"not a SHA1 (a {type(sha1).__name__})"
    if len(sha1) != 40 or any(c not in "0123456789abcdef" for c in sha1):
        return f"{sha1!r} is not a SHA1 (40 lowercase hex digits)"
    return None
