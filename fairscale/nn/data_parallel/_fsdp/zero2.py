# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Validation and group helpers for ``zero2_process_group`` (hierarchical partitioning, fork contract section 2)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from fairscale.internal import collectives


def validate_at_construction(zero2_group: Any, process_group: Any, move_params_to_cpu: bool) -> Tuple[int, int]:
    """Local checks of a zero2 group; returns ``(rank inside the zero2 group, zero2 group size)``.

    Raises:
        ValueError: when the zero2 group size does not divide the sharding group size, or contains ranks that are
            not in ``process_group``.
    """
    if zero2_group is None:
        return 0, 1
    n = process_group.size()
    g = zero2_group.size()
    if g <= 0 or n % g != 0:
        raise ValueError(
            f"zero2_process_group has {g} ranks, which does not divide the {n} ranks of process_group; use a group "
            "of the ranks of one node (GPUs per node), e.g. fairscale.nn.data_parallel.zero2_groups(ranks_per_node)"
        )
    pg_ranks = set(collectives.group_ranks(process_group))
    z_ranks = collectives.group_ranks(zero2_group)
    outside = sorted(set(z_ranks) - pg_ranks)
    if outside:
        raise ValueError(
            f"zero2_process_group contains ranks {outside} that are not in process_group (ranks {sorted(pg_ranks)}); "
            "the zero2 group must be a subgroup of the sharding group"
        )
    return zero2_group.rank(), g


def check_partition(process_group: Any, zero2_group: Any) -> None:
    """Collective over ``process_group``: the zero2 groups of all ranks are equal-sized, disjoint and cover it.

    Every rank receives every rank's view, so a misconfiguration raises the same ``ValueError`` on every rank
    (never a hang in a later all-gather).
    """
    mine = tuple(collectives.group_ranks(zero2_group))
    views: List[Tuple[int, ...]] = collectives.all_gather_object(mine, group=process_group)
    pg_ranks = collectives.group_ranks(process_group)
    groups: Dict[Tuple[int, ...], None] = dict.fromkeys(views)
    sizes = {len(v) for v in groups}
    problem: Optional[str] = None
    if len(sizes) != 1:
        problem = f"zero2 groups have different sizes: {sorted(groups)}"
    else:
        covered: List[int] = [r for v in groups for r in v]
        if len(covered) != len(set(covered)):
            problem = f"zero2 groups overlap: {sorted(groups)}"
        elif sorted(covered) != sorted(pg_ranks):
            problem = f"zero2 groups {sorted(groups)} do not cover process_group ranks {sorted(pg_ranks)}"
        else:
            for rank, view in zip(pg_ranks, views):
                if rank not in view:
                    problem = f"rank {rank} passed a zero2 group {view} that does not contain itself"
                    break
    if problem is not None:
        raise ValueError(
            "invalid zero2_process_group: " + problem + ". Every rank must pass the group of its own node, and the "
            "groups must partition process_group into equal parts."
        )


def zero2_groups(ranks_per_group: int, ranks: Optional[Sequence[int]] = None) -> Any:
    """Create the usual zero2 groups (consecutive blocks of ``ranks_per_group`` ranks) and return this rank's.

    Every rank must call this with the same arguments: ``dist.new_group`` is collective over the whole world and
    each group has to be created by every rank in the same order, which this helper does.

    Args:
        ranks_per_group: ranks per group, usually the number of GPUs per node.
        ranks: the sharding group's global ranks (default: the whole world).

    Returns:
        The group that contains this rank.
    """
    all_ranks = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
    if ranks_per_group <= 0 or len(all_ranks) % ranks_per_group != 0:
        raise ValueError(f"ranks_per_group={ranks_per_group} must divide the number of ranks ({len(all_ranks)})")
    me = dist.get_rank()
    mine = None
    for start in range(0, len(all_ranks), ranks_per_group):
        block = all_ranks[start : start + ranks_per_group]
        group = dist.new_group(ranks=block)
        if me in block:
            mine = group
    if mine is None:
        raise ValueError(f"rank {me} is not among the ranks {all_ranks}")
    return mine
