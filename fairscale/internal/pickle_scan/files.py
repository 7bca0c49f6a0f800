# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Opening a file to scan: a regular file only (reading a named pipe blocks until someone writes to it)."""

import os
import stat
from typing import BinaryIO, Union

from .errors import PickleScanError

__all__ = ["file_kind", "open_regular_file"]


def file_kind(mode: int) -> str:
    """What an entry of ``mode`` (``os.stat``'s ``st_mode``) is, for a message (``"a named pipe (FIFO)"``)."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def open_regular_file(path: Union[str, "os.PathLike[str]"]) -> BinaryIO:
    """``path`` opened for binary reading, refused unless it is a regular file.

    A link to one is followed; a named pipe, a device or a socket is refused (``torch.load`` on a named pipe blocked
    forever). It is opened without waiting for a pipe's writer and checked on the open file, so an entry swapped in
    meanwhile is refused too.

    Raises:
        OSError: ``path`` cannot be opened (missing, unreadable).
        PickleScanError: it is not a regular file (``reason``: ``"it is a named pipe (FIFO), not a regular file"``).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PickleScanError(f"it is {file_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise
