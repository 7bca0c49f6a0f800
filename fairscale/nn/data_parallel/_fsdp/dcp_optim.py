# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP state dicts of torch optimizers over the flat parameters of an FSDP model.

See :mod:`fairscale.nn.data_parallel.dcp` for the user's view and :mod:`.dcp_state` for the layout. Saving turns
each flat parameter's optimizer state into one entry per original parameter (per-parameter states as DTensor
chunks, scalar ones such as ``step`` copied into every entry). Loading plans each optimizer's new flat state from
those entries without touching anything (:func:`_plan_optim_load`); once the ranks agreed
(:func:`.dcp_state.set_state_dict`), :func:`_build_flat` builds it (in the current state tensors when they fit)
for ``optimizer.load_state_dict``.
"""

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.agreement import check_ranks_agree
from fairscale.internal.hyper_parameters import checked_hyper_parameters

from .dcp_dtensor import (
    _DTENSOR_ERROR,
    COPIES,
    Value,
    _classify,
    _effective_values,
    _initialized_tree,
    _Meshes,
    _require_dtensor,
    _value_lists,
    check_root,
)
from .dcp_layout import HandleLayout, ModelLayout, model_layout
from .dcp_reshard import chunks_to_flat
from .dcp_views import dtype_of, shape_of
from .unit import FSDPUnit

if _DTENSOR_ERROR is None:  # guarded once, in .dcp_dtensor; older torch leaves DTensor unbound, each use checks first
    from .dcp_dtensor import DTensor

__all__ = ["as_optimizers", "init_optim_state", "get_optimizer_state_dict"]


def as_optimizers(optimizers: Any, what: str) -> Tuple[torch.optim.Optimizer, ...]:
    """``optimizers`` (one optimizer or an iterable of them) as a tuple."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    try:
        out = tuple(optimizers)
    except TypeError:
        raise TypeError(
            f"{what}: optimizers must be a torch.optim.Optimizer or an iterable of them, got {type(optimizers).__name__}"
        ) from None
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"{what}: optimizers must be torch.optim.Optimizer instances, got {type(o).__name__}")
    return out


def _optimizer_handles(optim: torch.optim.Optimizer, layout: ModelLayout, what: str, k: int) -> List[HandleLayout]:
    """The handle of every parameter of ``optim``, in its ``state_dict()`` numbering (groups in order)."""
    by_param = {id(hl.handle.param): hl for hl in layout.handles}
    out: List[HandleLayout] = []
    for group in optim.param_groups:
        for param in group["params"]:
            hl = by_param.get(id(param))
            if hl is None:
                raise ValueError(
                    f"{what}: optimizer {k} holds a parameter of shape {tuple(param.shape)} that is not a parameter of "
                    "this FSDP model; build the optimizer on model.parameters() after wrapping"
                )
            out.append(hl)
    return out


