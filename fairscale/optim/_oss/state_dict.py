# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS state dicts: gathering the shards, merging them into one torch-format dict, and loading one back.

Formats (upstream's):

* a **shard** is the rank's inner optimizer ``state_dict()``: its parameters numbered 0, 1, ... in the order of
  its partition (one group per OSS group, empty groups included);
* the **consolidated** dict is a plain torch optimizer state dict over all parameters, numbered in the order of the
  OSS groups; a plain torch optimizer over the same parameter order loads it, and OSS loads a plain optimizer's.
"""

import io
import zlib
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from fairscale.internal import collectives
from fairscale.internal.params import recursive_copy_to_device

from .._param_state import check_param_state, laid_out_like
from .partition import ParamGroup

__all__ = [
    "broadcast_object",
    "gather_shards",
    "merge_shards",
    "check_loadable",
    "check_inner_state",
    "shard_for_rank",
    "global_index_map",
]

_CPU = torch.device("cpu")


def broadcast_object(obj: Any, src_rank: int, group: Any = None, dist_device: torch.device = _CPU) -> Any:
    """Broadcast a picklable object as a length tensor then a byte tensor (upstream's ``_broadcast_object``).

    Args:
        obj (Any): the object, read on the source only.
        src_rank (int): the **global** rank that sends.
        group: the process group (``None``: the default group).
        dist_device (torch.device): where the two tensors live (the backend's device).

    Returns:
        Any: the object (the source gets its own input back).
    """
    is_source = (dist.get_rank() if dist.is_initialized() else 0) == src_rank
    if is_source:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(dist_device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=dist_device)
        collectives.broadcast(length, src=src_rank, group=group)
        collectives.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.zeros(1, dtype=torch.long, device=dist_device)
    collectives.broadcast(length, src=src_rank, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dist_device)
    collectives.broadcast(payload, src=src_rank, group=group)
    # The payload is an optimizer state (tensors, numbers, tuples), written by a peer running this same code.
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location=dist_device, weights_only=False)


def _cpu_copy(value: Any) -> Any:
    """A CPU copy of a nested state that later optimizer steps cannot change (``.to(cpu)`` alone aliases CPU
    tensors; a consolidated dict is a snapshot). numpy arrays (AdaScale's statistics) are copied too."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(_CPU, copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        copied = [_cpu_copy(v) for v in value]
        return type(value)(*copied) if hasattr(value, "_fields") else tuple(copied)
    if isinstance(value, Mapping):
        return {k: _cpu_copy(v) for k, v in value.items()}
    return value


def gather_shards(
    local_shard: Dict[str, Any],
    rank: int,
    world_size: int,
    recipient_rank: int,
    local_to_global: Sequence[int],
    transport: Callable[[Any, int], Any],
) -> List[Dict[str, Any]]:
    """Collect every rank's shard on ``recipient_rank`` (or on every rank for ``-1``), in rank order.

    Every rank takes part in every round, each round's owner sending its shard with ``transport(obj, src)``
    (a collective that returns the object on every rank). The round of the recipient itself is skipped: it
    knows its own shard, and every rank knows whose round it is.

    Returns:
        The ``world_size`` shards with CPU tensors where this rank collects, else an empty list.
    """
    collect = rank == recipient_rank or recipient_rank == -1
    shards: List[Dict[str, Any]] = []
    for round_rank in range(world_size):
        if round_rank == rank:
            if collect:
                shards.append(_cpu_copy(local_shard))
            if round_rank != recipient_rank:
                transport(local_shard, local_to_global[round_rank])
        elif round_rank != recipient_rank:
            received = transport(None, local_to_global[round_rank])
            if collect:
                shards.append(recursive_copy_to_device(received, non_blocking=False, device=_CPU))
    return shards


def merge_shards(
    base: Dict[str, Any],
    shards: Sequence[Mapping[str, Any]],
    partition: List[List[ParamGroup]],
    param_to_index: Mapping[int, int],
) -> Dict[str, Any]:
    """Fill ``base`` (OSS's own torch ``state_dict()``) with the shards' per-parameter state, by global index.

    Integer keys come out sorted; other keys of the base state (e.g. a wrapper's ``"adascale"`` entry) follow,
    in their original order (upstream sorted all keys together and raised ``TypeError`` on a string key). They are
    copies, taken now, as the shards' entries are: later steps do not change the result (the AdaScale statistics of
    ``AdaScale(OSS)`` used to be the live ones).
    Top-level entries that the wrapped optimizer adds to its state dict are kept (see :func:`_shard_extras`), so
    that the wrapped optimizer loads the consolidated dict back (upstream dropped them: ``OSS(optim=Adam)`` could
    not reload its own checkpoint).
    """
    extras, factors = _shard_extras(shards)
    # ``base`` is torch's packing of OSS's live state: its entries (a wrapper's "adascale" statistics) are the objects
    # later steps and set_scale() update in place. Copied, so that the result is a snapshot as the shards are.
    state: Dict[Any, Any] = {k: _cpu_copy(v) for k, v in base["state"].items()}
    for rank, shard in enumerate(shards):
        for shard_group, part_group in zip(shard["param_groups"], partition[rank]):
            for local_index, param in zip(shard_group["params"], part_group["params"]):
                if local_index in shard["state"]:
                    state[param_to_index[id(param)]] = _rescaled(shard["state"][local_index], factors[rank])
    int_keys = sorted(k for k in state if isinstance(k, int))
    other_keys = [k for k in state if not isinstance(k, int)]
    result = dict(base)
    result["state"] = {k: state[k] for k in int_keys + other_keys}
    # Tensor hyper-parameters (a tensor ``lr``, which torch's schedulers update in place) are copied too, on their
    # device (torch's loaders expect them there); the other values are numbers, strings and tuples.
    result["param_groups"] = [
        {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items()}
        for group in base["param_groups"]
    ]
    result.update(extras)
    return result


# The entries of torch's state-dict format; any other top-level entry of a shard is the wrapped optimizer's own.
_TORCH_ENTRIES = ("state", "param_groups")
# fairscale.optim.Adam's top-level entry: the factor its fp16 (PURE_FP16) state tensors are stored multiplied by.
_OPTIM_SCALE = "optim_scale"


def _shard_extras(shards: Sequence[Mapping[str, Any]]) -> Tuple[Dict[str, Any], List[float]]:
    """The wrapped optimizer's own top-level entries for the consolidated dict, and a rescaling factor per shard.

    One value per entry has to serve every rank, at any world size. ``optim_scale`` (fairscale's Adam) differs
    between ranks once one rank's fp16 state overflowed: the smallest scale is kept and each shard's non-fp32 state
    is multiplied by ``smallest / its scale`` (a power of two: exact), which is how Adam reads its state. For any
    other entry, the first shard's value is kept.
    """
    extras: Dict[str, Any] = {}
    for shard in shards:
        for key, value in shard.items():
            if key not in _TORCH_ENTRIES and key not in extras:
                extras[key] = value
    factors = [1.0] * len(shards)
    if _OPTIM_SCALE in extras:
        scales = [float(shard[_OPTIM_SCALE]) for shard in shards if _OPTIM_SCALE in shard]
        common = min(scales)
        extras[_OPTIM_SCALE] = common
        factors = [common / float(shard[_OPTIM_SCALE]) if _OPTIM_SCALE in shard else 1.0 for shard in shards]
    return extras, factors


def _rescaled(entry: Any, factor: float) -> Any:
    """A copy of one parameter's state with its scaled (non-fp32 floating) tensors multiplied by ``factor``."""
    if factor == 1.0 or not isinstance(entry, Mapping):
        return entry
    return {k: (v.float().mul(factor).to(v.dtype) if _is_scaled_state(v) else v) for k, v in entry.items()}


def _is_scaled_state(value: Any) -> bool:
    # Adam stores fp32 state as is and any other floating state multiplied by its optim_scale.
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32


def check_loadable(state_dict: Any, param_groups: List[ParamGroup]) -> None:
    """Raise a clear error if ``state_dict`` cannot be loaded into OSS groups ``param_groups``; changes nothing.

    Raises:
        TypeError: not a state-dict mapping, or its ``state`` is not a mapping, its ``param_groups`` not a list of
            mappings, or a group's ``params`` not a list.
        ValueError: missing keys, a different number of groups or of parameters in a group (with a hint when it
            looks like an unconsolidated per-rank shard), unknown parameter indices, or state tensors whose shape
            cannot belong to the parameter (the rule of :mod:`fairscale.optim._param_state`).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"OSS.load_state_dict expects a state dict (a mapping), got {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"OSS.load_state_dict: the state dict has no {missing} entry; pass an optimizer state dict")
    _check_types(state_dict)
    saved_groups = state_dict["param_groups"]
    saved_total = sum(len(g.get("params", ())) for g in saved_groups)
    total = sum(len(g["params"]) for g in param_groups)
    hint = (
        " It looks like one rank's shard rather than a consolidated state dict (a shard only holds the state of the "
        "parameters that rank owned, and ownership depends on the world size): save with "
        "consolidate_state_dict() then state_dict() on the recipient, or state_dict(all_ranks=True)."
        if saved_total < total
        else ""
    )
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"OSS.load_state_dict: the state dict has {len(saved_groups)} parameter groups but this optimizer has "
            f"{len(param_groups)}; create the optimizer with the same groups (add_param_group) before loading.{hint}"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if "params" not in saved or len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"OSS.load_state_dict: parameter group {i} of the state dict has {len(saved.get('params', ()))} "
                f"parameters but this optimizer's has {len(group['params'])}.{hint}"
            )
    index_to_param = global_index_map(saved_groups, param_groups)
    for key, value in state_dict["state"].items():
        if isinstance(key, str) and key.isdigit() and int(key) in index_to_param:
            # A parameter's index as a string (a dict that went through JSON or a converter) was kept as a wrapper's
            # entry, and every parameter's state was dropped, silently (a fuzz of checkpoints, session 45).
            raise ValueError(
                f"OSS.load_state_dict: the state has an entry under the string {key!r}, a parameter index as text "
                "(a state dict that went through JSON or a converter?); per-parameter state is keyed by int index: "
                "convert the keys with int(key) before loading"
            )
        if not isinstance(key, int):
            continue  # state that belongs to no parameter (e.g. a wrapper's), carried as torch does
        if key not in index_to_param:
            raise ValueError(
                f"OSS.load_state_dict: the state has an entry for parameter {key}, which no parameter group lists"
            )
        check_param_state("OSS.load_state_dict", key, value, index_to_param[key])


def _check_types(state_dict: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` unless the containers of ``state_dict`` are those of an optimizer state dict."""
    hint = "pass a state dict written by an optimizer's state_dict()"
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise TypeError(
            f"OSS.load_state_dict: the state dict's 'state' must be a dict of per-parameter states, got "
            f"{type(state).__name__}; {hint}"
        )
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"OSS.load_state_dict: the state dict's 'param_groups' must be a list of parameter groups, got "
            f"{type(groups).__name__}; {hint}"
        )
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise TypeError(
                f"OSS.load_state_dict: parameter group {i} of the state dict must be a dict, got "
                f"{type(group).__name__}; {hint}"
            )
        if "params" in group and not isinstance(group["params"], (list, tuple)):
            raise TypeError(
                f"OSS.load_state_dict: 'params' of parameter group {i} of the state dict must be a list of "
                f"parameter indices, got {type(group['params']).__name__}; {hint}"
            )


def describe_for_agreement(state_dict: Mapping[str, Any], comparable: Callable[[Any], str]) -> List[Any]:
    """What every rank's copy of a state dict to load must share, small enough for one object gather: each group's
    size and hyper-parameters (through ``comparable``). Not the per-parameter state: a load replaces the entries of
    the parameters other ranks own by ``{}`` in the caller's dict, so a dict loaded twice differs between ranks
    there, legitimately (and hashing the state's contents would cost a pass over all of it at every load); state of
    other shapes fails the checks on some rank, which the caller makes an error on every rank.
    ``state_dict`` passed :func:`check_loadable`."""
    # One entry per value, so that the error names the first group and key that differ.
    return [
        entry
        for i, g in enumerate(state_dict["param_groups"])
        for entry in [(f"group {i}", "number of parameters", len(g.get("params", ())))]
        + sorted((f"group {i}", str(k), comparable(v)) for k, v in g.items() if k != "params")
    ]


def state_digests(state_dict: Mapping[str, Any]) -> Dict[Any, Optional[int]]:
    """A cheap checksum of each parameter's state in ``state_dict["state"]`` (``None`` for an entry an earlier load
    of the same dict replaced by ``{}``), to compare across ranks: see :func:`disagreeing_state`.

    The checksum covers each entry's names, non-tensor values and tensors' dtypes and shapes, and the first and last
    element of each tensor (read in one transfer per device: no pass over the values, no sync per tensor). That tells
    another step's checkpoint or an emptied state apart; two checkpoints of the same step with equal ends are not.
    ``state_dict`` passed :func:`check_loadable`.
    """
    entries = state_dict["state"]
    described: Dict[Any, List[Any]] = {}
    ends: Dict[torch.device, List[Tuple[Any, torch.Tensor]]] = {}
    for key, entry in entries.items():
        if not isinstance(entry, Mapping) or not entry:
            described[key] = [] if isinstance(entry, Mapping) else [repr(type(entry))]
            continue
        parts: List[Any] = []
        for name in sorted(entry, key=str):
            value = entry[name]
            if isinstance(value, torch.Tensor):
                parts.append((str(name), str(value.dtype), tuple(value.shape)))
                if value.numel() > 0 and not value.is_complex():
                    flat = value.detach().reshape(-1)
                    ends.setdefault(value.device, []).append((key, torch.stack([flat[0], flat[-1]]).double()))
            else:
                parts.append((str(name), _plain(value)))
        described[key] = parts
    for pairs in ends.values():
        values = torch.cat([pair for _, pair in pairs]).tolist()
        for i, (key, _) in enumerate(pairs):
            described[key].append(tuple(values[2 * i : 2 * i + 2]))
    return {
        key: None if parts == [] and isinstance(entries[key], Mapping) else zlib.crc32(repr(parts).encode())
        for key, parts in described.items()
    }


def _plain(value: Any) -> str:
    """A value of a state entry as every rank writes it: numbers, strings and ``None`` themselves, anything else by
    its type only (a default ``repr`` holds the object's address; a list of tensors names each rank's device)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__qualname__


def disagreeing_state(gathered: List[Dict[Any, Optional[int]]]) -> Optional[Tuple[Any, List[str]]]:
    """The first parameter whose state the ranks' dicts (their :func:`state_digests`) hold differently, with what
    each rank holds; ``None`` if they agree. A ``None`` digest (replaced by an earlier load) matches anything."""
    keys = sorted({key for digests in gathered for key in digests}, key=str)
    for key in keys:
        seen = {digests.get(key, -1) for digests in gathered} - {None}
        if len(seen) > 1:
            return key, [
                "none" if d.get(key, -1) == -1 else format(d[key], "08x") if d[key] is not None else "any"
                for d in gathered
            ]
    return None


class _InnerState(NamedTuple):
    """What one optimizer class keeps per parameter and needs in each parameter group."""

    used: FrozenSet[str]  # every per-parameter state name the class reads or writes
    required: Tuple[str, ...]  # names a non-empty per-parameter state must hold (its step reads them unguarded)
    group_keys: Tuple[str, ...]  # hyper-parameters every group must hold (its step reads them unguarded)


def _known_inner_states() -> Dict[type, _InnerState]:
    """The optimizer classes whose state names are known, with the names every PyTorch release used."""
    from ..adam import Adam as FairscaleAdam  # here: fairscale.optim imports this module before adam

    adam = _InnerState(
        frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
        ("step", "exp_avg", "exp_avg_sq"),
        ("lr", "betas", "eps", "weight_decay"),
    )
    return {
        torch.optim.SGD: _InnerState(
            frozenset({"momentum_buffer"}), (), ("lr", "momentum", "dampening", "weight_decay", "nesterov")
        ),
        torch.optim.Adam: adam,
        torch.optim.AdamW: adam,
        # Its own loader checks the required names and the groups (OSS runs it on every parameter too).
        FairscaleAdam: _InnerState(frozenset({"step", "exp_avg", "exp_avg_sq"}), (), ()),
    }


def check_inner_state(state_dict: Mapping[str, Any], optim_type: type) -> None:
    """Raise a clear ``ValueError`` unless ``state_dict`` holds state of the wrapped optimizer's class.

    Only for the classes whose state names are known (exactly ``torch.optim.SGD``, ``Adam``, ``AdamW`` and
    ``fairscale.optim.Adam``; subclasses and other optimizers may keep other names): every parameter's state may
    only hold names the class uses, a non-empty state must hold those its step reads (Adam: ``step``, ``exp_avg``,
    ``exp_avg_sq``, and ``max_exp_avg_sq`` in a group with ``amsgrad``), and every group must hold the
    hyper-parameters its step reads. Such a dict of another optimizer used to fail deep inside torch's loader after
    part of it was loaded, or to be accepted and its state ignored. ``state_dict`` passed :func:`check_loadable`.

    Args:
        state_dict: the state dict to load.
        optim_type: the class of the wrapped optimizer.
    """
    known: Optional[_InnerState] = _known_inner_states().get(optim_type)
    if known is None:
        return
    name = f"{optim_type.__module__}.{optim_type.__qualname__}"
    advice = f"load a state dict written by {optim_type.__name__} (the class passed as `optim=`)"
    stepped = {
        key: entry
        for key, entry in state_dict["state"].items()
        # Not a wrapper's entry, nor a parameter that never stepped (check_loadable checked the entries' type).
        if isinstance(key, int) and isinstance(entry, Mapping) and entry
    }
    # Foreign names first: they tell best where the dict comes from.
    for key, entry in stepped.items():
        unused = sorted(str(k) for k in entry if k not in known.used)
        if unused:
            raise ValueError(
                f"OSS.load_state_dict: the state of parameter {key} holds {unused}, which {name} does not use (it "
                f"keeps {sorted(known.used)}); the state dict was written by another optimizer: {advice}"
            )
    amsgrad_ids = set()
    for i, group in enumerate(state_dict["param_groups"]):
        missing = [k for k in known.group_keys if k not in group]
        if missing:
            raise ValueError(
                f"OSS.load_state_dict: parameter group {i} of the state dict has no {missing}, which {name} reads at "
                f"every step; the state dict was written by another optimizer or edited: {advice}"
            )
        if group.get("amsgrad", False):
            amsgrad_ids.update(group["params"])
    for key, entry in stepped.items():
        required = known.required + (("max_exp_avg_sq",) if key in amsgrad_ids and known.required else ())
        missing = [k for k in required if k not in entry]
        if missing:
            raise ValueError(
                f"OSS.load_state_dict: the state of parameter {key} has no {missing}; a stepped parameter's state of "
                f"{name} holds {list(required)}: {advice}"
            )


def global_index_map(saved_groups: Sequence[Mapping[str, Any]], param_groups: List[ParamGroup]) -> Dict[Any, Any]:
    """``{saved parameter id: current parameter}``, positional over the groups (as torch pairs them)."""
    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    params = [p for g in param_groups for p in g["params"]]
    return dict(zip(saved_ids, params))


def shard_for_rank(
    state_dict: Mapping[str, Any],
    rank_groups: List[ParamGroup],
    param_to_index: Mapping[int, int],
    saved_ids: Sequence[Any],
) -> Dict[str, Any]:
    """The shard-format state dict of one rank, cut out of a consolidated one (hyper-parameters from the latter).

    Args:
        state_dict: a consolidated (or plain torch) optimizer state dict, already checked.
        rank_groups: the rank's partition (one group per OSS group).
        param_to_index: ``{id(param): global position}`` of the current parameters.
        saved_ids: the state dict's parameter ids, in global position order.
    """
    saved_groups = state_dict["param_groups"]
    state: Dict[int, Any] = {}
    groups: List[Dict[str, Any]] = []
    # The wrapped optimizer's own entries (Adam's optim_scale) go to every shard: each rank's optimizer needs them.
    extras = {k: v for k, v in state_dict.items() if k not in _TORCH_ENTRIES}
    local_index = 0
    for saved_group, part_group in zip(saved_groups, rank_groups):
        group = {k: v for k, v in saved_group.items() if k != "params"}
        group["params"] = []
        for param in part_group["params"]:
            saved_id = saved_ids[param_to_index[id(param)]]
            if saved_id in state_dict["state"]:
                state[local_index] = laid_out_like(state_dict["state"][saved_id], param)
            group["params"].append(local_index)
            local_index += 1
        groups.append(group)
    return {"state": state, "param_groups": groups, **extras}
