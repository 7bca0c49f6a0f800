# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What an unpickler reads: no more than the bytes a file can hold, hashed on the way."""

import hashlib
import pickle
import struct
from typing import IO

from .errors import PickleScanError, UnreadableFileError

__all__ = ["HashingReader", "PICKLE_ERRORS"]


class HashingReader:
    """What the unpickler reads from ``f``, fed to a SHA1 on the way (checking an object's key costs no second read),
    and refused past ``limit`` bytes."""

    def __init__(self, f: IO[bytes], limit: int) -> None:
        self._f = f
        self._sha1 = hashlib.sha1()
        self._limit = limit
        self._left = limit

    def _refuse(self, what: str) -> PickleScanError:
        # Unreadable: what a truncated file (or a plain pickle read as a legacy torch.save) gives too, so that callers
        # word it so (a review, session 50); wgit words every refusal alike.
        return UnreadableFileError(
            f"it declares {what}, more than the {self._left} bytes left of the {self._limit} bytes it can hold"
        )

    def read(self, n: int) -> bytes:
        # Checked before reading: a file's read(n) allocates n bytes first, however few the file holds (an object of
        # a few bytes declaring 10**14 bytes of data raised a bare MemoryError).
        if n > self._left:
            raise self._refuse(f"{n} bytes of data")
        data = self._f.read(n)
        self._left -= len(data)
        self._sha1.update(data)
        return data

    def readline(self) -> bytes:
        data = self._f.readline(self._left + 1)
        if len(data) > self._left:
            raise self._refuse("a longer line")
        self._left -= len(data)
        self._sha1.update(data)
        return data

    def hexdigest(self) -> str:
        """The SHA1 of all of ``f``: what the unpickler read, and what it left after the pickle's end."""
        while True:
            data = self._f.read(1024 * 1024)
            if not data:
                return self._sha1.hexdigest()
            self._sha1.update(data)


# What the pure-Python unpickler raises on bytes that are not a valid pickle (a truncated or damaged one).
PICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    OverflowError,
    struct.error,
)
