# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Saved optimizer hyper-parameters (a parameter group's ``lr``, ``betas`` ...), checked before they are copied.

A checkpoint's values are copied (``copy.deepcopy``) and compared across ranks (``repr``), and neither remembers a
tuple it has seen: a tuple whose two items are one tuple, forty levels deep, is a few hundred bytes in a file and
``2**40`` steps for either, on every rank (a security review, session 50). And a group's ``lr`` loaded as a dict was
taken as it came: the next step failed far from the cause. A value is walked with a bounded count first, and a value
the optimizer holds as a number must be a number in the checkpoint too.
"""

import copy
import numbers
from typing import Any, Dict, Mapping

from torch import Tensor

from .errors import FairscaleValueError

__all__ = ["checked_hyper_parameters"]

# Far more than any optimizer's values (betas: 2 numbers; Adafactor, Lion and the like: a few more; a per-group list
# of a few thousand values), and cheap to copy and compare.
_MAX_ITEMS = 65536
_MAX_DEPTH = 8
_SKIPPED = ("params", "param_names")


def checked_hyper_parameters(saved: Mapping[Any, Any], live: Mapping[Any, Any], what: str) -> Dict[Any, Any]:
    """Copies of a saved parameter group's values (not its ``params``), each checked against the optimizer's group.

    Args:
        saved: the parameter group from the state dict or checkpoint.
        live: the optimizer's own group it loads into.
        what: the start of an error message (the call and the group).

    Returns:
        Dict[Any, Any]: the saved values, copied (tensors detached and cloned).

    Raises:
        FairscaleValueError: a value nests deeper than 8 levels or holds more than 65536 items, or is not a number
            where the optimizer's value is one (or not a sequence of as many numbers where it holds one).
    """
    out: Dict[Any, Any] = {}
    for key, value in saved.items():
        if key in _SKIPPED:
            continue
        problem = _size_problem(value)
        if problem is None and key in live:
            problem = _kind_problem(value, live[key])
        if problem is not None:
            raise FairscaleValueError(
                f"{what}: the saved hyper-parameter {key!r} {problem}; the state dict belongs to another optimizer, "
                "or was edited or damaged. Nothing was loaded."
            )
        out[key] = _copied(value)
    return out


def _copied(value: Any) -> Any:
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    # A learned lr (a leaf that requires grad) goes on learning; deepcopy refuses a non-leaf.
    return value.detach().clone().requires_grad_(value.requires_grad and value.is_leaf)


def _size_problem(value: Any) -> Any:
    count = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > _MAX_ITEMS:
            return f"holds more than {_MAX_ITEMS} values (counting every level of its containers)"
        if depth > _MAX_DEPTH:
            return f"nests more than {_MAX_DEPTH} levels deep"
        if isinstance(item, (tuple, list, set, frozenset)):
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, Mapping):
            stack.extend((x, depth + 1) for pair in item.items() for x in pair)
    return None


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    if type(value).__name__ == "ndarray":  # numpy: a 0-d array of an old checkpoint
        return getattr(value, "size", 0) == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _kind_problem(value: Any, current: Any) -> Any:
    if _is_number(current) and not _is_number(value):
        return f"is a {type(value).__name__} ({_short(value)}), but the optimizer's is a number ({_short(current)})"
    if isinstance(current, (tuple, list)) and current and all(_is_number(x) for x in current):
        if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == len(current):
            return None  # betas as one tensor
        if not (isinstance(value, (tuple, list)) and len(value) == len(current) and all(_is_number(x) for x in value)):
            return f"is {_short(value)}, but the optimizer's is {len(current)} numbers ({_short(current)})"
    return None


def _short(value: Any) -> str:
    text = repr(value)  # bounded: called on values _size_problem accepted
    return text if len(text) <= 80 else text[:77] + "..."
