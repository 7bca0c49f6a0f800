# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A content-addressed, reference-counted store of tensors and state dicts (wgit's object store).

Objects are serialised as ``pickle.dump(to_np(obj))`` (tensors as numpy arrays), named by the SHA1 of those bytes
and kept at ``<path>/<sha1[:2]>/<sha1[2:4]>/<sha1>``, gzip-compressed on request. ``metadata.json`` holds the
store totals and, per object, its reference count, sizes, compression flag and the names it was added under.
Compression uses ``pgzip`` (parallel gzip) when installed and the standard library's ``gzip`` otherwise (same
format); numpy is imported when an object is added or read. Only tensors numpy has an array for can be stored (not
bfloat16, float8, complex32, quantized, sparse, meta or nested ones): :func:`check_storable` refuses the others before
anything is written.

What it trusts (see :mod:`fairscale.experimental.wgit.safety`): files are added with ``torch.load(weights_only=True)``
and objects are read back with an unpickler that accepts numpy arrays, plain containers and wgit's records only;
every path is built from a validated SHA1 and refused when a component below the store directory is a symbolic link;
files are read only when they are regular files (never a named pipe, which would block) and replaced (written beside,
then renamed), never written into. An object is checked against its key as it is read, and ``metadata.json`` against
the shape wgit writes each time it is read: a store changed behind wgit's back raises ``CorruptStoreError``.
"""

import contextlib
import gzip
import hashlib
import json
import logging
import os
import pickle
import reprlib
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

# Upstream's module also exposes these names (ExitCode and the container converters it imported).
from fairscale.internal.containers import from_np as from_np, to_np as to_np  # noqa: F401

from .checkpoint_load import load_checkpoint
from .safety import (
    CorruptStoreError,
    check_not_link,
    check_sha1,
    contained,
    nesting_problem,
    open_regular,
    replace_file,
)
from .storable import check_storable
from .store_leftovers import METADATA_TMP_RE, remove_stale_leftovers
from .store_lock import StoreLock
from .store_pickle import load_store_object, store_object_limit
from .utils import ExitCode as ExitCode  # noqa: F401

__all__ = ["SHA1_Store", "check_storable"]

# Keys of metadata.json: store totals, then per-object entries.
STORE_CREATE_DATE_KEY = "created_on"
STORE_OS_KEY = "original_size"
STORE_DS_KEY = "deduped_size"
STORE_CS_KEY = "compressed_size"
# Earlier names of the store keys in this distribution, kept for code that imported them.
STORE_CREATED_ON = STORE_CREATE_DATE_KEY
STORE_OS = STORE_OS_KEY
STORE_DS = STORE_DS_KEY
STORE_CS = STORE_CS_KEY
ENTRY_RF_KEY = "ref_count"
ENTRY_OS_KEY = "original_size"
ENTRY_DS_KEY = "deduped_size"
ENTRY_CS_KEY = "compressed_size"
ENTRY_COMP_KEY = "compressed"
ENTRY_NAMES_KEY = "names"
_TOTAL_KEYS = (STORE_OS_KEY, STORE_DS_KEY, STORE_CS_KEY)
_ENTRY_COUNT_KEYS = (ENTRY_RF_KEY, ENTRY_OS_KEY, ENTRY_DS_KEY, ENTRY_CS_KEY)
# Bad values in messages: long enough for a whole SHA1 key, short for whatever else a damaged file holds.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _metadata_problem(data: Any) -> Optional[str]:
    """What is wrong with the content of a ``metadata.json`` (``None``: the shape wgit writes).

    The header keys and totals must be there; an entry's fields may be missing (they default to zero / empty), but
    those present must have wgit's types, since every method does arithmetic on them.
    """
    short = _SHORT.repr
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__} ({short(data)}), not an object"
    if STORE_CREATE_DATE_KEY not in data:
        return f"the header key {STORE_CREATE_DATE_KEY!r} is missing: it is not a SHA1 store header"
    for key in _TOTAL_KEYS:
        if not _is_count(data.get(key)):
            return f"the store total {key!r} is {short(data.get(key))}, not a non-negative integer"
    for key, entry in data.items():
        if key == STORE_CREATE_DATE_KEY or key in _TOTAL_KEYS:
            continue
        if not isinstance(entry, dict):
            return f"the entry {short(key)} is {short(entry)}, not an object"
        for field in _ENTRY_COUNT_KEYS:
            if field in entry and not _is_count(entry[field]):
                return f"the entry {short(key)} has {field} {short(entry[field])}, not a non-negative integer"
        if ENTRY_COMP_KEY in entry and not isinstance(entry[ENTRY_COMP_KEY], bool):
            return f"the entry {short(key)} has {ENTRY_COMP_KEY} {short(entry[ENTRY_COMP_KEY])}, not true or false"
        names = entry.get(ENTRY_NAMES_KEY, {})
        if not isinstance(names, dict) or not all(_is_count(count) for count in names.values()):
            return f"the entry {short(key)} has {ENTRY_NAMES_KEY} {short(names)}, not an object of counts"
    return None


def _check_size(name: str, value: Any, minimum: int) -> None:
    """Refuse a size argument of ``SHA1_Store`` that is not an ``int`` of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SHA1_Store: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"SHA1_Store: {name} must be at least {minimum}, got {value}")


