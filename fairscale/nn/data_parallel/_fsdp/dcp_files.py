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

_DCP_NAME = re.compile(r"__\d+_\d+\.distcp|\.metadata|__\d+\.metadata")


def remove_planted_entries(directory: Any) -> None:
    """Remove the entries of ``directory`` named like DCP's files that are not regular files (symlinks, pipes,
    devices), so that the writer creates plain files in their place instead of writing through them.

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
            mode = os.lstat(entry).st_mode
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                os.remove(entry)  # the link itself, never its target
        except OSError:
            pass
