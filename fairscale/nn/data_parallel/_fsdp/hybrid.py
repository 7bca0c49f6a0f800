# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Hybrid sharding (``replicate_process_group``): shard inside a group of ranks, replicate across groups.

``process_group`` is the *shard group* (usually one node): parameters are sharded over it, gathered over it and their
gradients reduce-scattered over it, all on the fast link. The *replicate group* holds the ranks of the same shard
index in the other shard groups (the same local rank on every node); after the reduce-scatter, each gradient shard
is all-reduced over it (:mod:`fairscale.internal.reduce_scatter_bucketer` does it per bucket). Only that all-reduce,
of ``1/shard size`` of the gradient, crosses nodes.

The groups must form a grid over the world: every rank ``r`` is in exactly one shard group and one replicate group,
they meet only in ``r``, and all the members of a replicate group hold the same shard index. :func:`check_grid`
verifies that from every rank's view, gathered once at the first forward, so a bad layout raises the same
``ValueError`` on every rank instead of mixing shards or hanging.
"""

import datetime
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from fairscale.internal import collectives
from fairscale.internal.parallel import default_group_timeout, get_process_group_cached, new_group_with_timeout

#: One rank's view of one FSDP instance with a replicate group: (path, shard group ranks, replicate group ranks, this
#: rank's index in the shard group, problem seen locally or None). Ranks are global, in group order.
HybridView = Tuple[str, Tuple[int, ...], Tuple[int, ...], int, Optional[str]]


def local_problem(replicate_group: Any, process_group: Any) -> Optional[str]:
    """What this rank alone can see wrong with its replicate group (``None`` if nothing).

    Not raised at construction: a rank that raised there would leave the others waiting in the first forward's
    check. The problem travels in :func:`view` instead, so that every rank raises the same error.
    """
    if replicate_group is None:
        return None
    me = dist.get_rank()
    if not hasattr(replicate_group, "size") or replicate_group == dist.GroupMember.NON_GROUP_MEMBER:
        return f"rank {me} is not a member of the replicate_process_group it was given"
    shared = set(collectives.group_ranks(replicate_group)) & set(collectives.group_ranks(process_group))
    if shared != {me}:
        return (
            f"rank {me}: replicate_process_group and process_group share ranks {sorted(shared)}; they must meet "
            "in this rank only"
        )
    return None


def world_group() -> Any:
    """FSDP's cached group of the whole world, over which hybrid settings are checked and loads agree.

    :func:`fairscale.nn.data_parallel._fsdp.config.make_config` creates it at the construction of the first hybrid
    instance (``new_group`` is collective, and construction happens in the same order on every rank), where an
    instance built without a ``process_group`` creates it too.
    """
    return get_process_group_cached()


def rank_and_size(replicate_group: Any, problem: Optional[str]) -> Tuple[int, int]:
    """``(rank inside the replicate group, its size)``; ``(0, 1)`` without a usable group."""
    if replicate_group is None or problem is not None:
        return 0, 1
    return replicate_group.rank(), replicate_group.size()


def view(path: str, process_group: Any, replicate_group: Any, problem: Optional[str]) -> HybridView:
    """This rank's :data:`HybridView` of one instance, for :func:`check_grid`."""
    shard = tuple(collectives.group_ranks(process_group))
    replicate = () if problem is not None else tuple(collectives.group_ranks(replicate_group))
    return (path, shard, replicate, process_group.rank(), problem)


def views_of_tree(named_configs: Sequence[Tuple[str, Any]]) -> List[HybridView]:
    """This rank's views of a tree's instances (``(path, FSDPConfig)`` pairs), empty without hybrid sharding.

    In a tree with hybrid instances, an instance without a replicate group must shard over the whole world (a
    legitimate mix: full sharding for that part) or over one rank (kept rank-local on purpose, like upstream's MoE
    experts). Over a part of the world its gradients would be averaged inside that part only, and its parameters
    would drift apart between the replicas: that is reported as a problem of its view, raised on every rank.
    """
    views = [
        view(path, c.process_group, c.replicate_process_group, c.replicate_problem)
        for path, c in named_configs
        if c.replicate_process_group is not None
    ]
    if not views:
        return views
    world = collectives.group_size(world_group())
    for path, c in named_configs:
        if c.replicate_process_group is None and 1 < c.world_size < world:
            problem = (
                f"rank {dist.get_rank()}: instance {path or '<root>'} has no replicate_process_group but shards over "
                f"{c.world_size} of {world} ranks, so its parameters would differ between replicas; pass the same "
                "process_group and replicate_process_group to every instance"
            )
            views.append((path, (), (), 0, problem))
    return views


