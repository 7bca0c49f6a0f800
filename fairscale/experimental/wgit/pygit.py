# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A small wrapper around a ``pygit2`` repository whose work tree is wgit's ``.wgit`` directory.

The repository is ``.wgit/.git`` itself and nothing else. Git can be sent elsewhere without a symbolic link: a
``gitdir:`` file in place of the directory, a ``commondir`` file naming another repository, ``objects/info/alternates``,
or the config's ``core.worktree``, ``core.bare`` and ``include`` settings. A ``.wgit`` from someone else could use any
of them to make ``wgit add``/``commit`` write into another repository (move its branch, write its objects), so they
are refused with :class:`~fairscale.experimental.wgit.safety.UnsafeRepositoryError` before git opens the repository
(the config settings, which only git's resolution tells, right after: before anything is written).
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fairscale.internal.errors import FairscaleRuntimeError

from .safety import check_not_link, unsafe

__all__ = ["PyGit"]


def import_pygit2() -> Any:
    """``pygit2``, or an ``ImportError`` saying what to install (upstream printed and exited instead)."""
    try:
        import pygit2
    except ImportError as e:
        raise ImportError("Error: please pip install pygit2 module to use wgit") from e
    return pygit2


# libgit2's GIT_REPOSITORY_OPEN_NO_SEARCH: open the given directory only, never walk up to a parent's repository.
_OPEN_NO_SEARCH = 1


def _open(pygit2: Any, git_dir: Path, work_tree: Path) -> Optional[Any]:
    """The repository at ``git_dir``, ``None`` when there is none yet (no ``.git``, or an empty directory: a
    half-made repository, created afresh).

    Raises:
        UnsafeRepositoryError: ``git_dir`` is not a real directory, holds something that sends git elsewhere, is not
            a git repository, or git resolves it to another git directory or work tree.
    """
    if not os.path.lexists(git_dir):
        return None
    _check_git_dir(git_dir)
    if not any(git_dir.iterdir()):
        return None
    try:
        repo = pygit2.Repository(str(git_dir), _OPEN_NO_SEARCH)
    except pygit2.GitError as e:
        # Creating a repository over it could keep whatever it holds: refused rather than repaired.
        raise unsafe(git_dir, f"it is not a git repository that wgit can open ({e})") from None
    _check_resolution(pygit2, repo, git_dir, work_tree)
    return repo


def _check_git_dir(git_dir: Path) -> None:
    """Refuse what makes git use files outside ``git_dir``, read before git opens it."""
    check_not_link(git_dir, ".wgit/.git")
    if not git_dir.is_dir():
        raise unsafe(
            git_dir,
            "it is not a directory (a 'gitdir:' file points git to a repository elsewhere, which wgit would write "
            "into)",
        )
    redirects = {
        "commondir": "it names another repository, whose branches, objects and logs git would write instead",
        "objects/info/alternates": "it makes git read objects from other repositories",
    }
    for name, why in redirects.items():
        if os.path.lexists(git_dir / name):
            raise unsafe(git_dir / name, why)


def _check_resolution(pygit2: Any, repo: Any, git_dir: Path, work_tree: Path) -> None:
    """Refuse a repository that git resolved to another git directory or work tree (config settings)."""
    if Path(repo.path).resolve() != git_dir.resolve():
        raise unsafe(git_dir, f"git resolves it to the repository {repo.path}, which wgit would write into")
    if repo.is_bare or repo.workdir is None:
        raise unsafe(git_dir / "config", "it sets core.bare: git would not treat .wgit as the repository's work tree")
    if Path(repo.workdir).resolve() != work_tree.resolve():
        raise unsafe(
            git_dir / "config",
            f"it sets core.worktree to {repo.workdir}: git would read and write files there instead of in {work_tree}",
        )
    local = pygit2.Config(str(git_dir / "config")) if (git_dir / "config").is_file() else []
    for entry in local:
        if entry.name.lower().startswith(("include.", "includeif.")):
            raise unsafe(git_dir / "config", f"it includes other configuration files ({entry.name} = {entry.value})")
        if entry.name.lower() in _PATH_SETTINGS:
            # Files git reads on every status or commit, anywhere (a FIFO hung every command; a security fuzz,
            # session 46); wgit never sets them.
            raise unsafe(git_dir / "config", f"it makes git read other files ({entry.name} = {entry.value})")


# Settings that name files or programs git would read or run; wgit's repositories never set them.
_PATH_SETTINGS = frozenset(
    ("core.excludesfile", "core.attributesfile", "core.hookspath", "core.fsmonitor", "core.sshcommand", "core.askpass")
)


def _write_gitignore(path: Path, entries: List[str]) -> None:
    with open(path, "x") as f:  # "x" creates a new file and never follows a link
        for item in entries:
            f.write(f"{item}\n")


def _entry_of(index: Any, rel_path: str) -> Optional[Tuple[str, int]]:
    try:
        entry = index[rel_path]
    except KeyError:
        return None
    return str(entry.id), int(entry.mode)


class PyGit:
    """The git repository of a wgit repo.

    Args:
        parent_path (Path): the work tree (the ``.wgit`` directory).
        gitignore (List[str]): entries of the ``.gitignore`` written when the repository is created, or when the
            repository exists without one (a creation killed between git's init and that write); ``[]``: open only.
        name, email (str): the commit author when ``git config user.name/user.email`` are not both set.
    """

    def __init__(
        self, parent_path: Path, gitignore: List[str] = [], name: str = "user", email: str = "user@email.com"
    ) -> None:
        pygit2 = import_pygit2()
        self._parent_path = Path(parent_path)
        self.name, self.email = self._set_author_config(name, email)
        self.path = self._parent_path.joinpath(".git")
        # Only .wgit/.git (never a repository found in a parent directory, nor one it points to).
        self.repo: Optional[Any] = _open(pygit2, self.path, self._parent_path)
        gitignore_path = self._parent_path.joinpath(".gitignore")
        if self.repo is None:
            # lexists: a dangling link counts (writing through it would create its target, wherever it points).
            if os.path.lexists(gitignore_path):
                raise FairscaleRuntimeError(
                    f"{gitignore_path} already exists but {self._parent_path} holds no git repository; remove it (or "
                    "the whole directory if it is a half-made wgit repository) and retry"
                )
            self.repo = pygit2.init_repository(str(self._parent_path), False)
            _write_gitignore(gitignore_path, gitignore)
        elif gitignore and not os.path.lexists(gitignore_path):
            # A creation killed after git's init: without .gitignore no command (wgit init included) took the
            # directory for a repository. The file is the last thing a creation writes, so it is finished here.
            _write_gitignore(gitignore_path, gitignore)

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

    def reread_index(self) -> None:
        """Drop the changes staged in memory that were not written (an ``add`` that failed at the index's write, e.g.
        on a lock): the next commit would otherwise take them from memory, though the files were restored."""
        if self._exists:
            self._repo().index.read(True)

    def staged_entry(self, rel_path: str) -> Optional[Tuple[str, int]]:
        """``(blob id, mode)`` of ``rel_path`` (relative to the work tree, ``/``-separated) in git's index as written
        on disk, ``None`` when it is not there."""
        if not self._exists:
            return None
        index = self._repo().index
        index.read(True)
        return _entry_of(index, rel_path)

    def restore_entry(self, rel_path: str, entry: Optional[Tuple[str, int]]) -> None:
        """Drop the changes staged in memory only, and give ``rel_path`` the index entry ``entry`` again (``None``:
        none) if the index on disk has another one: an add interrupted after git wrote its index had staged its new
        metadata there, and the next commit would have recorded it though the file was put back."""
        if not self._exists:
            return
        pygit2 = import_pygit2()
        index = self._repo().index
        index.read(True)
        if _entry_of(index, rel_path) == entry:
            return
        if entry is None:
            index.remove(rel_path)
        else:
            index.add(pygit2.IndexEntry(rel_path, pygit2.Oid(hex=entry[0]), entry[1]))
        index.write()

    def unstaged(self) -> List[str]:
        """The paths (relative to the work tree) whose changes in the work tree git has not staged."""
        pygit2 = import_pygit2()
        work_tree_flags = (
            pygit2.GIT_STATUS_WT_NEW
            | pygit2.GIT_STATUS_WT_MODIFIED
            | pygit2.GIT_STATUS_WT_DELETED
            | pygit2.GIT_STATUS_WT_TYPECHANGE
            | pygit2.GIT_STATUS_WT_RENAMED
        )
        return sorted(path for path, flags in self.status().items() if flags & work_tree_flags)

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

    def ignores(self, rel_path: str) -> bool:
        """Whether git ignores ``rel_path`` (relative to the work tree, ``/``-separated): a ``.gitignore`` entry, the
        repository's ``info/exclude`` or the user's global ``core.excludesFile``; a file never staged nor committed."""
        return bool(self._repo().path_is_ignored(rel_path))

    def status(self) -> Dict[str, int]:
        """``{path: pygit2 status flags}`` without ignored files (128: untracked, 1: staged new)."""
        pygit2 = import_pygit2()
        repo = self._repo()
        return {k: v for k, v in repo.status().items() if v != pygit2.GIT_STATUS_IGNORED}
