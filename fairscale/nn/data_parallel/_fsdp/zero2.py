# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Validation and group helpers for ``zero2_process_group`` (hierarchical partitioning, fork contract section 2)."""

import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.parallel import default_group_timeout, new_group_with_timeout


def local_problem(zero2_group: Any, process_group: Any) -> Optional[str]:
    """What this rank alone can see wrong with its zero2 group (``None`` if nothing).

    Not raised here: a rank that raised at construction would leave the others waiting in the lazy-init check.
    The problem is reported through :func:`check_partition` instead, so every rank raises the same error.
    """
    if zero2_group is None:
        return None
    if not hasattr(zero2_group, "size") or zero2_group == dist.GroupMember.NON_GROUP_MEMBER:
        return f"rank {dist.get_rank()} is not a member of the zero2_process_group it was given"
    n = process_group.size()
    g = zero2_group.size()
    if g <= 0 or n % g != 0:
        return f"rank {dist.get_rank()}: zero2 group size {g} does not divide the process_group size {n}"
    pg_ranks = set(collectives.group_ranks(process_group))
    outside = sorted(set(collectives.group_ranks(zero2_group)) - pg_ranks)
    if outside:
        return f"rank {dist.get_rank()}: zero2 group has ranks {outside} that are not in process_group"
    return None


def rank_and_size(zero2_group: Any, problem: Optional[str]) -> Tuple[int, int]:
    """``(rank inside the zero2 group, its size)``; ``(0, 1)`` without a usable group."""
    if zero2_group is None or problem is not None:
        return 0, 1
    return zero2_group.rank(), zero2_group.size()


def check_same_setting(
    process_group: Any,
    named_groups: List[Tuple[str, Any, Any]],
    token: Any = None,
    extra: Any = None,
    layouts: Any = None,
) -> Tuple[Any, List[Any], List[Any]]:
    """Collective over ``process_group`` (the root's, or the whole world with hybrid sharding) that every rank runs,
    zero2 or replicate group or not.

    ``named_groups`` lists ``(path, zero2_process_group, replicate_process_group)`` of every FSDP instance of the
    tree. Every rank must have the same FSDP instances with the same zero2 and replicate settings: otherwise the
    ranks with such a group would run the next checks and then gather or reduce over it while the others use
    ``process_group``, and the collectives would never match. Raises the same ``RanksDisagreeError`` on every rank when
    they differ.

    ``token`` and ``extra`` ride along in the same gather (no extra collective): the first rank's token is returned,
    so every rank ends up with the same one (the checkpoint identity's run token), with every rank's ``extra`` in
    rank order. ``layouts`` (one :func:`.layout_check.describe` per instance) ride along too and come back as the
    third value, every rank's in rank order, for the caller to compare once the groups themselves are checked.
    """
    # Presence only: sizes and membership are the next checks' job, with a more precise message.
    mine = [(path or "<root>", zero2 is not None, replicate is not None) for path, zero2, replicate in named_groups]
    gathered: List[Tuple[List[Tuple[str, bool, bool]], Any, Any, Any]] = collectives.all_gather_object(
        (mine, token, extra, layouts), group=process_group
    )
    views = [view for view, _, _, _ in gathered]
    ranks = collectives.group_ranks(process_group)
    if all(view == views[0] for view in views):
        return gathered[0][1], [e for _, _, e, _ in gathered], [lay for _, _, _, lay in gathered]
    paths = [[path for path, _, _ in view] for view in views]
    if any(p != paths[0] for p in paths):
        # Another nesting on some rank: the groups are beside the point, and the user may have passed none.
        lines = [f"rank {rank}: {len(p)} instances {_shown(p)}" for rank, p in zip(ranks, paths)]
        raise RanksDisagreeError(
            "the FSDP instances (the modules wrapped, and their nesting) differ between ranks: "
            + "; ".join(lines)
            + ". Wrap the same modules on every rank (the same auto_wrap policy and module tree)."
        )
    lines = []
    for rank, view in zip(ranks, views):
        with_zero2 = [path for path, has_group, _ in view if has_group]
        with_replicate = [path for path, _, has_group in view if has_group]
        lines.append(
            f"rank {rank}: zero2_process_group on {with_zero2 or 'none'}, "
            f"replicate_process_group on {with_replicate or 'none'}"
        )
    raise RanksDisagreeError(
        "zero2_process_group or replicate_process_group differs between ranks: "
        + "; ".join(lines)
        + ". Pass such a group on every rank (each rank its own, e.g. from zero2_groups() or hybrid_groups()) or on "
        "none."
    )


def _shown(paths: List[str]) -> str:
    text = repr(paths)
    return text if len(text) <= 300 else text[:297] + "..."


def check_partition(process_group: Any, zero2_group: Any, problem: Optional[str]) -> None:
    """Collective over ``process_group``: every rank's zero2 group is usable, and together they are equal-sized,
    disjoint and cover ``process_group``.

    Every rank receives every rank's view, so a misconfiguration raises the same ``ValueError`` on every rank
    (never a hang in a later all-gather, never an error on some ranks only).
    """
    mine = None if problem is not None else tuple(collectives.group_ranks(zero2_group))
    views: List[Tuple[Optional[Tuple[int, ...]], Optional[str]]] = collectives.all_gather_object(
        (mine, problem), group=process_group
    )
    problems = [p for _, p in views if p is not None]
    if problems:
        _raise("; ".join(problems))
    pg_ranks = collectives.group_ranks(process_group)
    groups: Dict[Tuple[int, ...], None] = dict.fromkeys(v for v, _ in views if v is not None)
    sizes = {len(v) for v in groups}
    if len(sizes) != 1:
        _raise(f"zero2 groups have different sizes: {sorted(groups)}")
    covered: List[int] = [r for v in groups for r in v]
    if len(covered) != len(set(covered)):
        _raise(f"zero2 groups overlap: {sorted(groups)}")
    if sorted(covered) != sorted(pg_ranks):
        _raise(f"zero2 groups {sorted(groups)} do not cover process_group ranks {sorted(pg_ranks)}")
    for rank, (view, _) in zip(pg_ranks, views):
        if view is None or rank not in view:
            _raise(f"rank {rank} passed a zero2 group {view} that does not contain itself")


def _raise(problem: str) -> None:
    raise ValueError(
        "invalid zero2_process_group: " + problem + ". Every rank must pass the group of its own node, and the "
        "groups must partition process_group into equal parts (see fairscale.nn.data_parallel.zero2_groups)."
    )


def zero2_groups(
    ranks_per_group: int, ranks: Optional[Sequence[int]] = None, timeout: Optional[datetime.timedelta] = None
) -> Any:
    """Create the usual zero2 groups (consecutive blocks of ``ranks_per_group`` ranks) and return this rank's.

    Every rank must call this with the same arguments: ``dist.new_group`` is collective over the whole world and
    each group has to be created by every rank in the same order, which this helper does.

    Args:
        ranks_per_group: ranks per group, usually the number of GPUs per node.
        ranks: the sharding group's global ranks (default: the whole world).
        timeout: collective timeout of the groups; default: the default group's (``init_process_group``'s).

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
        # Like FSDP's cached groups, inherit the default group's timeout (new_group alone uses the backend's).
        timeout = timeout if timeout is not None else default_group_timeout()
        group = new_group_with_timeout(block, timeout)
        if me in block:
            mine = group
    if mine is None:
        raise ValueError(f"rank {me} is not among the ranks {all_ranks}")
    return mine
