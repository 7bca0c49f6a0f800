# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's process groups: every rank, the ranks of each node, and the node masters.

A node is ``nprocs_per_node`` consecutive ranks; its first rank is its master. Gradients are averaged inside a node
after every backward; the inter-node algorithm (LocalSGD or SGP) runs among the masters only, which then broadcast
the result inside their node.
"""

from dataclasses import dataclass
from typing import Any, Optional

from fairscale.internal.errors import FairscaleValueError

from .utils.helpers import create_process_group

__all__ = ["SlowMoGroups", "build_groups"]


@dataclass
class SlowMoGroups:
    """Where one rank stands, and the groups it uses (``None`` where the group would have one member)."""

    local_rank: int  # within the node
    logical_rank: int  # the node's index
    logical_world_size: int  # the number of nodes
    global_group: Any
    local_node_group: Optional[Any]
    master_group: Optional[Any]


def build_groups(
    process_rank: int,
    world: int,
    nprocs_per_node: int,
    global_group: Any = None,
    master_group: Any = None,
    local_node_group: Any = None,
) -> SlowMoGroups:
    """The groups, created where the caller passed none (collective: every rank calls it, in the same order).

    Raises:
        FairscaleValueError: ``world`` is not a multiple of ``nprocs_per_node``.
    """
    nppn = nprocs_per_node
    if world % nppn != 0:
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel: world size {world} is not a multiple of nprocs_per_node {nppn}; "
            "pass nprocs_per_node that divides the world size"
        )
    nodes, node = world // nppn, process_rank // nppn
    if global_group is None:
        global_group = create_process_group(range(world))
    if nppn == 1:
        local_node_group = None
    elif local_node_group is None:
        for other in range(nodes):  # new_group is collective: every rank creates every node's group
            group = create_process_group(range(other * nppn, (other + 1) * nppn))
            if other == node:
                local_node_group = group
    if master_group is None:
        if nppn == 1:
            master_group = global_group
        else:
            masters = [r for r in range(world) if r % nppn == 0]
            master_group = create_process_group(masters) if len(masters) > 1 else None
    return SlowMoGroups(process_rank % nppn, node, nodes, global_group, local_node_group, master_group)
