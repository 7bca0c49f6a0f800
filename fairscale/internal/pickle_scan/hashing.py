# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The work Python does to hash a dict key or set member, counted before it does it.

A tuple's hash is not cached: it hashes its items again each time, so a tuple shared at every level (``t = (t, t)``,
a few bytes per level through pickle's memo) as a key hashed ``2**depth`` tuples, forever for a few hundred bytes.
"""

from typing import Any, Dict, List, Tuple

from .errors import PickleScanError
from .nesting import MAX_NESTING

__all__ = ["HASHING_FLOOR", "hash_steps"]

HASHING_FLOOR = 10**6  # steps of hashing and key comparison any object may take (about 4 s counted here)

_NESTED = (tuple, frozenset)  # what hash_steps looks into


def _leaf_steps(value: Any) -> int:
    """The steps of hashing a value hash_steps does not look into: an int reads every digit, the rest is cached."""
    return 1 + value.bit_length() // 64 if type(value) is int else 1


def hash_steps(value: Any, costs: Dict[int, int], cap: int, depths: Dict[int, int], reader: str = "fairscale") -> int:
    """The steps Python may take on ``value`` as a dict key or set member: hashing it, and comparing it with an equal
    key already there (hashes equal). Tuples (``torch.Size`` too) hash their items again each time, frozensets cache
    their hash but compare member by member, and an int's hash reads every digit: such a value costs the sum over
    its items, each counted as often as it occurs (a tower ``t = (t, t)`` of 60 levels is ``2**61`` steps).
    Anything else costs 1 (strings and bytes cache their hash). Each container's count is worked out once in
    ``costs`` (by identity) and capped at ``cap``, its depth in ``depths``: nesting deeper than
    :data:`~.nesting.MAX_NESTING` is refused (:class:`PickleScanError`, naming ``reader``) before Python recurses
    into it. Iterative."""
    if not isinstance(value, _NESTED):
        return _leaf_steps(value)
    pending: List[Tuple[Any, bool]] = [(value, False)]
    while pending:
        node, ready = pending.pop()
        if id(node) in costs:
            continue
        if ready:  # its containers are counted: they were pushed above it
            steps = 1 + sum(costs[id(c)] if isinstance(c, _NESTED) else _leaf_steps(c) for c in node)
            costs[id(node)] = min(cap, steps)
            # Python hashes (and compares) a tuple by recursing in C with no depth check: a key 300,000 tuples deep
            # crashed the process (a security review, session 48). The depth is kept beside the cost.
            depth = 1 + max((depths[id(c)] for c in node if isinstance(c, _NESTED)), default=0)
            if depth > MAX_NESTING:
                raise PickleScanError(
                    f"its dict keys or set members nest more than {MAX_NESTING} deep ({reader} handles at most "
                    f"{MAX_NESTING} levels)"
                )
            depths[id(node)] = depth
        else:
            pending.append((node, True))
            pending.extend((c, False) for c in node if isinstance(c, _NESTED) and id(c) not in costs)
    return costs[id(value)]
