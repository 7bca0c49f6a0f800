# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A small wrapper around a ``pygit2`` repository whose work tree is wgit's ``.wgit`` directory."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fairscale.internal.errors import FairscaleRuntimeError

__all__ = ["PyGit"]


def import_pygit2() -> Any:
    """``pygit2``, or an ``ImportError`` saying what to install (upstream printed and exited instead)."""
    try:
        import pygit2
    except ImportError as e:
        raise ImportError("Error: please pip install pygit2 module to use wgit") from e
    return pygit2


class PyGit:
    """The git repository of a wgit repo.

    Args:
        parent_path (Path): the work tree (the ``.wgit`` directory).
        gitignore (List[str]): entries of the ``.gitignore`` written when the repository is created.
        name, email (str): the commit author when ``git config user.name/user.email`` are not both set.
    """

    def __init__(
        self, parent_path: Path, gitignore: List[str] = [], name: str = "user", email: str = "user@email.com"
    ) -> None:
        pygit2 = import_pygit2()
        self._parent_path = Path(parent_path)
        self.name, self.email = self._set_author_config(name, email)
        self.path = self._parent_path.joinpath(".git")
        discovered = pygit2.discover_repository(str(self._parent_path))
        self.repo: Optional[Any] = None
        if discovered is not None:
            repo = pygit2.Repository(discovered)
            if repo.workdir is not None and Path(repo.workdir).resolve() == self._parent_path.resolve():
                self.repo = repo
        if self.repo is None:
            gitignore_path = self._parent_path.joinpath(".gitignore")
            # lexists: a dangling link counts (writing through it would create its target, wherever it points).
            if os.path.lexists(gitignore_path):
                raise FairscaleRuntimeError(
                    f"{gitignore_path} already exists but {self._parent_path} holds no git repository; remove it (or "
                    "the whole directory if it is a half-made wgit repository) and retry"
                )
            self.repo = pygit2.init_repository(str(self._parent_path), False)
            with open(gitignore_path, "x") as f:  # "x" creates a new file and never follows a link
                for item in gitignore:
                    f.write(f"{item}\n")

    @staticmethod
    def _set_author_config(name: str, email: str) -> Tuple[str, str]:
        def config(key: str) -> str:
            try:
                out = subprocess.run(["git", "config", key], capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.SubprocessError):
                return ""
            return out.stdout.strip()

        git_name, git_email = config("user.name"), config("user.email")
        if git_name and git_email:
            return git_name, git_email
        return name, email

    def _repo(self) -> Any:
        if self.repo is None:  # set by __init__, which raises otherwise
            raise RuntimeError("wgit: the git repository is not open")
        return self.repo

    @property
    def _exists(self) -> bool:
        return self.repo is not None and self.path.exists()

    @property
    def _path(self) -> Path:
        return self.path

    def add(self) -> None:
        """Stage every change of the work tree."""
        if not self._exists:
            sys.stderr.write("fatal: git repo does not exist")
            return
        repo = self._repo()
        index = repo.index
        index.add_all()
        index.write()

    def commit(self, message: str) -> None:
        """Commit the index on ``HEAD``."""
        if not self._exists:
            sys.stderr.write("fatal: git repo does not exist")
            return
        pygit2 = import_pygit2()
        repo = self._repo()
        tree = repo.index.write_tree()
        author = pygit2.Signature(self.name, self.email)
        parents = [] if repo.head_is_unborn else [repo.head.target]
        repo.create_commit("HEAD", author, author, message, tree, parents)

    def status(self) -> Dict[str, int]:
        """``{path: pygit2 status flags}`` without ignored files (128: untracked, 1: staged new)."""
        pygit2 = import_pygit2()
        repo = self._repo()
        return {k: v for k, v in repo.status().items() if v != pygit2.GIT_STATUS_IGNORED}
