# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A content-addressed, reference-counted store of tensors and state dicts (wgit's object store).

Objects are serialised as ``pickle.dump(to_np(obj))`` (tensors as numpy arrays), named by the SHA1 of those bytes
and kept at ``<path>/<sha1[:2]>/<sha1[2:4]>/<sha1>``, gzip-compressed on request. ``metadata.json`` holds the
store totals and, per object, its reference count, sizes, compression flag and the names it was added under.
Compression uses ``pgzip`` (parallel gzip) when installed and the standard library's ``gzip`` otherwise (same
format); numpy is imported when an object is added or read.
"""

import gzip
import hashlib
import json
import logging
import pickle
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

# Upstream's module also exposes these names (ExitCode and the container converters it imported).
from fairscale.internal.containers import from_np as from_np, to_np as to_np  # noqa: F401

from .utils import ExitCode as ExitCode  # noqa: F401

__all__ = ["SHA1_Store"]

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


def _to_np(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_np(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_np(v) for v in obj]
    return obj


def _from_np(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _from_np(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_np(v) for v in obj]
    return obj


def _gzip_open(path: Path, mode: str, threads: Optional[int], block_size: int) -> Any:
    try:
        import pgzip
    except ImportError:
        return gzip.open(path, mode, compresslevel=5)
    return pgzip.open(path, mode, compresslevel=5, thread=threads, blocksize=block_size)


class SHA1_Store:
    """The object store at ``path`` (see the module docstring).

    Args:
        path (Path): the store directory.
        init (bool): create it (its parent must exist) when missing.
        sha1_buf_size (int): read size when hashing.
        tmp_dir (str): an existing scratch directory (default: ``<path>/tmp``, wiped on construction).
        pgzip_threads (Optional[int]), pgzip_block_size (int): pgzip settings.
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
        self._path = Path(path)
        self._metadata_file_path = self._path.joinpath("metadata.json")
        self._sha1_buf_size = sha1_buf_size
        self._pgzip_threads = pgzip_threads
        self._pgzip_block_size = pgzip_block_size
        self._json_dict: Dict[str, Any] = {
            STORE_CREATE_DATE_KEY: time.ctime(),
            STORE_OS_KEY: 0,
            STORE_DS_KEY: 0,
            STORE_CS_KEY: 0,
        }
        if init and not self._path.exists():
            self._path.mkdir(parents=False)
            self._store_json_dict()
        assert self._path.is_dir(), f"{self._path} is not a SHA1 store directory"
        assert self._metadata_file_path.exists(), f"{self._metadata_file_path} is missing"
        self._load_json_dict()
        assert STORE_CREATE_DATE_KEY in self._json_dict, "metadata.json is not a SHA1 store header"
        if tmp_dir:
            assert Path(tmp_dir).is_dir(), f"tmp_dir {tmp_dir} must exist"
            self._tmp_dir = Path(tmp_dir)
        else:
            self._tmp_dir = self._path.joinpath("tmp")
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir.mkdir()

    def _load_json_dict(self) -> None:
        with open(self._metadata_file_path, "r") as f:
            self._json_dict = json.load(f)

    def _store_json_dict(self) -> None:
        with open(self._metadata_file_path, "w", encoding="utf-8") as f:
            json.dump(self._json_dict, f, ensure_ascii=False, indent=2)

    def _sha1_path(self, sha1: str) -> Path:
        return self._path.joinpath(sha1[:2], sha1[2:4], sha1)

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

        Raises:
            AssertionError: the input is not a tensor, a dict or a ``torch.save`` file (e.g. a plain pickle).
        """
        start = time.time()
        self._load_json_dict()
        obj: Any = file_or_obj
        if isinstance(file_or_obj, (Path, str)):
            try:
                with open(file_or_obj, "rb") as f:
                    pickle.load(f)
                # A plain pickle is not a supported input (upstream's behaviour): ``obj`` stays the path.
            except Exception:
                obj = torch.load(file_or_obj, weights_only=False)
        assert isinstance(obj, (Tensor, dict)), f"incorrect input {type(obj)}"
        tmp = self._tmp_dir.joinpath(uuid.uuid4().hex)
        with open(tmp, "wb") as f:
            pickle.dump(_to_np(obj), f)
        try:
            sha1 = self._get_sha1_hash(tmp)
            entry = self._entry(sha1)
            orig = tmp.stat().st_size
            if entry[ENTRY_RF_KEY] == 0:
                comp = self._copy_into_place(tmp, sha1, compress)
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
        finally:
            tmp.unlink()
        self._store_json_dict()
        if time.time() - start > 60:
            logging.warning("Add to SHA1 store took %.1f seconds", time.time() - start)
        return sha1

    def _copy_into_place(self, src: Path, sha1: str, compress: bool) -> int:
        dest = self._sha1_path(sha1)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if compress:
            with open(src, "rb") as f_in, _gzip_open(dest, "wb", self._pgzip_threads, self._pgzip_block_size) as f_out:
                shutil.copyfileobj(f_in, f_out)
            orig, comp = src.stat().st_size, dest.stat().st_size
            assert comp <= orig or comp < 1024 * 1024, f"compression grew {orig} bytes into {comp}"
            return comp
        shutil.copy2(src, dest)
        return dest.stat().st_size

    def get(self, sha1: str) -> Any:
        """The object stored under ``sha1`` (numpy arrays turned back into tensors)."""
        path = self._sha1_path(sha1)
        if not path.exists():
            raise ValueError(f"Try to get SHA1 {sha1} but it is not found")
        self._load_json_dict()
        if self._entry(sha1)[ENTRY_COMP_KEY]:
            with _gzip_open(path, "rb", self._pgzip_threads, self._pgzip_block_size) as f:
                obj = pickle.load(f)
        else:
            with open(path, "rb") as f:
                obj = pickle.load(f)
        return _from_np(obj)

    def delete(self, sha1: str) -> None:
        """Drop one reference to ``sha1``; the object goes when none is left."""
        path = self._sha1_path(sha1)
        if not path.exists():
            raise ValueError(f"Try to delete SHA1 {sha1} but it is not found")
        self._load_json_dict()
        entry = self._entry(sha1)
        entry[ENTRY_RF_KEY] -= 1
        if entry[ENTRY_RF_KEY] <= 0:
            path.unlink()
            del self._json_dict[sha1]
        self._store_json_dict()

    def size_info(self, sha1: Optional[str] = None) -> Tuple[int, int, int]:
        """``(original, deduped, compressed)`` bytes of one object or of the whole store."""
        self._load_json_dict()
        if sha1 is None:
            return self._json_dict[STORE_OS_KEY], self._json_dict[STORE_DS_KEY], self._json_dict[STORE_CS_KEY]
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
        self._load_json_dict()
        if sha1 not in self._json_dict:
            raise ValueError(f"SHA1 {sha1} not found")
        return dict(self._entry(sha1)[ENTRY_NAMES_KEY])