def _to_np(obj: Any) -> Any:
    """``obj`` with its tensors as numpy arrays, in new dicts, lists and tuples (see :func:`_convert`)."""
    # A conjugate or negative view is a flag on the tensor, which numpy() refuses: resolved into plain values.
    return _convert(
        obj, lambda x: x.detach().cpu().resolve_conj().resolve_neg().numpy() if isinstance(x, Tensor) else x, {}
    )


def _from_np(obj: Any) -> Any:
    """``obj`` with its numpy arrays as tensors, in new dicts, lists and tuples (see :func:`_convert`)."""
    import numpy as np

    return _convert(obj, lambda x: torch.from_numpy(x) if isinstance(x, np.ndarray) else x, {})


def _convert(obj: Any, leaf: Callable[[Any], Any], done: Dict[int, Any]) -> Any:
    """``obj`` with ``leaf`` applied to everything but its dicts, lists and plain tuples, which are copied.

    Each container is converted once (``done``: by id): one shared by several parents stays shared, so a structure
    sharing a list at every level costs its size, not its number of paths (``2**depth``: a few hundred bytes of
    checkpoint or store object took hours). Only plain tuples are walked, not their subclasses such as torch.Size: a
    tensor pickled as a tensor would need torch's own unpickling, which the store's restricted reader refuses. The
    nesting is bounded before (:func:`~fairscale.experimental.wgit.safety.nesting_problem`), so the recursion is too.
    """
    if not isinstance(obj, (dict, list)) and type(obj) is not tuple:
        return leaf(obj)
    if id(obj) in done:  # the input is alive throughout, so no id is reused
        return done[id(obj)]
    if type(obj) is tuple:
        done[id(obj)] = tuple(_convert(v, leaf, done) for v in obj)
    elif isinstance(obj, dict):
        converted: Dict[Any, Any] = {}
        done[id(obj)] = converted  # before the items: a dict inside itself ends
        for k, v in obj.items():
            converted[k] = _convert(v, leaf, done)
    else:
        items: List[Any] = []
        done[id(obj)] = items
        items.extend(_convert(v, leaf, done) for v in obj)
    return done[id(obj)]


def _gzip_open(
    path: Path, mode: str, threads: Optional[int], block_size: int, fileobj: Optional[IO[bytes]] = None
) -> Any:
    """A gzip stream on ``path`` (or on ``fileobj``, with ``path``'s name in the gzip header, as if on ``path``)."""
    try:
        import pgzip
    except ImportError:
        return gzip.GzipFile(filename=str(path), mode=mode, compresslevel=5, fileobj=fileobj)
    return pgzip.PgzipFile(
        filename=str(path), mode=mode, compresslevel=5, fileobj=fileobj, thread=threads, blocksize=block_size
    )


