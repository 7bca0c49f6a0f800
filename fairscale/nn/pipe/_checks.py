# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Argument checks shared by :class:`~fairscale.nn.pipe.Pipe` and :class:`~fairscale.nn.pipe.AsyncPipe`."""

import numbers
from typing import Any, Callable, List

__all__ = ["balance_entries"]


def balance_entries(balance: Any, error: Callable[[str], Exception] = ValueError) -> List[int]:
    """``balance`` as a list of ints, once every entry was checked to be a positive integer.

    A float entry (``[1.5, 2.5]``) or a bool (``[True, 3]``) is rejected rather than compared with layer counts: a
    float that never equals a count silently made no partition at all. Any integral type (``numpy.int64`` too) is
    accepted and stored as ``int``. Non-positive entries and a sum that does not match the module are checked by the
    callers, with upstream's messages.

    Args:
        balance (Any): what the user passed as ``balance``.
        error (Callable[[str], Exception]): builds the exception for a bad entry (the caller's balance error type).

    Returns:
        List[int]: the entries.

    Raises:
        TypeError: ``balance`` is not iterable.
        Exception: ``error(message)`` naming the first entry that is not an integer.
    """
    try:
        entries = list(balance)
    except TypeError:
        raise TypeError(
            f"balance must be an iterable of ints (layers per partition, e.g. [2, 2]), not {type(balance).__name__}: "
            f"{balance!r}"
        ) from None
    for index, entry in enumerate(entries):
        if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
            raise error(
                f"balance entry {index} is {entry!r} ({type(entry).__name__}): each entry must be a positive int, "
                f"the number of layers of its partition (balance: {entries!r})"
            )
    return [int(entry) for entry in entries]
