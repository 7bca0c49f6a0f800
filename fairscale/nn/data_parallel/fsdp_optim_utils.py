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
per rank. ``uncollected_local_ids`` are instances built with ``no_broadcast_optim_state=True``: their entry is rank
0's flat state, under the instance's first global id.

The functions here turn that dict back into the per-flat-parameter form; cutting each rank's shard out of it is
done by :meth:`FullyShardedDataParallel.get_shard_from_optim_state_dict`.
"""

import copy
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper as FlattenParamsWrapper  # upstream name

__all__ = [
    "build_unflat_state_dict",
    "check_param_counts_before_sharding",
    "flatten_optim_state_dict",
    "is_singleton_tensor",
    "param_id_runs",
]

_FORMAT_KEYS = ("state", "param_groups", "param_id_map", "uncollected_local_ids")


def is_singleton_tensor(x: Any) -> bool:
    """Whether ``x`` is a 0-dim tensor (per-parameter scalar state such as a tensor ``step``)."""
    return torch.is_tensor(x) and x.dim() == 0


def param_id_runs(param_id_map: Mapping[Any, Optional[int]]) -> int:
    """Number of runs of equal consecutive local ids in ``param_id_map``, read in global-id order.

    With one flat parameter per instance this is the number of flat parameters, i.e. the length of the sharded
    optimizer's ``params`` list.
    """
    runs = 0
    previous: Any = object()
    for gid in sorted(param_id_map, key=int):
        local = param_id_map[gid]
        if local != previous:
            runs += 1
            previous = local
    return runs


def check_param_counts_before_sharding(full_optim_state_dict: Mapping[str, Any], n_instances: int) -> None:
    """Check that a full optimizer state dict has one local id per non-empty FSDP instance of the model.

    Args:
        full_optim_state_dict: a :meth:`gather_full_optim_state_dict` result.
        n_instances: the number of FSDP instances that own parameters in the model to load it into.

    Raises:
        ValueError: the counts differ (the dict was saved from another model or wrapping), unless the dict has
            no state at all.
    """
    if not full_optim_state_dict.get("state"):
        return
    local_ids = set(v for v in full_optim_state_dict["param_id_map"].values() if v is not None)
    too_many = max(local_ids, default=-1) >= n_instances or len(local_ids) > n_instances
    unknown = any(v is None for v in full_optim_state_dict["param_id_map"].values())
    if too_many or (not unknown and len(local_ids) != n_instances):
        raise ValueError(
            f"the optimizer state dict has {len(local_ids)} flat parameters (local ids {sorted(local_ids)}) but the "
            f"model has {n_instances} FSDP instances with parameters; was it saved from a model wrapped differently?"
        )


def flatten_optim_state_dict(sd: Mapping[str, Any]) -> Dict[str, Any]:
    """Regroup a full optimizer state dict by flat parameter (local id), unsharded.

    For each local id, every tensor state of its global ids is flattened and concatenated in global-id order (the
    flat parameter's layout, without padding); 0-dim tensors, per-rank lists and other values (``step``) are taken
    once. ``param_groups[*]["params"]`` becomes ``range(number of local ids)``; ``param_id_map`` and
    ``uncollected_local_ids`` are dropped; other top-level keys are kept. ``sd`` itself is not modified.

    Args:
        sd: a :meth:`gather_full_optim_state_dict` result. ``param_id_map`` values must be local ids (``None``
            entries, which carry no state, are skipped).

    Returns:
        ``{"state": {local_id: {...}}, "param_groups": [...], ...}``, loadable after sharding.

    Raises:
        ValueError: some parameters of a flat parameter have state and others do not, or a tensor state is
            missing for one of them.
    """
    param_id_map = {int(g): v for g, v in sd["param_id_map"].items()}
    uncollected = set(sd.get("uncollected_local_ids", []))
    state = {int(g): v for g, v in sd["state"].items()}
    by_local: Dict[int, List[int]] = {}
    for gid in sorted(param_id_map):
        local = param_id_map[gid]
        if local is not None:
            by_local.setdefault(int(local), []).append(gid)
    new_state: Dict[int, Dict[str, Any]] = {}
    for local, gids in by_local.items():
        entries = [state[g] for g in gids if g in state]
        if not entries:
            continue  # an unused flat parameter: no optimizer state
        if len(entries) != len(gids) and local not in uncollected:
            missing = [g for g in gids if g not in state]
            raise ValueError(
                f"flat parameter {local}: global ids {missing} have no optimizer state while the others of the same "
                "flat parameter do; the state dict is incomplete"
            )
        new_state[local] = _merge_entries(local, entries)
    groups = []
    for group in sd["param_groups"]:
        new_group = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        new_group["params"] = list(range(param_id_runs(param_id_map)))
        groups.append(new_group)
    out: Dict[str, Any] = {"state": new_state, "param_groups": groups}
    out.update({k: v for k, v in sd.items() if k not in _FORMAT_KEYS})
    return out


def _merge_entries(local: int, entries: List[Mapping[str, Any]]) -> Dict[str, Any]:
    merged: Dict[str, Any] = {}
    for key, first in entries[0].items():
        if isinstance(first, Tensor) and first.dim() > 0:
            if any(not isinstance(e.get(key), Tensor) for e in entries):
                raise ValueError(f"flat parameter {local}: state {key!r} is a tensor for some parameters only")
            merged[key] = torch.cat([e[key].reshape(-1) for e in entries])
        else:
            merged[key] = first
    return merged


# ------------------------------------------------------------------------------------------------ upstream's builder


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
