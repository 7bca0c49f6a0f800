# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Format helpers for FSDP's full optimizer state dict (upstream's public path; no communication, no model).

:meth:`FullyShardedDataParallel.gather_full_optim_state_dict` returns, on rank 0::

    {"state": {global_id: {"step": float, "exp_avg": Tensor[orig shape], ...}, ...},
     "param_groups": [{<hyper-parameters>, "params": [0, 1, ..., n_global - 1]}],
     "param_id_map": {global_id: local_id, ...},
     "uncollected_local_ids": [local_id, ...],
     ... other top-level keys of the optimizer's state dict ...}

*Global ids* number the original (unflattened) parameters, FSDP instance by instance in module pre-order and,
inside an instance, in flattening order. *Local ids* number the flat parameters (one per non-empty instance), as
the sharded optimizer sees them. Per-rank 0-dim tensor state (other than ``step``) is a list with one 0-dim tensor
per rank. ``uncollected_local_ids`` are instances built with ``no_broadcast_optim_state=True``: their entries are
rank 0's own state, split per original parameter (on a group of one rank; on a larger group rank 0's flat shard,
under the instance's first global id).

The functions here turn that dict back into the per-flat-parameter form; cutting each rank's shard out of it is
done by :meth:`FullyShardedDataParallel.get_shard_from_optim_state_dict`.
"""

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper as FlattenParamsWrapper  # upstream name

from ._fsdp.optim_format import check_param_counts_before_sharding as check_param_counts_before_sharding
from ._fsdp.optim_format import flatten_optim_state_dict as flatten_optim_state_dict
from ._fsdp.optim_format import is_singleton_tensor as is_singleton_tensor
from ._fsdp.optim_format import param_id_runs as param_id_runs

__all__ = [
    "build_unflat_state_dict",
    "check_param_counts_before_sharding",
    "flatten_optim_state_dict",
    "is_singleton_tensor",
    "param_id_runs",
]


def build_unflat_state_dict(
    instance_list: List[Any],
    world_pad_info: List[List[List[int]]],
    state: Dict[int, Dict[str, List[Tensor]]],
    singleton_state: Dict[int, Dict[str, List[Tensor]]],
    uncollected_opt_state: Dict[int, Dict[str, Any]],
    original_sd: Dict[str, Any],
) -> Dict[str, Any]:
    """Turn per-rank flat optimizer state into the full, per-original-parameter format (upstream's helper).

    :meth:`FullyShardedDataParallel.gather_full_optim_state_dict` returns the same format; this function is the
    last step of that gather in upstream's code, kept for callers that gather the state themselves. It does no
    communication. Local id ``k`` is ``instance_list[k]`` (upstream passes ``get_fsdp_instances(root,
    skip_empty=True)``); each instance must hold one flat parameter (``flatten_parameters=True``).

    Args:
        instance_list (List[FullyShardedDataParallel]): the instances, in local-id order.
        world_pad_info (List[List[List[int]]]): ``[rank][local id]`` -> ``[padding]``: how many trailing elements
            of that rank's shard are padding.
        state (Dict[int, Dict[str, List[Tensor]]]): ``{local id: {key: [shard of rank 0, shard of rank 1, ...]}}``.
        singleton_state (Dict[int, Dict[str, List[Tensor]]]): ``{local id: {key: [0-dim tensor per rank]}}``; as
            upstream, these go to the entry of the instance's *last* parameter.
        uncollected_opt_state (Dict[int, Dict[str, Any]]): ``{local id: flat state}`` of instances whose state was
            not gathered (rank 0's, full size); as upstream, its tensors are split like gathered ones, its 0-dim
            tensors go (as one-element lists) to the instance's last parameter, and other values are dropped.
        original_sd (Dict[str, Any]): the optimizer's ``state_dict()``; updated in place and returned, as upstream.

    Returns:
        Dict[str, Any]: ``original_sd`` with ``state`` keyed by global id, ``param_groups[0]["params"]`` listing
        every global id, ``param_id_map`` (global id -> local id, ``None`` for parameters without state) and
        ``uncollected_local_ids``.
    """
    both = sorted(set(state) & set(uncollected_opt_state))
    if both:
        raise FairscaleValueError(f"build_unflat_state_dict: local ids {both} are both gathered and uncollected")
    if len(original_sd.get("param_groups", [])) != 1:
        raise NotImplementedError("build_unflat_state_dict supports optimizers with exactly one param group")
    unflat: Dict[int, Dict[str, Any]] = {}
    param_id_map: Dict[int, Optional[int]] = {}
    first_gid = 0
    for local, instance in enumerate(instance_list):
        shapes, numels = _flat_param_layout(instance, local)
        gids = list(range(first_gid, first_gid + len(shapes)))
        first_gid += len(shapes)
        has_state = local in state or local in uncollected_opt_state
        param_id_map.update({g: local if has_state else None for g in gids})
        if not has_state:
            continue
        entries: Dict[int, Dict[str, Any]] = {g: {} for g in gids}
        singles: Dict[str, Any] = dict(singleton_state.get(local, {}))
        if local in state:
            for key, per_rank in state[local].items():
                pads = [rank_info[local][0] for rank_info in world_pad_info]
                unpadded = [t.reshape(-1)[: t.numel() - pad] for t, pad in zip(per_rank, pads)]
                _split_into(entries, key, torch.cat(unpadded), shapes, numels, local)
        else:
            for key, value in uncollected_opt_state[local].items():
                if is_singleton_tensor(value):
                    singles[key] = [value]
                elif torch.is_tensor(value):
                    _split_into(entries, key, value.reshape(-1), shapes, numels, local)
        entries[gids[-1]].update(singles)
        unflat.update(entries)
    original_sd["state"] = unflat
    original_sd["param_groups"][0]["params"] = list(range(first_gid))
    original_sd["param_id_map"] = param_id_map
    original_sd["uncollected_local_ids"] = sorted(uncollected_opt_state)
    return original_sd


def _flat_param_layout(instance: Any, local: int) -> Any:
    """``(shapes, numels)`` of the original parameters in the instance's one flat parameter."""
    fpw = getattr(instance, "_fsdp_wrapped_module", None)
    if not getattr(instance, "flatten_parameters", False) or not isinstance(fpw, FlattenParamsWrapper):
        raise NotImplementedError(f"build_unflat_state_dict: instance {local} needs flatten_parameters=True")
    if len(fpw.flat_params) != 1:
        raise NotImplementedError(f"build_unflat_state_dict: instance {local} has {len(fpw.flat_params)} flat params")
    _, shapes, numels = fpw.metadata(0)
    return list(shapes), list(numels)


def _split_into(
    entries: Dict[int, Dict[str, Any]], key: str, flat: Tensor, shapes: List[Any], numels: List[int], local: int
) -> None:
    if flat.numel() != sum(numels):
        raise FairscaleValueError(
            f"build_unflat_state_dict: state {key!r} of local id {local} has {flat.numel()} elements once unpadded "
            f"but the instance's parameters have {sum(numels)}; check world_pad_info and the per-rank shards"
        )
    for gid, piece, shape in zip(entries, torch.split(flat, numels), shapes):
        entries[gid][key] = piece.view(shape)
