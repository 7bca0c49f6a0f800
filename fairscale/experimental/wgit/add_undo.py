# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The undo record of one ``Repo.add``, and the rollback of an add that fails.

An add puts references in the SHA1 store, then writes the checkpoint's metadata file, then stages it in git's index.
A failed add (an error, or Ctrl-C) is rolled back in the opposite order of trust: first the metadata file is put back,
then git's index entry for it, and only then are the store references dropped. A rollback that is cut short in turn (a
second Ctrl-C, a SIGKILL) therefore leaves at worst store references that nothing names (a leak of disk space, see
docs/experimental.rst), never metadata, in the work tree or in the index, that names an object the rollback deleted:
dropping the references first made the next commit record such metadata. For the same reason, when the metadata or
the index cannot be put back (the disk may still be full), the references are kept.
"""

import logging
import re
from pathlib import Path
from typing import Any, List, Optional, Tuple

from .pygit import PyGit
from .safety import check_not_link, contained, open_regular, replace_file
from .sha1_store import SHA1_Store

__all__ = ["AddUndo", "GIT_EXCLUDED_TMP_RE", "REPLACE_TMP_RE", "exclude_replace_tmp_files", "read_previous"]

# The name replace_file gives the file it writes before renaming it into place (".<name>.<uuid4 hex>.tmp"): one is
# left in a metadata folder when an add is killed between the two. It is no metadata file (status skips it), and git
# must not stage it: the same names, as a git pattern, go to .git/info/exclude (local to the repository; .gitignore
# is upstream's format and is committed).
REPLACE_TMP_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
_REPLACE_TMP_GIT_PATTERN = ".*." + "[0-9a-f]" * 32 + ".tmp"
# What that git pattern matches, in any component of a path: its '*' may be empty ("..<hex>.tmp" too).
GIT_EXCLUDED_TMP_RE = re.compile(r"^\..*\.[0-9a-f]{32}\.tmp$")


def read_previous(metadata_file: Path) -> Optional[bytes]:
    """The bytes of ``metadata_file`` (``None``: there is none yet), for a failed add to put back."""
    try:
        with open_regular(metadata_file, "a metadata file") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def exclude_replace_tmp_files(dot_wgit: Path) -> None:
    """Make git ignore the temporary files of :func:`replace_file` (through ``.git/info/exclude``).

    A crashed add leaves one in a metadata folder, and staging (``git add --all``) would pick it up. The pattern goes
    to the repository's own exclude file, not to ``.gitignore`` (committed, upstream's format); it is written once, by
    the first add that finds it missing.
    """
    exclude = contained(dot_wgit, [".git", "info", "exclude"], "git's exclude file")
    try:
        with open_regular(exclude, "git's exclude file") as f:
            text = f.read().decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        text = ""
    if _REPLACE_TMP_GIT_PATTERN in text.splitlines():
        return
    exclude.parent.mkdir(exist_ok=True)
    check_not_link(exclude, "git's exclude file")
    new = (text if not text or text.endswith("\n") else text + "\n") + _REPLACE_TMP_GIT_PATTERN + "\n"
    data = new.encode("utf-8", errors="surrogateescape")
    replace_file(exclude, lambda f: f.write(data))


class AddUndo:
    """What one add changed, recorded as it goes, and its rollback (see the module docstring).

    Made while the add holds the store's writers' lock, before it writes anything: it reads the metadata file's bytes
    and git's index entry for it as they were.

    Args:
        store (SHA1_Store): the repository's store.
        pygit (PyGit): the repository's git.
        metadata_file (Path): the metadata file the add writes.
        dot_wgit (Path): the ``.wgit`` directory (git's work tree).

    Raises:
        pygit2.GitError: git cannot read its index (e.g. a damaged one), before anything is stored.
    """

    def __init__(self, store: SHA1_Store, pygit: PyGit, metadata_file: Path, dot_wgit: Path) -> None:
        self._store = store
        self._pygit = pygit
        self._metadata_file = metadata_file
        self._rel = metadata_file.relative_to(dot_wgit).as_posix()
        # None: the add creates the file. A failed re-add left the new SHA1, whose object the rollback deletes.
        self._previous = read_previous(metadata_file)
        # None: not in the index. An add interrupted after git wrote its index had the new metadata staged there.
        self._staged = pygit.staged_entry(self._rel)
        self._added: List[Tuple[str, Optional[str]]] = []  # (SHA1, name) of each reference put in the store
        self._created_dirs: List[Path] = []  # the metadata folders the add created, outermost first

    def store(self, obj: Any, compress: bool, name: Optional[str] = None) -> str:
        """Add ``obj`` to the store (see ``SHA1_Store.add``), recording the reference; returns its SHA1."""
        sha1 = self._store.add(obj, compress=compress, name=name)
        self._added.append((sha1, name))
        return sha1

    def make_dirs(self) -> None:
        """Create the folders the metadata file goes in (``.wgit`` exists), recording the ones created."""
        missing = []
        for directory in self._metadata_file.parents:
            if directory.exists():  # .wgit at the latest
                break
            missing.append(directory)
        for directory in reversed(missing):
            directory.mkdir()
            self._created_dirs.append(directory)

    def roll_back(self, error: BaseException) -> None:
        """Undo the add, in the crash-safe order of the module docstring.

        A step that fails does not stop the others; it is logged, and noted on ``error`` (the add's own error, which
        the caller raises).
        """
        # Both are tried: the index re-read also drops what git staged in memory only, which the next commit of this
        # Repo would otherwise take, whatever happened to the file.
        metadata_back = self._restore_metadata(error)
        index_back = self._restore_index(error)
        if metadata_back and index_back:
            self._drop_references(error)
        elif self._added:
            _note(
                error,
                f"wgit: the store keeps the {len(self._added)} references the failed add made, since the metadata "
                "may still name them (they only take disk space)",
            )
        for directory in reversed(self._created_dirs):
            try:
                directory.rmdir()
            except OSError:  # not empty: the metadata file is still there, or another add wrote there meanwhile
                break

    def _restore_metadata(self, error: BaseException) -> bool:
        previous = self._previous
        try:
            if previous is None:
                self._metadata_file.unlink(missing_ok=True)  # missing: the add failed before writing it
            elif read_previous(self._metadata_file) != previous:  # unchanged: the add failed before writing it
                replace_file(self._metadata_file, lambda f: f.write(previous))  # renamed over: never written through
        except (OSError, ValueError) as undo_error:  # ValueError: not a regular file now (UnsafeRepositoryError)
            _note(
                error, f"wgit: could not put back {self._metadata_file} as it was before the failed add: {undo_error}"
            )
            return False
        return True

    def _restore_index(self, error: BaseException) -> bool:
        try:
            self._pygit.restore_entry(self._rel, self._staged)
        except Exception as undo_error:  # noqa: B902  # git's error (a lock, a damaged index): the add's own is raised
            _note(error, f"wgit: could not put git's index back as it was before the failed add: {undo_error}")
            return False
        return True

    def _drop_references(self, error: BaseException) -> None:
        for sha1, name in reversed(self._added):
            try:
                self._store.delete(sha1, name=name)
            except Exception as undo_error:  # noqa: B902  # whatever failed, the add's own error is what is raised
                _note(error, f"wgit: could not drop the reference to {sha1} that the failed add stored: {undo_error}")


def _note(error: BaseException, text: str) -> None:
    """Log ``text`` (the command line prints only the error's message) and note it on ``error`` (Python 3.11+)."""
    logging.warning("%s", text)
    if hasattr(error, "add_note"):  # printed with the traceback
        error.add_note(text)
