# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How the scan shows what it found in a file: escaped for a terminal, short, named by its type."""

import reprlib
from typing import Any

__all__ = ["printable", "shown", "described"]

# Control characters (C0, DEL, C1) as escapes: a planted file name holding a terminal escape sequence was written
# raw to the user's terminal in wgit's messages (found by a security review, session 42).
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``), for a line written to a terminal."""
    return text.translate(_CONTROLS)


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


def shown(value: Any) -> str:
    """A short repr of ``value`` for a message; one that cannot be made (an int past Python's 4300 digits for
    ``str``) is named by its type."""
    try:
        return _SHORT_REPR.repr(value)
    except ValueError:
        return f"<a {type(value).__name__} too large to show>"


def described(obj: Any) -> str:
    """``obj`` named by its class (or, for a class, by itself)."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"
