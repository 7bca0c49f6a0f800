# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The skip layout: which partition stashes and which pops each skip name, and what must be copied."""

from typing import Dict, List, Tuple

from torch import nn

from ._routes import NsName, SkipLayout
from .namespace import Namespace as Namespace  # upstream's namespace of this module
from .skippable import Skippable

__all__ = ["SkipLayout", "inspect_skip_layout"]


def check_nested_skips(module: nn.Sequential, balance: List[int]) -> None:
    """Refuse a skip whose stash and pop land in different partitions when either is not a direct child.

    Only direct children are routed between partitions (as upstream): a nested pair that the balance split went
    through the thread's plain tracker, and with checkpointing the backward failed with "'s' has not been stashed",
    which points at the wrong cause. A nested pair inside one partition works, and is left alone.

    Raises:
        ValueError: naming the skip and the partitions.
    """
    places: Dict[NsName, Dict[str, Tuple[int, bool]]] = {}
    children = list(module.children())
    starts = [sum(balance[:j]) for j in range(len(balance))]
    for index, child in enumerate(children):
        partition = max(j for j, start in enumerate(starts) if start <= index)
        for layer in child.modules():
            if not isinstance(layer, Skippable):
                continue
            nested = layer is not child
            for key in layer.stashable():
                places.setdefault(key, {})["stash"] = (partition, nested)
            for key in layer.poppable():
                places.setdefault(key, {})["pop"] = (partition, nested)
    for (ns, name), where in places.items():
        if "stash" not in where or "pop" not in where:
            continue
        (stash_at, stash_nested), (pop_at, pop_nested) = where["stash"], where["pop"]
        if stash_at != pop_at and (stash_nested or pop_nested):
            raise ValueError(
                f"Pipe: the skip {name!r} is stashed in partition {stash_at} and popped in partition {pop_at}, by a "
                "@skippable layer nested inside a child module: only direct children of the nn.Sequential are routed "
                "between partitions. Make the stashing and popping layers direct children, or choose a balance that "
                "keeps them in one partition."
            )


def inspect_skip_layout(partitions: List[nn.Sequential]) -> SkipLayout:
    """Build the layout from the direct children of each partition (deeper skippables are not routed)."""
    skip_routes: Dict[NsName, Tuple[int, int]] = {}
    stashed_at: Dict[NsName, int] = {}
    for j, partition in enumerate(partitions):
        layers = list(partition) if isinstance(partition, nn.Sequential) else [partition]
        for layer in layers:
            if not isinstance(layer, Skippable):
                continue
            for ns, name in layer.stashable():
                stashed_at[(ns, name)] = j
            for ns, name in layer.poppable():
                prev_j = stashed_at.pop((ns, name))
                skip_routes[(ns, name)] = (prev_j, j)
    return SkipLayout(len(partitions), skip_routes)
