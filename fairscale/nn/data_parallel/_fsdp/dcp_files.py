# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The files of a DCP checkpoint's directory before a save writes into it.

torch's writer opens each of its files (``__<rank>_<n>.distcp``, ``.metadata``) for writing as it finds it: a symlink
of that name in a directory received from someone else (or an earlier checkpoint copied with its links) made the
save write the checkpoint's bytes over the link's target, anywhere on the machine (a security review, session 50).
A load refuses such files already (:func:`.dcp_metadata.check_regular_file`).
"""

import os
import re
import stat
from typing import Any

__all__ = ["remove_planted_entries"]

# torch's writer writes the metadata to a ".tmp" name first, then renames it.
_DCP_NAME = re.compile(r"__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?")


def remove_planted_entries(directory: Any) -> None:
    """Remove the entries of ``directory`` named like DCP's files that are not regular files (symlinks, pipes,
    devices) or that have other hard links, so that the writer creates new files in their place instead of writing
    through them: a checkpoint snapshotted with hard links (``cp -al``, ``rsync --link-dest``) and then overwritten
    had the snapshot's files rewritten too, silently (a review, session 50).

    Run on every rank before its writes (several ranks may remove one entry: a missing one is fine). Errors are left
    to the writer, which reports them on every rank: a rank raising here would leave the others waiting in DCP's
    planning.
    """
    path = os.fspath(directory)
    try:
        names = os.listdir(path)
    except OSError:
        return  # no directory yet (the writer creates it), or not a local one
    for name in names:
        if not _DCP_NAME.fullmatch(name):
            continue
        entry = os.path.join(path, name)
        try:
            info = os.lstat(entry)
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
                os.remove(entry)  # the link itself, never its target
        except OSError:
            pass
