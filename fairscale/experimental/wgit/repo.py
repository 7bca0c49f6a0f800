# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``Repo``: a wgit repository: checkpoint metadata tracked by git in ``.wgit``, tensors in a SHA1 store."""

import copy
import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from .pygit import PyGit, import_pygit2
from .sha1_store import SHA1_Store

__all__ = ["Repo", "RepoStatus", "SizeInfo"]

SHA1_STORE_DIR_NAME = "sha1_store"
SHA1_KEY = "SHA1"
LAST_MODIFIED_TS_KEY = "last_modified_time_stamp"
REL_PATH_KEY = "file_path"


@dataclass
class SizeInfo:
    original: int
    deduped: int
    sparsified: int
    gzipped: int


@dataclass
class _SHA1_Tensor:
    """Stands for a tensor stored in the SHA1 store (pickled by this module path)."""

    is_dense: bool = True
    dense_sha1: str = ""
    sst_sha1: str = ""
    dst_sha1: str = ""


class RepoStatus(Enum):
    CLEAN = 1
    CHANGES_NOT_ADDED = 2
    CHANGES_ADDED_NOT_COMMITED = 3


def _recursive_apply_to_elements(data: Any, fn: Callable[[Any, str], Any], names: List[str]) -> None:
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in list(items):
        path = names + [str(key)]
        if isinstance(value, (dict, list)):
            _recursive_apply_to_elements(value, fn, path)
        else:
            data[key] = fn(value, ".".join(path))


