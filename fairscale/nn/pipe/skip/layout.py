# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The skip layout: which partition stashes and which pops each skip name, and what must be copied."""

from typing import Dict, List, Tuple

from torch import nn

from ._routes import NsName, SkipLayout
from .namespace import Namespace as Namespace  # upstream's namespace of this module
from .skippable import Skippable

__all__ = ["SkipLayout", "inspect_skip_layout"]


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