def check_grid(views_per_rank: Sequence[Sequence[HybridView]], world_size: int) -> None:
    """Every rank's views (gathered over the whole world, in rank order) describe a valid grid, per instance.

    Deterministic in its input, so with the same gathered views every rank raises the same ``ValueError`` (or none).
    """
    problems = [v[4] for views in views_per_rank for v in views if v[4] is not None]
    if problems:
        _raise("; ".join(dict.fromkeys(problems)))
    by_path: Dict[str, Dict[int, HybridView]] = {}
    for rank, views in enumerate(views_per_rank):
        for v in views:
            by_path.setdefault(v[0], {})[rank] = v
    for path, per_rank in by_path.items():
        _check_one(path or "<root>", per_rank, world_size)


def _check_one(path: str, per_rank: Dict[int, HybridView], world_size: int) -> None:
    where = f"instance {path}"
    if sorted(per_rank) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(per_rank))
        _raise(f"{where}: ranks {missing} have no replicate_process_group; the groups must cover the whole world")
    shard_size, replicate_size = len(per_rank[0][1]), len(per_rank[0][2])
    for rank, (_, shard, replicate, _, _) in sorted(per_rank.items()):
        if len(shard) != shard_size or len(replicate) != replicate_size:
            _raise(
                f"{where}: rank {rank} has a {len(shard)}-rank process_group and a {len(replicate)}-rank "
                f"replicate_process_group, rank 0 has {shard_size} and {replicate_size}; all must be equal"
            )
    for rank, (_, shard, replicate, _, _) in sorted(per_rank.items()):
        for other in shard:
            if per_rank[other][1] != shard:
                _raise(
                    f"{where}: rank {rank}'s process_group is {list(shard)} but rank {other}'s is "
                    f"{list(per_rank[other][1])}"
                )
        for other in replicate:
            if per_rank[other][2] != replicate:
                _raise(
                    f"{where}: rank {rank}'s replicate_process_group is {list(replicate)} but rank {other}'s is "
                    f"{list(per_rank[other][2])}"
                )
            if per_rank[other][3] != per_rank[rank][3]:
                _raise(
                    f"{where}: ranks {rank} and {other} are in one replicate group but hold shard "
                    f"{per_rank[rank][3]} and {per_rank[other][3]} of their process_groups; a replicate group must "
                    "join the ranks that hold the same shard (the same local rank on every node)"
                )
    if shard_size * replicate_size != world_size:
        _raise(
            f"{where}: process_group ({shard_size} ranks) x replicate_process_group ({replicate_size} ranks) does not "
            f"tile the world of {world_size} ranks"
        )


def _raise(problem: str) -> None:
    raise ValueError(
        "invalid hybrid sharding groups: " + problem + ". process_group must be this rank's shard group (e.g. its "
        "node) and replicate_process_group the ranks with the same local rank on the other nodes, on every rank "
        "(see fairscale.nn.data_parallel.hybrid_groups)."
    )


def hybrid_groups(
    ranks_per_node: Optional[int] = None, timeout: Optional[datetime.timedelta] = None
) -> Tuple[Any, Any]:
    """Create the shard and replicate groups of hybrid sharding and return this rank's ``(shard, replicate)``.

    Shard groups are consecutive blocks of ``ranks_per_node`` global ranks (one node each, as torchrun numbers
    ranks); replicate group ``i`` holds local rank ``i`` of every node. Pass them as
    ``FullyShardedDataParallel(module, process_group=shard, replicate_process_group=replicate)``.

    Every rank must call this with the same arguments: ``dist.new_group`` is collective over the whole world, and
    every group is created by every rank in the same order here.

    Args:
        ranks_per_node: ranks per shard group; default: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it).
        timeout: collective timeout of the groups; default: the default group's (``init_process_group``'s).

    Returns:
        ``(shard group, replicate group)`` of this rank.

    Raises:
        ValueError: ``ranks_per_node`` is missing (no ``LOCAL_WORLD_SIZE``), not positive, or does not divide the
            world size.
    """
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit():
            raise ValueError(
                "hybrid_groups: pass ranks_per_node, or launch with torchrun (which sets LOCAL_WORLD_SIZE); "
                f"LOCAL_WORLD_SIZE is {local!r}"
            )
        ranks_per_node = int(local)
    world = dist.get_world_size()
    if not isinstance(ranks_per_node, int) or ranks_per_node <= 0 or world % ranks_per_node != 0:
        raise ValueError(f"hybrid_groups: ranks_per_node={ranks_per_node!r} must divide the world size ({world})")
    timeout = timeout if timeout is not None else default_group_timeout()
    me = dist.get_rank()
    nodes = world // ranks_per_node
    blocks: List[List[int]] = [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
    strides: List[List[int]] = [list(range(i, world, ranks_per_node)) for i in range(ranks_per_node)]
    shard = replicate = None
    for ranks in blocks:
        group = new_group_with_timeout(ranks, timeout)
        if me in ranks:
            shard = group
    for ranks in strides:
        group = new_group_with_timeout(ranks, timeout)
        if me in ranks:
            replicate = group
    return shard, replicate