class Repo:
    """A wgit repository at ``parent_dir`` (default: the current directory).

    Args:
        parent_dir (str): where the ``.wgit`` directory is (or will be).
        init (bool): create the repository when none is found.

    Exits with status 1 (after a ``fatal:`` message on stderr) when there is no repository at ``parent_dir``.

    Raises:
        ImportError: ``pygit2`` is not installed.
    """

    def __init__(self, parent_dir: Union[str, Path] = "", init: bool = False) -> None:
        import_pygit2()  # before anything is created on disk: a missing pygit2 leaves no half-made repository
        self._repo_path: Optional[Path] = None
        self._wgit_parent = Path(parent_dir) if parent_dir else Path.cwd()
        self._dot_wgit_dir_path: Optional[Path] = None
        exists = self._recursive_search(self._wgit_parent)
        if not exists and init:
            self._dot_wgit_dir_path = self._wgit_parent.joinpath(".wgit")
            self._dot_wgit_dir_path.mkdir(parents=False, exist_ok=True)
            self._sha1_store = SHA1_Store(self._dot_wgit_dir_path.joinpath(SHA1_STORE_DIR_NAME), init=True)
            self._pygit = PyGit(self._dot_wgit_dir_path, gitignore=[SHA1_STORE_DIR_NAME])
        elif exists:
            assert self._repo_path is not None
            self._dot_wgit_dir_path = self._repo_path.joinpath(".wgit")
            self._sha1_store = SHA1_Store(self._dot_wgit_dir_path.joinpath(SHA1_STORE_DIR_NAME))
            self._pygit = PyGit(self._dot_wgit_dir_path)
        else:
            sys.stderr.write("fatal: not a wgit repository!\n")
            sys.exit(1)
        self._sanity_check()

    def _recursive_search(self, root: Path) -> bool:
        for directory in [root.resolve()] + list(root.resolve().parents):
            if self._is_valid(directory):
                self._repo_path = directory
                return True
        return False

    @staticmethod
    def _is_valid(directory: Path) -> bool:
        wgit = directory.joinpath(".wgit")
        return wgit.is_dir() and wgit.joinpath(".git").exists() and wgit.joinpath(".gitignore").exists()

    def _sanity_check(self) -> None:
        # A repository found only in an ancestor directory is refused too (upstream's behaviour).
        if not self._is_valid(self._wgit_parent):
            sys.stderr.write("fatal: no wgit repo exists!\n")
            sys.exit(1)

    @property
    def _dot_wgit(self) -> Path:
        assert self._dot_wgit_dir_path is not None
        return self._dot_wgit_dir_path

    def add(
        self,
        in_file_path: str,
        per_tensor: bool = True,
        gzip: bool = True,
        sparsify: bool = False,
        sparsify_policy: Any = None,
    ) -> Optional[Any]:
        """Track a checkpoint: store it (tensor by tensor when ``per_tensor``) and stage its metadata.

        Returns:
            A copy of the loaded state dict when ``per_tensor``, else ``None``.
        """
        self._sanity_check()
        if sparsify and not per_tensor:
            raise ValueError("Only support sparsity when per_tensor is true")
        file_path = Path(in_file_path)
        metadata_file = self._process_metadata_file(self._rel_file_path(file_path))
        ret_state_dict = None
        to_store: Any = file_path
        if per_tensor:

            def fn(element: Any, name: str) -> Any:
                if not isinstance(element, Tensor):
                    return element
                if sparsify:
                    raise NotImplementedError("sparsified tensors are not supported yet")
                return _SHA1_Tensor(is_dense=True, dense_sha1=self._sha1_store.add(element, compress=gzip, name=name))

            state_dict = torch.load(file_path, weights_only=False)
            assert isinstance(state_dict, (dict, list)), "only a dict or a list checkpoint can be added per tensor"
            ret_state_dict = copy.deepcopy(state_dict)
            _recursive_apply_to_elements(state_dict, fn, [])
            to_store = state_dict
        sha1 = self._sha1_store.add(to_store, compress=gzip)
        self._write_metadata(metadata_file, file_path, sha1)
        self._pygit.add()
        return ret_state_dict

    def commit(self, message: str) -> None:
        """Commit the staged metadata."""
        self._sanity_check()
        self._pygit.commit(message)

    def status(self) -> Dict[str, RepoStatus]:
        """The status of every tracked file (``{"": CLEAN}`` when nothing is tracked)."""
        self._sanity_check()
        pygit_status = self._pygit.status()
        files = self._get_metdata_files()
        if not files:
            return {"": RepoStatus.CLEAN}
        result: Dict[str, RepoStatus] = {}
        for metadata_file, is_modified in files.items():
            if is_modified:
                result[metadata_file] = RepoStatus.CHANGES_NOT_ADDED
            elif metadata_file in pygit_status:
                result[metadata_file] = RepoStatus.CHANGES_ADDED_NOT_COMMITED
            else:
                result[metadata_file] = RepoStatus.CLEAN
        return result

    def log(self, file: str) -> None:
        """Print the log header of ``file`` (or of the repository)."""
        self._sanity_check()
        print(f"wgit log of the file: {file}" if file else "wgit log")

    def checkout(self, sha1: str) -> None:
        raise NotImplementedError

    def checkout_by_steps(self) -> None:
        raise NotImplementedError

    def size_info(self, path: Optional[str] = None) -> SizeInfo:
        raise NotImplementedError

    def _get_metdata_files(self) -> Dict[str, bool]:
        found: Dict[str, bool] = {}
        for child in sorted(self._dot_wgit.iterdir()):
            if child.name in (SHA1_STORE_DIR_NAME, ".git", ".gitignore") or not child.is_dir():
                continue
            for file in sorted(p for p in child.rglob("*") if p.is_file()):
                found[str(file.relative_to(self._dot_wgit))] = self._is_file_modified(file)
        return found

    @staticmethod
    def _is_file_modified(metadata_file: Path) -> bool:
        with open(metadata_file) as f:
            try:
                metadata = json.load(f)
            except json.JSONDecodeError:
                return False
        tracked = Path(metadata[REL_PATH_KEY])
        return tracked.stat().st_mtime != metadata[LAST_MODIFIED_TS_KEY]

    def _process_metadata_file(self, rel_path: Path) -> Path:
        metadata_file = self._dot_wgit.joinpath(rel_path)
        metadata_file.parent.mkdir(parents=True, exist_ok=True)
        metadata_file.touch(exist_ok=True)
        return metadata_file

    @staticmethod
    def _write_metadata(metadata_file: Path, file_path: Path, sha1: str) -> None:
        metadata = {
            SHA1_KEY: sha1,
            LAST_MODIFIED_TS_KEY: file_path.stat().st_mtime,
            REL_PATH_KEY: str(file_path),
        }
        with open(metadata_file, "w", encoding="utf-8") as f:
            json.dump(metadata, f, ensure_ascii=False, indent=4)

    @staticmethod
    def _rel_file_path(filepath: Path) -> Path:
        """The parts of the resolved path from the last part shared in length with the CWD (upstream's rule, which
        never compares the parts: a file in the CWD gives ``<CWD name>/<file>``)."""
        tracking_path = filepath.resolve()
        i = 0
        for i, _ in enumerate(zip(tracking_path.parts, Path.cwd().parts)):
            pass
        return Path(*tracking_path.parts[i:])
