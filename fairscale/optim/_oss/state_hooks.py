# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""torch's optimizer state-dict hooks on OSS: they see, and may replace, the whole dict, as on a torch optimizer.

``register_state_dict_post_hook`` and ``register_load_state_dict_pre_hook`` (torch's way to cast a checkpoint's
moments, or to adapt an old dict before a load) ran inside the calls OSS makes on its own part of the dict: a post
hook saw no per-parameter state and its edits were not in ``OSS.state_dict()``'s result, and a pre hook ran after
the wrapped optimizer had loaded its shard, so what it changed or returned was not loaded (found by a fuzz of OSS,
session 44). OSS holds them back from those inner calls and runs them on the whole dict instead.
"""

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List

from torch.optim import Optimizer

__all__ = ["held_back", "run_returning", "run_post_load"]

STATE_DICT_POST = "_optimizer_state_dict_post_hooks"
LOAD_PRE = "_optimizer_load_state_dict_pre_hooks"
LOAD_POST = "_optimizer_load_state_dict_post_hooks"


@contextlib.contextmanager
def held_back(optimizer: Optimizer, *names: str) -> Iterator[List["OrderedDict[int, Callable[..., Any]]"]]:
    """Empty the hook tables ``names`` of ``optimizer`` for the block; yields what they held (restored after)."""
    saved = [getattr(optimizer, name, None) or OrderedDict() for name in names]
    present = [name for name in names if hasattr(optimizer, name)]  # torch versions without a table: nothing to do
    for name in present:
        setattr(optimizer, name, OrderedDict())
    try:
        yield saved
    finally:
        for name, table in zip(names, saved):
            if name in present:
                setattr(optimizer, name, table)


def run_returning(
    optimizer: Optimizer, hooks: "OrderedDict[int, Callable[..., Any]]", state_dict: Dict[str, Any]
) -> Dict[str, Any]:
    """Run ``hooks(optimizer, state_dict)`` in order; a hook that returns a dict replaces it for the next ones."""
    for hook in hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_post_load(optimizer: Optimizer, hooks: "OrderedDict[int, Callable[..., Any]]") -> None:
    """Run the load post hooks ``hook(optimizer)``, once the whole load succeeded."""
    for hook in hooks.values():
        hook(optimizer)
