# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The full optimizer state dict's format: checks and the flattening back to one entry per flat parameter.

The format is described in :mod:`fairscale.nn.data_parallel.fsdp_optim_utils` (upstream's public module, which
re-exports these functions). No communication, no model.
"""

import copy
from typing import Any, Dict, List, Mapping, Optional, Set

import torch
from torch import Tensor

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
    return flatten_for_model(sd, None)


def flatten_for_model(sd: Mapping[str, Any], scalar_gids: Optional[Set[int]]) -> Dict[str, Any]:
    """:func:`flatten_optim_state_dict` knowing which global ids are 0-dim parameters (``None``: unknown)."""
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
        scalars = None if scalar_gids is None else [g in scalar_gids for g in gids if g in state]
        new_state[local] = _merge_entries(local, entries, scalars)
    groups = []
    for group in sd["param_groups"]:
        new_group = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        new_group["params"] = list(range(param_id_runs(param_id_map)))
        groups.append(new_group)
    out: Dict[str, Any] = {"state": new_state, "param_groups": groups}
    out.update({k: v for k, v in sd.items() if k not in _FORMAT_KEYS})
    return out


def _merge_entries(
    local: int, entries: List[Mapping[str, Any]], scalar_params: Optional[List[bool]] = None
) -> Dict[str, Any]:
    """One flat parameter's state from its parameters' entries: per-element state concatenated, the rest copied.

    ``scalar_params`` says which of the entries' parameters are 0-dim, where the model is known; ``None`` reads the
    format alone (see :func:`_is_per_element`). Every value is a copy: the caller's dict is never shared.
    """
    merged: Dict[str, Any] = {}
    for key, first in entries[0].items():
        values = [e.get(key) for e in entries]
        if _is_per_element(key, values, scalar_params):
            if any(not isinstance(v, Tensor) for v in values):
                raise ValueError(f"flat parameter {local}: state {key!r} is a tensor for some parameters only")
            merged[key] = torch.cat([e[key].reshape(-1) for e in entries])
        else:
            # A copy: torch's load_state_dict keeps tensors such as a tensor ``step`` by identity and increments
            # them in place, which changed the caller's full dict (a second resharding of it resumed later steps).
            merged[key] = first.detach().clone() if isinstance(first, Tensor) else copy.deepcopy(first)
    return merged


def _is_per_element(key: str, values: List[Any], scalar_params: Optional[List[bool]]) -> bool:
    """Whether a state key holds one element per parameter element (``exp_avg``) rather than a shared value.

    Per-element state has each parameter's shape; shared values are numbers (``step``), per-rank lists of 0-dim
    tensors, or 0-dim tensors. A 0-dim parameter's per-element state is 0-dim too, so a 0-dim tensor other than
    ``step`` is per-element where its parameter is 0-dim (a CLIP-style ``logit_scale``): deciding from the first
    entry alone kept one element for the whole flat parameter, and deciding from the other entries' dimensions
    failed where every parameter of the flat parameter is 0-dim (``logit_scale`` and ``logit_bias`` alone).
    Without the model (``scalar_params`` None), every parameter whose values are all 0-dim is taken for 0-dim: the
    gathered format writes shared 0-dim state as per-rank lists, never as bare 0-dim tensors.
    """
    if any(isinstance(v, Tensor) and v.dim() > 0 for v in values):
        return True
    if key == "step" or not values or not all(isinstance(v, Tensor) for v in values):
        return False
    return scalar_params is None or all(scalar_params)


# ------------------------------------------------------------------------------------------------ upstream's builder
