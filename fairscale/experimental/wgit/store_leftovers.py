# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What adds that were killed (SIGKILL, out of memory, a power cut) leave in a SHA1 store, and its removal.

A killed add can leave three kinds of files, none of which any store entry names:

* ``tmp/<uuid4 hex>``: the pickle of the object it was adding (the object's uncompressed size), in the default
  scratch directory;
* ``<xx>/<yy>/.<sha1>.<uuid4 hex>.tmp``: the object being written into place (its compressed size), beside where the
  object goes;
* ``.metadata.json.<uuid4 hex>.tmp``: the store's metadata being written (a few hundred bytes per object).

The first add of a store object removes the ones older than a day (``STALE_SECONDS``). It holds the store's writers'
lock then, so no other add is writing; the age is a second guard (a file system whose ``flock`` does not exclude
other machines, or no ``fcntl``): a live add's files are as old as the writing of one object. Nothing is followed
through a symbolic link, and only regular files of those names are removed.

The store references a killed add made are not leftovers of this kind: see ``docs/experimental.rst``.
"""

import os
import re
import stat
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["METADATA_TMP_RE", "STALE_SECONDS", "remove_stale_leftovers"]

# A file older than this is a leftover of an add that was killed: a live add's file is as old as the pickling or the
# writing of one object (seconds to minutes), so a concurrent add's file is never taken for one.
STALE_SECONDS = 24 * 60 * 60
# The temporary file replace_file writes metadata.json into before renaming it (".<name>.<uuid4 hex>.tmp").
METADATA_TMP_RE = re.compile(r"^\.metadata\.json\.[0-9a-f]{32}\.tmp$")
# The same for an object file, whose name is its SHA1.
_OBJECT_TMP_RE = re.compile(r"^\.([0-9a-f]{40})\.[0-9a-f]{32}\.tmp$")
_LEVEL_RE = re.compile(r"^[0-9a-f]{2}$")


def remove_stale_leftovers(store: Path, scratch: Optional[Path]) -> None:
    """Remove the leftovers of killed adds older than ``STALE_SECONDS`` from the store directory ``store`` and (when
    given) every old regular file from the scratch directory ``scratch``; object folders left empty go too.

    A file or folder that cannot be read or removed (gone meanwhile, not ours) is skipped: the add goes on.
    """
    cutoff = time.time() - STALE_SECONDS
    if scratch is not None:
        _remove_old_files(scratch, cutoff, lambda name: True)
    _remove_old_files(store, cutoff, lambda name: METADATA_TMP_RE.match(name) is not None)
    for level1 in _object_levels(store):
        for level2 in _object_levels(level1):
            prefix = level1.name + level2.name

            def is_object_tmp(name: str, prefix: str = prefix) -> bool:
                match = _OBJECT_TMP_RE.match(name)
                return match is not None and match.group(1).startswith(prefix)

            if _remove_old_files(level2, cutoff, is_object_tmp):
                for folder in (level2, level1):
                    try:
                        folder.rmdir()  # the killed add created it for an object it never put in place
                    except OSError:  # not empty: other objects
                        break


def _object_levels(directory: Path) -> Iterator[Path]:
    """The object folders (two hex digits) directly in ``directory``; never a symbolic link."""
    try:
        with os.scandir(directory) as entries:
            found = [Path(e.path) for e in entries if _LEVEL_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    yield from sorted(found)


def _remove_old_files(directory: Path, cutoff: float, wanted: Callable[[str], bool]) -> bool:
    """Remove the regular files directly in ``directory`` whose name is ``wanted`` and whose modification time is
    before ``cutoff``; whether one was removed."""
    removed = False
    try:
        with os.scandir(directory) as entries:
            candidates = [e for e in entries if wanted(e.name)]
    except OSError:
        return False
    for entry in candidates:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.unlink(entry.path)
                removed = True
        except OSError:
            continue
    return removed
