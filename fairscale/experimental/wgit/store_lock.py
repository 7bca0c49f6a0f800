# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One writer at a time in a SHA1 store: an exclusive ``flock`` on ``<store>/lock`` around every change.

An add reads ``metadata.json``, stores objects and writes the file back: two adds at the same time (two training jobs
tracking checkpoints, a script and a shell) each wrote their own copy, and the later one dropped the other's entries,
whose objects then failed to load. Readers (``status``, ``get``) take no lock and write nothing: ``metadata.json`` is
replaced whole (renamed into place), so a reader sees the file before or after a change, never half of one.

The lock is re-entrant within one :class:`StoreLock` (``Repo.add`` holds it across the store's own adds, so that a
rollback of a failed add happens before anyone else writes); two processes, or two store objects in one process,
exclude each other (``flock`` locks an open file). The operating system releases it when its process dies, so a
killed add leaves no stale lock. A writer that waits says so on stderr, once: a stuck add elsewhere is visible, not a
silent hang. Where ``fcntl`` is missing (Windows), there is no lock.
"""

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

from .safety import check_not_link

try:
    import fcntl
except ImportError:  # not POSIX: no lock (the module docstring)
    fcntl = None  # type: ignore[assignment]

__all__ = ["StoreLock"]


class StoreLock:
    """The writers' lock of the store at ``store_dir`` (the file ``store_dir/lock``, created by the first writer)."""

    def __init__(self, store_dir: Path) -> None:
        self._path = store_dir / "lock"
        self._fd: Optional[int] = None
        self._depth = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block (waiting for another writer first); nested blocks hold it once."""
        if self._depth == 0:
            self._acquire()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._release()

    def _acquire(self) -> None:
        if fcntl is None:
            return
        check_not_link(self._path, "the SHA1 store's lock file")
        # O_NOFOLLOW: a link planted after the check fails the open (ELOOP) instead of creating its target.
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self._path, flags, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                sys.stderr.write(f"wgit: waiting for another wgit add in this repository to finish ({self._path})\n")
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of the open file releases its flock
            self._fd = None
