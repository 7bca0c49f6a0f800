# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Opening a file to scan: a regular file only (reading a named pipe blocks until someone writes to it); a window on
part of an open file (an entry of a larger file)."""

import io
import os
import stat
from typing import Any, BinaryIO, Union

from .errors import PickleScanError

__all__ = ["FileWindow", "file_kind", "open_regular_file"]


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


class FileWindow(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of a seekable binary ``stream``, as a file of their own.

    For the scan of one entry of a larger file (a DCP data file holds one ``torch.save`` entry per tensor): Python's
    ``zipfile`` seeks from the end, which torch's own view of an entry gets wrong (it adds a negative offset's size).
    Reads never pass the window's end; the stream's position is this window's business while it is read.
    """

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._pos = stream, int(offset), int(length), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the start of the window")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._length - self._pos))
        if size == 0:
            return 0
        self._stream.seek(self._offset + self._pos)
        data = self._stream.read(size)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)