@torch.no_grad()
def init_optim_state(optim: torch.optim.Optimizer) -> bool:
    """Create the optimizer's state with one step of zero gradients at learning rate 0 (parameters unchanged).

    Does nothing when the optimizer already has state or some parameter has a gradient (as
    ``torch.distributed.checkpoint.state_dict`` does: a fresh optimizer needs its state to exist for ``dcp.load``
    to fill it).

    Returns:
        Whether the state was created here.
    """
    if optim.state:
        return False
    params = [p for group in optim.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return False
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group in optim.param_groups:
            if "lr" in group:
                group["lr"] = lrs.pop(0)
        optim.zero_grad(set_to_none=True)
    return True


def _schema(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("value", type(value).__name__)


def get_optimizer_state_dict(
    unit: FSDPUnit,
    optimizers: Sequence[torch.optim.Optimizer],
    cpu_offload: bool,
    ignore_frozen_params: bool,
    values: str = COPIES,
    create_state: bool = True,
    what: str = "get_optimizer_state_dict",
) -> Dict[str, Any]:
    """See :func:`fairscale.nn.data_parallel.dcp.get_optimizer_state_dict` (``values``, ``what``: as for the model).

    ``create_state=False`` (``save``): an optimizer without state contributes its ``param_groups`` only. Creating it
    takes a step, which a checkpoint does not need: at learning rate 0 it still wrote the parameters in place (a
    save between a forward and its backward made that backward fail) and it set Adam's step counter to 1 with zero
    moments (every later update had another bias correction than without the save).
    """
    values = _effective_values(values)
    _require_dtensor(what)
    check_root(unit, what)
    unit.assert_idle_tree(f"{what}()")
    state_out: Dict[str, Any] = {}
    groups_out: List[Dict[str, Any]] = []
    with _initialized_tree(unit):
        layout = model_layout(unit, what)
        meshes = _Meshes(layout)
        for k, optim in enumerate(optimizers):
            hls = _optimizer_handles(optim, layout, what, k)
            if create_state:
                init_optim_state(optim)
            osd = optim.state_dict()
            state = {int(i): entry for i, entry in osd["state"].items()}
            schema = {i: sorted((str(key), _schema(v)) for key, v in entry.items()) for i, entry in state.items()}
            with unit.device.as_current():
                check_ranks_agree(
                    f"{what}: the state of optimizer {k} (parameters, keys, shapes)",
                    schema,
                    layout.agree_group,  # with hybrid sharding, the replicas too: DCP writes one replica's chunks
                    hint="Every rank must step the same optimizer on the same model.",
                )
            kept = [i for i in sorted(state) if not (ignore_frozen_params and not hls[i].handle.param.requires_grad)]
            per_param = {i: _unflatten_entry(hls[i], state[i], cpu_offload, what) for i in kept}
            jobs = [(i, key) for i in kept for key in sorted(state[i], key=str) if key in per_param[i][1]]
            items = [(hls[i], state[i][key], per_param[i][1][key]) for i, key in jobs]
            with collectives.collective_phase("dcp_optim_state_dict"):
                value_lists = _value_lists(items, values, meshes)
            for (i, key), hl_values in zip(jobs, value_lists):
                for d, value in zip(per_param[i][0], hl_values):
                    d[key] = value
            for i in kept:
                order = list(state[i])  # the optimizer's own key order in every entry
                for p, d in zip(hls[i].params, per_param[i][0]):
                    state_out[p.fqn] = {key: d[key] for key in order}
            for group in osd["param_groups"]:
                new = {key: copy.deepcopy(v) for key, v in group.items() if key not in ("params", "param_names")}
                # Every name, frozen ones too, as torch's get_optimizer_state_dict keeps them with
                # ignore_frozen_params (it drops their state only): without them this very model's load refused the
                # dict, "no saved parameter group holds ..." (a fuzz of DCP, session 45).
                new["params"] = [p.fqn for i in group["params"] for p in hls[i].params]
                groups_out.append(new)
    return {"state": state_out, "param_groups": groups_out}


def _unflatten_entry(
    hl: HandleLayout, entry: Mapping[str, Any], cpu_offload: bool, what: str
) -> Tuple[List[Dict[str, Any]], Dict[str, torch.device]]:
    """One flat parameter's optimizer state as one entry per original parameter, without its per-parameter
    (element-wise) states, and those states' keys with the device their chunks go to."""
    shard = hl.handle.fp32_shard
    assert shard is not None
    out: List[Dict[str, Any]] = [{} for _ in hl.params]
    sharded: Dict[str, torch.device] = {}
    for key in sorted(entry, key=str):
        value = entry[key]
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape == shard.shape:
            sharded[key] = torch.device("cpu") if cpu_offload else value.device
        elif isinstance(value, Tensor) and value.dim() == 0:
            for d in out:
                d[key] = value.detach().to(device=torch.device("cpu") if cpu_offload else value.device, copy=True)
        elif isinstance(value, Tensor):
            raise NotImplementedError(
                f"{what}: optimizer state {key!r} of {hl.params[0].fqn!r}... has shape {tuple(value.shape)}, neither "
                f"the shard's {tuple(shard.shape)} nor a scalar; only element-wise optimizer states (Adam, SGD, ...) "
                "can be resharded"
            )
        else:
            for d in out:
                d[key] = copy.deepcopy(value)
    return out, sharded


@dataclass
class _OptimPlan:
    """What one optimizer's new flat state dict is made of."""

    optim: torch.optim.Optimizer
    hls: List[HandleLayout]
    groups: List[Dict[str, Any]]
    # per flat index: key -> ("param", per-parameter values) or ("scalar", value)
    entries: Dict[int, Dict[str, Tuple[str, Any]]] = field(default_factory=dict)

    def signature(self) -> Any:
        out: List[Any] = []
        for i in sorted(self.entries):
            keys = []
            for key, (kind, v) in sorted(self.entries[i].items()):
                keys.append((key, kind, [None if x is None else x[0] for x in v] if kind == "param" else None))
            out.append((i, keys))
        return out

    def hyper_parameters(self, k: int) -> List[Tuple[str, str]]:
        """The hyper-parameters this rank will load, one entry each (so that a difference names its key): ranks
        given another lr would train their shards at other rates."""
        return [
            (f"optimizer {k}, param group {gi}, {key}", _comparable(value))
            for gi, group in enumerate(self.groups)
            for key, value in sorted(group.items(), key=lambda kv: str(kv[0]))
            if key != "params"
        ]


def _comparable(value: Any) -> str:
    """A hyper-parameter as two ranks can compare it: exact for small tensors (whose repr rounds)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r})" if value.numel() <= 16 else f"tensor{tuple(value.shape)}"
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x...", repr(value))  # an object's address differs between ranks


def _is_flattened_osd(osd: Mapping[str, Any]) -> bool:
    return bool(osd) and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in osd)


def _plan_optim_load(
    layout: ModelLayout, optimizers: Sequence[torch.optim.Optimizer], osd: Mapping[str, Any], what: str
) -> List[_OptimPlan]:
    if not isinstance(osd, Mapping):
        raise TypeError(f"{what}: optim_state_dict must be a dict, got {type(osd).__name__}")
    if _is_flattened_osd(osd):
        raise NotImplementedError(
            f"{what}: flattened optimizer state dicts (StateDictOptions(flatten_optimizer_state_dict=True)) are not "
            "supported; save the optimizer state dict unflattened ('state' and 'param_groups')"
        )
    if "state" not in osd or "param_groups" not in osd:
        raise ValueError(
            f"{what}: an optimizer state dict has 'state' and 'param_groups'; got keys {sorted(map(str, osd))}"
        )
    state, loaded_groups = osd["state"], list(osd["param_groups"])
    plans: List[_OptimPlan] = []
    for k, optim in enumerate(optimizers):
        hls = _optimizer_handles(optim, layout, what, k)
        live = optim.state_dict()
        plan = _OptimPlan(optim, hls, [])
        for gi, group in enumerate(live["param_groups"]):
            fqns = [p.fqn for i in group["params"] for p in hls[i].params]
            plan.groups.append(_matching_group(fqns, loaded_groups, group, what, k, gi))
        for i, hl in enumerate(hls):
            entry = _plan_entry(hl, state, layout, what)
            if entry is not None:
                plan.entries[i] = entry
        plans.append(plan)
    return plans


def _matching_group(
    fqns: List[str], loaded_groups: List[Any], live: Mapping[str, Any], what: str, k: int, gi: int
) -> Dict[str, Any]:
    """The loaded group that holds this group's parameters, with this optimizer's parameter ids."""
    wanted = set(fqns)
    for loaded in loaded_groups:
        params = set(loaded.get("params", []))
        if (fqns and fqns[0] in params) or (not fqns and not params):
            if not wanted <= params:
                missing = sorted(wanted - params)
                raise ValueError(
                    f"{what}: parameter group {gi} of optimizer {k} holds {missing[:4]}{'...' if len(missing) > 4 else ''}"
                    f" which the saved group of {fqns[0]!r} does not; the parameters are grouped differently than "
                    "when saved"
                )
            new = checked_hyper_parameters(loaded, live, f"{what}: parameter group {gi} of optimizer {k}")
            new["params"] = list(live["params"])
            return new
    raise ValueError(
        f"{what}: no saved parameter group holds {fqns[0] if fqns else 'no parameters'!r} (parameter group {gi} of "
        f"optimizer {k}); the optimizer state dict belongs to another model or optimizer"
    )


def _plan_entry(
    hl: HandleLayout, state: Mapping[str, Any], layout: ModelLayout, what: str
) -> Optional[Dict[str, Tuple[str, Any]]]:
    """The new flat state of one handle from the per-parameter entries of its original parameters."""
    entries = [state.get(p.fqn) for p in hl.params]
    present = [p.fqn for p, e in zip(hl.params, entries) if e is not None]
    if not present:
        return None
    if len(present) != len(hl.params):
        absent = [p.fqn for p, e in zip(hl.params, entries) if e is None]
        raise ValueError(
            f"{what}: the optimizer state has entries for {present[:3]} but not for {absent[:3]}, which share one "
            "flat parameter (one FSDP instance) here; every parameter of an instance needs state, or none"
        )
    checked: List[Mapping[str, Any]] = []
    for p, e in zip(hl.params, entries):
        if not isinstance(e, Mapping):
            raise TypeError(f"{what}: the optimizer state of {p.fqn!r} must be a dict, got {type(e).__name__}")
        checked.append(e)
    keys = list(checked[0])
    for p, e in zip(hl.params[1:], checked[1:]):
        if set(e) != set(keys):
            raise ValueError(
                f"{what}: the optimizer state of {p.fqn!r} has keys {sorted(map(str, e))} but that of "
                f"{hl.params[0].fqn!r} has {sorted(map(str, keys))}; they share one flat parameter here"
            )
    out: Dict[str, Tuple[str, Any]] = {}
    all_scalar = all(p.is_scalar for p in hl.params)
    for key in keys:
        values = [e[key] for e in checked]
        per_param = any(
            isinstance(v, Tensor) and not p.is_scalar and shape_of(v) == tuple(p.shape)
            for p, v in zip(hl.params, values)
        ) or (all_scalar and key != "step" and all(isinstance(v, Tensor) for v in values))
        if per_param:
            out[key] = (
                "param",
                [_classify(v, p, hl, layout, f"state[{p.fqn!r}][{key!r}]", what) for p, v in zip(hl.params, values)],
            )
        else:
            out[key] = ("scalar", _common_scalar(hl, key, values, what))
    return out


def _common_scalar(hl: HandleLayout, key: str, values: List[Any], what: str) -> Any:
    """The one value a flat parameter keeps for a scalar state (``step``...) its original parameters must share."""
    plain: List[Any] = []
    for p, v in zip(hl.params, values):
        if _DTENSOR_ERROR is None and isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, Tensor) and v.dim() != 0:
            raise ValueError(
                f"{what}: optimizer state {key!r} of {p.fqn!r} has shape {tuple(v.shape)}: neither the parameter's "
                f"shape {tuple(p.shape)} nor a scalar"
            )
        plain.append(v)
    first = plain[0]
    for p, v in zip(hl.params[1:], plain[1:]):
        same = (
            torch.equal(v.detach().cpu(), first.detach().cpu())
            if isinstance(v, Tensor) and isinstance(first, Tensor)
            else _same_number(v, first)
        )
        if not same:
            raise ValueError(
                f"{what}: optimizer state {key!r} is {v!r} for {p.fqn!r} but {first!r} for {hl.params[0].fqn!r}; "
                "they share one flat parameter (one FSDP instance) here, which keeps one value for all of them"
            )
    return first.detach().clone() if isinstance(first, Tensor) else copy.deepcopy(first)


def _same_number(a: Any, b: Any) -> bool:
    a = a.item() if isinstance(a, Tensor) else a
    b = b.item() if isinstance(b, Tensor) else b
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # values that do not compare
        return False


@torch.no_grad()
def _build_flat(plan: _OptimPlan) -> Dict[str, Any]:
    """One optimizer's new flat state dict (collective for per-parameter states)."""
    state: Dict[int, Dict[str, Any]] = {}
    items: List[Tuple[HandleLayout, List[Value], Tensor]] = []
    for i in sorted(plan.entries):
        hl = plan.hls[i]
        shard = hl.handle.fp32_shard
        assert shard is not None
        new: Dict[str, Any] = {}
        for key in sorted(plan.entries[i], key=str):
            kind, value = plan.entries[i][key]
            if kind == "scalar":
                new[key] = value
                continue
            first = next(v[1] for v in value if v is not None)
            live = plan.optim.state.get(hl.handle.param, {}).get(key)
            if isinstance(live, Tensor) and live.shape == shard.shape and live.dtype == dtype_of(first):
                # Its current state tensor (e.g. the placeholder made for dcp.load): no second copy of the state.
                # Every real element is written below; the padding is zeroed.
                out = live
                lo, hi = hl.shard_range()
                real = max(0, min(hi, hl.handle.numel) - lo)
                out.view(-1)[real:].zero_()
            else:
                out = torch.zeros(shard.shape, dtype=dtype_of(first), device=shard.device)
            items.append((hl, value, out))
            new[key] = out
        state[i] = {key: new[key] for key in plan.entries[i]}
    chunks_to_flat(items)
    return {"state": state, "param_groups": plan.groups}