class SHA1_Store:
    """The object store at ``path`` (see the module docstring).

    Args:
        path (Path): the store directory.
        init (bool): create it (its parent must exist) when missing, or when a creation killed before its
            ``metadata.json`` was in place left it empty.
        sha1_buf_size (int): read size when hashing, in bytes (at least 1).
        tmp_dir (str): an existing scratch directory (default: ``<path>/tmp``, made with a new store and again by an
            add that finds it missing; never wiped: opening a store writes nothing, and cannot remove the file of an
            add running in another process).
        pgzip_threads (Optional[int]), pgzip_block_size (int): pgzip settings (threads: ``None`` or ``0`` for one
            per CPU, as pgzip; block size: at least 1 byte).

    Raises:
        TypeError, ValueError: a size or thread count that is not an ``int``, or below its minimum (before anything
            is created).
    """

    def __init__(
        self,
        path: Union[Path, str],
        init: bool = False,
        sha1_buf_size: int = 100 * 1024 * 1024,
        tmp_dir: str = "",
        pgzip_threads: Optional[int] = None,
        pgzip_block_size: int = 10 * 1024 * 1024,
    ) -> None:
        # A read size of 0 read nothing: every object hashed as b"", and one taken for a repeat was never stored.
        _check_size("sha1_buf_size", sha1_buf_size, 1)
        _check_size("pgzip_block_size", pgzip_block_size, 1)
        if pgzip_threads is not None:
            _check_size("pgzip_threads", pgzip_threads, 0)
        self._path = Path(path)
        self._metadata_file_path = self._inside("metadata.json")
        self._lock = StoreLock(self._path)  # writers only (add, delete); see store_lock
        self._sha1_buf_size = sha1_buf_size
        self._pgzip_threads = pgzip_threads
        self._pgzip_block_size = pgzip_block_size
        self._json_dict: Dict[str, Any] = {
            STORE_CREATE_DATE_KEY: time.ctime(),
            STORE_OS_KEY: 0,
            STORE_DS_KEY: 0,
            STORE_CS_KEY: 0,
        }
        if init and (not self._path.exists() or self._killed_init()):
            self._path.mkdir(parents=False, exist_ok=True)
            self._store_json_dict()
            # A new store gets upstream's layout (adds create it again when it is missing); an existing store is never
            # written to on opening: read-only commands must work on a read-only repository, and the directory holds
            # the files of adds running in other processes.
            self._inside("tmp").mkdir(exist_ok=True)
        # AssertionError subclasses where upstream asserted (kept under ``python -O``).
        if not self._path.is_dir():
            raise FairscaleValueError(
                f"{self._path} is not a SHA1 store directory (missing: pass init=True to create one)"
            )
        if not self._metadata_file_path.exists():
            raise FairscaleValueError(
                f"{self._metadata_file_path} is missing: {self._path} is not a SHA1 store. If it is what an interrupted "
                "store creation (wgit init) left, move it away (or remove it, if it holds nothing of yours) and create "
                "the store again (wgit init); a store whose metadata.json was lost: restore the file from a backup"
            )
        self._load_json_dict()  # refuses a file that is not a store header
        if tmp_dir:
            if not Path(tmp_dir).is_dir():
                raise FairscaleValueError(f"tmp_dir {tmp_dir} must be an existing directory")
            self._tmp_dir = Path(tmp_dir)
        else:
            # Only named here (refused now if it is a link); created and cleaned by add (see _scratch_dir).
            self._tmp_dir = self._inside("tmp")
        self._default_tmp = not tmp_dir
        self._tmp_cleaned = False  # killed adds' leftovers are looked for once per store object

    def _killed_init(self) -> bool:
        """Whether the store directory is what a creation killed before its ``metadata.json`` was in place left: a
        directory with nothing in it but temporary files of that write (removed here). Such a store is created
        again in place; any other directory without ``metadata.json`` is left alone (it may hold someone's data)."""
        if not self._path.is_dir() or os.path.lexists(self._metadata_file_path):
            return False
        leftovers = [self._path / name for name in os.listdir(self._path)]
        if not all(METADATA_TMP_RE.match(p.name) and stat.S_ISREG(p.lstat().st_mode) for p in leftovers):
            return False
        for leftover in leftovers:
            leftover.unlink()
        return True

    def _writing(self) -> ContextManager[None]:
        """Hold the store's writers' lock for a block (re-entrant): a ``Repo.add`` is one change, rollback included."""
        return self._lock.held()

    def _inside(self, *parts: str) -> Path:
        """``<store>/<parts...>``, refused (UnsafeRepositoryError) if a component below the store is a link."""
        return contained(self._path, parts, "SHA1 store path")

    @property
    def _readonly_json_ctx(self) -> ContextManager[None]:
        """Upstream's private context for reading ``_json_dict``: reloads it from ``metadata.json`` on entry.

        Here ``_json_dict`` is always current (every change writes it through), so the context only re-reads it;
        upstream's own tests use it to inspect the reference counts.
        """
        return self._reloaded_json()

    @contextlib.contextmanager
    def _reloaded_json(self) -> Iterator[None]:
        self._load_json_dict()
        yield

    def _load_json_dict(self) -> None:
        """Read ``metadata.json`` into ``_json_dict``, checking its shape (on every read: another process, or a
        hand edit, may have changed it since the constructor's).

        Raises:
            CorruptStoreError: the file is not valid JSON or not of the shape wgit writes (an ``AssertionError``).
            UnsafeRepositoryError: it is a symbolic link or not a regular file (e.g. a named pipe).
        """
        path = self._metadata_file_path
        restore = (
            "Restore the file from a backup, or start a new repository (wgit init in a new directory) and add the "
            "checkpoints again"
        )
        with open_regular(path, "the SHA1 store's metadata.json") as f:
            try:
                data = json.load(f)
            except (ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8; RecursionError: deep nesting
                # Every command reads it: without the file's name the user sees only a JSON parser's position.
                reason = str(e) if isinstance(e, ValueError) else "nested too deeply"
                raise CorruptStoreError(
                    f"{path} is not valid JSON ({reason}): the SHA1 store's metadata is damaged. {restore}"
                ) from None
        problem = _metadata_problem(data)
        if problem is not None:
            raise CorruptStoreError(
                f"{path} is not SHA1 store metadata as wgit writes it: {problem}. The SHA1 store's metadata is "
                f"damaged. {restore}"
            )
        self._json_dict = data

    def _store_json_dict(self) -> None:
        check_not_link(self._metadata_file_path, "the SHA1 store's metadata.json")
        data = json.dumps(self._json_dict, ensure_ascii=False, indent=2).encode("utf-8")
        replace_file(self._metadata_file_path, lambda f: f.write(data))

    def _sha1_path(self, sha1: str) -> Path:
        problem = check_sha1(sha1)
        if problem is not None:
            # A key is a path below the store: anything but a SHA1 could name a file elsewhere.
            raise ValueError(f"SHA1 store key {problem}")
        return self._inside(sha1[:2], sha1[2:4], sha1)

    def _get_sha1_hash(self, file_path: Path) -> str:
        sha1 = hashlib.sha1()
        with open(file_path, "rb") as f:
            while True:
                data = f.read(self._sha1_buf_size)
                if not data:
                    break
                sha1.update(data)
        return sha1.hexdigest()

    def _entry(self, sha1: str) -> Dict[str, Any]:
        entry = self._json_dict.setdefault(sha1, {})
        for key, default in (
            (ENTRY_RF_KEY, 0),
            (ENTRY_OS_KEY, 0),
            (ENTRY_DS_KEY, 0),
            (ENTRY_CS_KEY, 0),
            (ENTRY_COMP_KEY, False),
            (ENTRY_NAMES_KEY, {}),
        ):
            entry.setdefault(key, default)
        return entry

    def add(
        self, file_or_obj: Union[Path, str, Tensor, Dict[Any, Any]], compress: bool = True, name: Optional[str] = None
    ) -> str:
        """Add a file (a ``torch.save`` file), a tensor or a dict; returns its SHA1.

        A file is loaded with ``torch.load(weights_only=True)``: its pickle never runs code. The object is pickled
        into a file of its own (a random name) in the scratch directory. The first add of a store object removes
        what killed adds left more than 24 hours ago: files in the default scratch directory (``<store>/tmp``), and
        temporary object and ``metadata.json`` files in the store. An add that fails leaves the store as it was (a
        new object file it wrote is removed again).

        Raises:
            UntrustedContentError: the file is not a ``torch.save`` checkpoint of tensors and plain containers (e.g.
                a plain pickle, or one naming other objects); an ``AssertionError`` as upstream.
            FairscaleTypeError: the input (or the file's content) is not a tensor or a dict, or holds a tensor that
                has no numpy equivalent (:func:`check_storable`), before anything is written (``AssertionError``).
            UnsafeRepositoryError: a path inside the store is a symbolic link.
        """
        with self._lock.held():  # metadata.json is read, changed and written back: one writer at a time
            return self._add(file_or_obj, compress, name)

    def _add(self, file_or_obj: Union[Path, str, Tensor, Dict[Any, Any]], compress: bool, name: Optional[str]) -> str:
        start = time.time()
        self._load_json_dict()
        obj: Any = file_or_obj
        if isinstance(file_or_obj, (Path, str)):
            obj = load_checkpoint(Path(file_or_obj))  # refuses too deep a nesting, as below
        if not isinstance(obj, (Tensor, dict)):
            raise FairscaleTypeError(
                f"incorrect input {type(obj)}: the SHA1 store takes a tensor or a dict (wgit tracks checkpoints that "
                "are a dict, such as a state dict, or a single tensor)"
            )
        problem = nesting_problem(obj)
        if problem is not None:  # the walk below, and pickle, would hit the recursion limit
            raise FairscaleValueError(f"incorrect input: the dict {problem}")
        check_storable(obj, str(file_or_obj) if isinstance(file_or_obj, (Path, str)) else "")
        tmp = self._scratch_dir().joinpath(uuid.uuid4().hex)
        try:
            with open(tmp, "xb") as f:  # "x": a name of its own, never another add's file
                pickle.dump(_to_np(obj), f)
            sha1 = self._get_sha1_hash(tmp)
            entry = self._entry(sha1)
            orig = tmp.stat().st_size
            is_new = entry[ENTRY_RF_KEY] == 0
            if is_new:
                try:
                    comp = self._copy_into_place(tmp, sha1, compress)
                except BaseException:
                    self._remove_object(sha1)  # the directories it created for the object
                    raise
                entry[ENTRY_OS_KEY] += orig
                entry[ENTRY_DS_KEY] += orig
                entry[ENTRY_CS_KEY] += comp
                entry[ENTRY_COMP_KEY] = compress  # the stored format; later adds do not change it
                self._json_dict[STORE_OS_KEY] += orig
                self._json_dict[STORE_DS_KEY] += orig
                self._json_dict[STORE_CS_KEY] += comp
            else:
                entry[ENTRY_OS_KEY] += orig
                self._json_dict[STORE_OS_KEY] += orig
            entry[ENTRY_RF_KEY] += 1
            if name is not None:
                entry[ENTRY_NAMES_KEY][name] = entry[ENTRY_NAMES_KEY].get(name, 0) + 1
            try:
                self._store_json_dict()
            except BaseException:
                # metadata.json keeps its old content (replace_file): an object file it does not list would stay
                # forever, as nothing ever deletes it (e.g. a disk that filled up between the two writes).
                if is_new:
                    self._remove_object(sha1)
                raise
        finally:
            tmp.unlink(missing_ok=True)  # missing: the pickle file could not even be created
        if time.time() - start > 60:
            logging.warning("Add to SHA1 store took %.1f seconds", time.time() - start)
        return sha1

    def _scratch_dir(self) -> Path:
        """The scratch directory for an add (the default one is created when missing); the first add of this store
        object also removes what killed adds left more than a day ago (see :mod:`.store_leftovers`): old files in
        the default scratch directory, and temporary object and ``metadata.json`` files in the store."""
        tmp_dir = self._tmp_dir
        if self._default_tmp:
            tmp_dir = self._inside("tmp")  # checked again: a link could have been planted since the store was opened
            tmp_dir.mkdir(exist_ok=True)
        if not self._tmp_cleaned:
            self._tmp_cleaned = True
            remove_stale_leftovers(self._path, tmp_dir if self._default_tmp else None)
        return tmp_dir

    def _remove_object(self, sha1: str) -> None:
        """Remove the object file of ``sha1`` if there is one, and its two directory levels once they are empty."""
        path = self._sha1_path(sha1)
        path.unlink(missing_ok=True)
        for directory in (path.parent, path.parent.parent):
            try:
                directory.rmdir()
            except OSError:  # not empty (other objects), or already gone
                break

    def _copy_into_place(self, src: Path, sha1: str, compress: bool) -> int:
        dest = self._sha1_path(sha1)  # checks the two directory levels and the file for links
        dest.parent.mkdir(parents=True, exist_ok=True)
        if compress:

            def write(f_out: IO[bytes]) -> None:
                # The header names the object file, not the temporary one (the same bytes as writing in place).
                threads, block = self._pgzip_threads, self._pgzip_block_size
                with open(src, "rb") as f_in, _gzip_open(dest, "wb", threads, block, fileobj=f_out) as z:
                    shutil.copyfileobj(f_in, z)

            replace_file(dest, write)
            orig, comp = src.stat().st_size, dest.stat().st_size
            if not (comp <= orig or comp < 1024 * 1024):
                # Upstream's sanity check of the compressor (an assert), kept under ``python -O``.
                raise AssertionError(f"compression grew {orig} bytes into {comp}")
            return comp

        def copy(f_out: IO[bytes]) -> None:
            with open(src, "rb") as f_in:
                shutil.copyfileobj(f_in, f_out)

        replace_file(dest, copy)
        return dest.stat().st_size

    def get(self, sha1: str) -> Any:
        """The object stored under ``sha1`` (numpy arrays turned back into tensors).

        Raises:
            ValueError: ``sha1`` is not a SHA1, or not in the store.
            UntrustedContentError: the stored bytes name anything but numpy arrays, plain containers and wgit's
                records, call or set the state of anything otherwise than pickle writes for them, declare more data
                than the object can hold, or nest containers too deep (they were not written by wgit; nothing in
                them runs, and nothing larger than the object's size is allocated).
            CorruptStoreError: the stored bytes do not hash to ``sha1`` (the file was changed, e.g. replaced by
                another array's of at most its size), or ``metadata.json`` is damaged. A change that fails an
                earlier check of the read (a larger object's bytes, a damaged compressed stream) raises
                ``UntrustedContentError``; both derive from ``WgitSafetyError``.
            UnsafeRepositoryError: a path inside the store is a symbolic link or not a regular file.
        """
        path = self._sha1_path(sha1)
        if not path.exists():
            raise ValueError(f"Try to get SHA1 {sha1} but it is not found")
        self._load_json_dict()
        what = f"SHA1 store object {sha1} ({path})"
        entry = self._entry(sha1)
        with open_regular(path, what) as raw:
            # Nothing larger than the object's pickle can be is read or allocated (a 35-byte object asked for 1 GB).
            limit = store_object_limit(os.fstat(raw.fileno()).st_size, entry[ENTRY_COMP_KEY], entry[ENTRY_DS_KEY])
            if entry[ENTRY_COMP_KEY]:
                with _gzip_open(path, "rb", self._pgzip_threads, self._pgzip_block_size, fileobj=raw) as f:
                    obj = load_store_object(f, what, sha1, limit=limit)
            else:
                obj = load_store_object(raw, what, sha1, limit=limit)
        return _from_np(obj)

    def delete(self, sha1: str, name: Optional[str] = None) -> None:
        """Drop one reference to ``sha1``; the object goes when none is left.

        The sizes that reference added are taken off the entry and the store totals (the object's, when it goes), so
        that deleting what an add added gives back the metadata from before that add (wgit rolls back a failed add
        this way).

        Args:
            sha1 (str): the object's key.
            name (Optional[str]): the name the reference was added under: its count drops too (gone at zero).

        Raises:
            ValueError: ``sha1`` is not a SHA1, or not in the store.
        """
        with self._lock.held():
            self._delete(sha1, name)

    def _delete(self, sha1: str, name: Optional[str]) -> None:
        path = self._sha1_path(sha1)
        if not path.exists():
            raise ValueError(f"Try to delete SHA1 {sha1} but it is not found")
        self._load_json_dict()
        entry = self._entry(sha1)
        refs = entry[ENTRY_RF_KEY]
        # Every reference added the same bytes (the same SHA1), so each counts for an equal share of original_size.
        share = entry[ENTRY_OS_KEY] // refs if refs > 0 else 0
        entry[ENTRY_OS_KEY] -= share
        self._json_dict[STORE_OS_KEY] = max(0, self._json_dict[STORE_OS_KEY] - share)
        entry[ENTRY_RF_KEY] -= 1
        names = entry[ENTRY_NAMES_KEY]
        if name is not None and name in names:
            names[name] -= 1
            if names[name] <= 0:
                del names[name]
        if entry[ENTRY_RF_KEY] <= 0:
            for total, field in ((STORE_DS_KEY, ENTRY_DS_KEY), (STORE_CS_KEY, ENTRY_CS_KEY)):
                self._json_dict[total] = max(0, self._json_dict[total] - entry[field])
            del self._json_dict[sha1]
            # metadata.json first: a failure to write it leaves the object, which it still lists, in place.
            self._store_json_dict()
            self._remove_object(sha1)
            return
        self._store_json_dict()

    def size_info(self, sha1: Optional[str] = None) -> Tuple[int, int, int]:
        """``(original, deduped, compressed)`` bytes of one object or of the whole store."""
        self._load_json_dict()
        if sha1 is None:
            return self._json_dict[STORE_OS_KEY], self._json_dict[STORE_DS_KEY], self._json_dict[STORE_CS_KEY]
        self._sha1_path(sha1)  # a key that is not a SHA1 is refused the same way everywhere
        if sha1 not in self._json_dict:
            raise ValueError(f"SHA1 {sha1} not found")
        entry = self._entry(sha1)
        return entry[ENTRY_OS_KEY], entry[ENTRY_DS_KEY], entry[ENTRY_CS_KEY]

    def names(self, sha1: Optional[str] = None) -> Dict[str, int]:
        """How many times ``sha1`` was added under each name.

        Raises:
            ValueError: ``sha1`` is None or not in the store.
        """
        if sha1 is None:
            raise ValueError("names() needs the SHA1 of an object in the store")
        self._sha1_path(sha1)
        self._load_json_dict()
        if sha1 not in self._json_dict:
            raise ValueError(f"SHA1 {sha1} not found")
        return dict(self._entry(sha1)[ENTRY_NAMES_KEY])
