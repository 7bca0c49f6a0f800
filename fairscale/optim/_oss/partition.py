# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which rank owns which parameter, and the views derived from it.

The assignment is upstream's, exactly: checkpoints store the optimizer state by global parameter index, but each
rank's shard numbers its own parameters, so a different assignment would scatter a loaded state onto the wrong
parameters (and change which rank's numerics produce which parameter).
"""

from typing import Any, Dict, List

import torch

__all__ = ["ParamGroup", "partition_param_groups", "per_device_params", "param_to_rank", "param_to_index"]

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
    loads = [0] * world_size
    partition: List[List[ParamGroup]] = [[] for _ in range(world_size)]
    for group in param_groups:
        shares: List[List[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in group["params"]:
            rank = loads.index(min(loads))  # index() finds the first minimum: ties go to the lowest rank
            shares[rank].append(param)
            loads[rank] += param.numel() if param.requires_grad else 1
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
