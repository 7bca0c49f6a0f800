# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which rank owns which parameter, and the views derived from it.

The assignment is upstream's, exactly: checkpoints store the optimizer state by global parameter index, but each
rank's shard numbers its own parameters, so a different assignment would scatter a loaded state onto the wrong
parameters (and change which rank's numerics produce which parameter). One deliberate difference: a parameter keeps
its owner for good. Upstream re-ran the greedy walk over all groups in ``add_param_group`` with the current
``requires_grad`` flags, so after a parameter was frozen or unfrozen some parameters changed owner while the ranks'
optimizers kept their old shares (they were then stepped by nobody); here only the new parameters are placed
(:func:`assign_owners`), which gives upstream's assignment whenever the flags did not change.
"""

from typing import Any, Dict, List

import torch

__all__ = [
    "ParamGroup",
    "partition_param_groups",
    "assign_owners",
    "split_by_owner",
    "per_device_params",
    "param_to_rank",
    "param_to_index",
]

ParamGroup = Dict[str, Any]


def partition_param_groups(param_groups: List[ParamGroup], world_size: int) -> List[List[ParamGroup]]:
    """Assign every parameter to one rank, greedily balancing the number of trainable elements.

    One load counter per rank is shared by all groups. Walking the groups in order, and each group's parameters in
    order, a parameter goes to the rank with the smallest load (ties: lowest rank), which then grows by
    ``numel()`` for a trainable parameter or by one for a frozen one (frozen parameters cost no optimizer state).

    Args:
        param_groups: the optimizer's global parameter groups.
        world_size: number of ranks.

    Returns:
        For each rank, one dict per group: a shallow copy of the group whose ``params`` are the rank's share
        (possibly empty, so that every rank has the same number of groups).
    """
    return split_by_owner(param_groups, world_size, assign_owners(param_groups, world_size, {}))


def _load(param: torch.Tensor) -> int:
    """What a parameter adds to its owner's load: its elements if trainable, else one."""
    return param.numel() if param.requires_grad else 1


def assign_owners(
    param_groups: List[ParamGroup], world_size: int, owners: Dict[torch.Tensor, int]
) -> Dict[torch.Tensor, int]:
    """Keep the owners of the parameters in ``owners``; give the others one with the greedy rule.

    The loads start from the kept assignment, measured with the current ``requires_grad`` flags, then the new
    parameters are placed in group order as in :func:`partition_param_groups`. When the flags did not change since
    the kept assignment was made, the result is what :func:`partition_param_groups` gives for all groups at once
    (the greedy walk over the old parameters replays the same choices); when they did, the old parameters still keep
    their owner: the ranks' optimizers hold their state, and moving them would leave them stepped by nobody.

    The walk only reads lists in order and the flags, which every rank has alike: every rank gets the same owners.

    Args:
        param_groups: the optimizer's global parameter groups.
        world_size: number of ranks.
        owners: ``{param: rank}`` of the parameters already assigned (not modified).

    Returns:
        ``{param: rank}`` for every parameter of ``param_groups``.
    """
    loads = [0] * world_size
    params = [param for group in param_groups for param in group["params"]]
    for param in params:
        if param in owners:
            loads[owners[param]] += _load(param)
    assigned = dict(owners)
    for param in params:
        if param not in assigned:
            rank = loads.index(min(loads))  # index() finds the first minimum: ties go to the lowest rank
            assigned[param] = rank
            loads[rank] += _load(param)
    return assigned


def split_by_owner(
    param_groups: List[ParamGroup], world_size: int, owners: Dict[torch.Tensor, int]
) -> List[List[ParamGroup]]:
    """Each rank's share of every group, parameters in group order.

    Args:
        param_groups: the optimizer's global parameter groups.
        world_size: number of ranks.
        owners: ``{param: rank}`` covering every parameter of ``param_groups``.

    Returns:
        For each rank, one dict per group: a shallow copy of the group whose ``params`` are the rank's share
        (possibly empty, so that every rank has the same number of groups).
    """
    partition: List[List[ParamGroup]] = [[] for _ in range(world_size)]
    for group in param_groups:
        shares: List[List[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in group["params"]:
            shares[owners[param]].append(param)
        for rank, share in enumerate(shares):
            shard_group = dict(group)
            shard_group["params"] = share
            partition[rank].append(shard_group)
    return partition


def per_device_params(param_groups: List[ParamGroup], partition: List[List[ParamGroup]]) -> Dict[Any, List[List[Any]]]:
    """Each device's parameters, per owning rank, sorted by size (ascending, stable).

    Devices are listed in the order they first appear in ``param_groups``. This order is the layout of the
    broadcast buckets and the order ShardedDataParallel walks the parameters in, so it must be the same on every
    rank.
    """
    devices: List[torch.device] = []
    for group in param_groups:
        for param in group["params"]:
            if param.device not in devices:
                devices.append(param.device)
    result: Dict[Any, List[List[Any]]] = {}
    for device in devices:
        per_rank = []
        for rank_groups in partition:
            owned = [p for g in rank_groups for p in g["params"] if p.device == device]
            per_rank.append(sorted(owned, key=lambda p: p.numel()))
        result[device] = per_rank
    return result


def param_to_rank(partition: List[List[ParamGroup]]) -> Dict[torch.Tensor, int]:
    """``{param: owning rank}`` (keyed by the tensors themselves, as upstream)."""
    return {param: rank for rank, groups in enumerate(partition) for group in groups for param in group["params"]}


def param_to_index(param_groups: List[ParamGroup]) -> Dict[int, int]:
    """``{id(param): global index}``, the index being the position in the concatenation of all groups."""
    return {id(param): i for i, param in enumerate(p for group in param_groups for p in group["params"])}
