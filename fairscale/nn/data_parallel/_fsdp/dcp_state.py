# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP state dict of an FSDP model, and the load of a model and its optimizers together.

See :mod:`fairscale.nn.data_parallel.dcp` for the user's view. The layout is FSDP2's: every original parameter (and
every per-parameter optimizer state) is a DTensor with ``Shard(0)`` over a 1-D DeviceMesh of the root's process group
(0-dim ones ``Replicate``), buffers and scalar optimizer states are plain tensors, keys are the user-visible names.
With hybrid sharding it is FSDP2 HSDP's: ``(Replicate(), Shard(0))`` over a 2-D ``("replicate", "shard")`` mesh;
the exchanges stay inside each shard group (every replica does its own), and loads agree over the whole world.

Saving cuts the chunks out of the flat shards with one exchange per flat parameter (or per few small ones, see
:mod:`.dcp_reshard`), never the whole model at once. Loading is all-or-nothing: every rank checks its dicts against
the model (keys, shapes, layouts) without touching anything, and the ranks agree on the outcome and on the kinds of
values they hold (:mod:`.loads`, :mod:`fairscale.internal.agreement`) before the first value is written; past that
point only exchanges of agreed sizes and local copies run. An optimizer load builds its new flat state (in its
current state tensors when they fit) and hands it to ``optimizer.load_state_dict`` once complete.

This module holds the model's side and :func:`set_state_dict`, which checks, agrees on and writes both. The
optimizers' side is :mod:`.dcp_optim` (its entry points are re-exported here: :mod:`fairscale.nn.data_parallel.dcp`
calls them through this module), and what both share (DTensor chunks, the check of a given value, the frame of every
call) is :mod:`.dcp_dtensor`.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.agreement import check_ranks_agree

from . import loads
from .dcp_dtensor import COPIES as COPIES
from .dcp_dtensor import SNAPSHOT as SNAPSHOT
from .dcp_dtensor import STAGING as STAGING
from .dcp_dtensor import VIEWS as VIEWS
from .dcp_dtensor import (
    _DTENSOR_ERROR,
    Value,
    _classify,
    _effective_values,
    _initialized_tree,
    _Meshes,
    _require_dtensor,
    _value_lists,
    check_root,
)
from .dcp_layout import BufferEntry, HandleLayout, ModelLayout, model_layout
from .dcp_optim import _build_flat, _OptimPlan, _plan_optim_load
from .dcp_optim import as_optimizers as as_optimizers
from .dcp_optim import get_optimizer_state_dict, init_optim_state
from .dcp_reshard import chunks_to_flat
from .state_dict import _check_loadable
from .unit import FSDPUnit

if _DTENSOR_ERROR is None:  # guarded once, in .dcp_dtensor; older torch leaves DTensor unbound, each use checks first
    from .dcp_dtensor import DTensor, Replicate

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_state_dict",
    "init_optim_state",
]


def _nothing_to_restore(unit: FSDPUnit) -> Any:
    """The validation phase changes nothing, so there is nothing to snapshot."""
    return contextlib.nullcontext()


def _agree(unit: FSDPUnit, layout: ModelLayout, what: str, signature: Any) -> None:
    """Every rank must hold the same kinds of values (the exchanges that follow depend on them)."""
    with unit.device.as_current():
        check_ranks_agree(
            f"{what}: the keys and kinds of the values (DTensor chunks, full tensors, absent) and the optimizer "
            "hyper-parameters",
            signature,
            layout.agree_group,  # the whole world with hybrid sharding: every replica loads
            hint="Pass every rank a state dict of the same structure (e.g. all from get_*_state_dict and dcp.load).",
        )


# ---------------------------------------------------------------------------------------------------- model


def get_model_state_dict(
    unit: FSDPUnit,
    cpu_offload: bool,
    ignore_frozen_params: bool,
    values: str = COPIES,
    what: str = "get_model_state_dict",
) -> Dict[str, Any]:
    """See :func:`fairscale.nn.data_parallel.dcp.get_model_state_dict`; ``values``: :data:`COPIES`, :data:`VIEWS`,
    :data:`SNAPSHOT` or :data:`STAGING` (buffers are copied in every case); ``what`` names the public call in
    messages (``save``/``load`` use this too)."""
    values = _effective_values(values)
    _require_dtensor(what)
    check_root(unit, what)
    unit.assert_idle_tree(f"{what}()")
    with _initialized_tree(unit):
        layout = model_layout(unit, what)
        meshes = _Meshes(layout)
        out: Dict[str, Any] = {}
        items: List[Tuple[HandleLayout, Tensor, torch.device]] = []
        for hl in layout.handles:
            shard = hl.handle.fp32_shard
            assert shard is not None  # materialised by lazy init
            if ignore_frozen_params and not hl.handle.param.requires_grad:
                continue  # requires_grad is the same on every rank: all of them skip this exchange
            items.append((hl, shard, torch.device("cpu") if cpu_offload else shard.device))
        with collectives.collective_phase("dcp_state_dict"):
            value_lists = _value_lists(items, values, meshes)
        for (hl, _, _), hl_values in zip(items, value_lists):
            for p, value in zip(hl.params, hl_values):
                for name in (p.fqn,) + p.aliases:
                    out[name] = value
        for b in layout.buffers:
            out[b.fqn] = _buffer_copy(b, cpu_offload)
    return {key: out[key] for key in layout.keys if key in out}


@torch.no_grad()
def _buffer_copy(b: BufferEntry, cpu_offload: bool) -> Tensor:
    """A copy of the buffer, in fp32 in mixed precision (as ``state_dict()``)."""
    value = b.tensor().detach()
    if b.unit.config.mixed_precision and value.is_floating_point() and value.dtype != torch.float32:
        value = value.to(torch.float32)
    return value.to(device=torch.device("cpu") if cpu_offload else value.device, copy=True)


@dataclass
class _ModelPlan:
    handles: List[Tuple[HandleLayout, List[Value]]] = field(default_factory=list)
    buffers: List[Tuple[BufferEntry, Tensor]] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)

    def signature(self) -> Any:
        kinds = [[None if v is None else v[0] for v in values] for _, values in self.handles]
        return (kinds, [b.fqn for b, _ in self.buffers], self.missing, self.unexpected)


def _plan_model_load(layout: ModelLayout, sd: Mapping[str, Any], strict: bool, what: str) -> _ModelPlan:
    """Check ``sd`` against the model and say what to write where (touches nothing)."""
    expected = set(layout.keys)
    plan = _ModelPlan(
        missing=[k for k in layout.keys if k not in sd], unexpected=[str(k) for k in sd if k not in expected]
    )
    if strict and (plan.missing or plan.unexpected):
        lines = []
        if plan.missing:
            lines.append("missing key(s): " + ", ".join(repr(k) for k in plan.missing))
        if plan.unexpected:
            lines.append("unexpected key(s): " + ", ".join(repr(k) for k in plan.unexpected))
        raise RuntimeError(
            f"{what}: the state dict does not match the model ({'; '.join(lines)}). It was saved from another model "
            "or wrapping of other modules; pass options=StateDictOptions(strict=False) to load the matching keys only."
        )
    for hl in layout.handles:
        values: List[Value] = []
        for p in hl.params:
            names = [n for n in (p.fqn,) + p.aliases if n in sd]
            for name in names[1:]:
                _classify(sd[name], p, hl, layout, name, what)  # aliases must fit too
            values.append(_classify(sd[names[0]], p, hl, layout, names[0], what) if names else None)
        plan.handles.append((hl, values))
    for b in layout.buffers:
        if b.fqn not in sd:
            continue
        value = sd[b.fqn]
        if _DTENSOR_ERROR is None and isinstance(value, DTensor):
            if not all(isinstance(pl, Replicate) for pl in value.placements):
                raise ValueError(f"{what}: buffer {b.fqn!r} is a sharded DTensor; buffers are saved whole")
            value = value.to_local()
        if not isinstance(value, Tensor):
            raise TypeError(f"{what}: buffer {b.fqn!r} must be a Tensor, got {type(value).__name__}")
        live = b.tensor()
        if tuple(value.shape) != tuple(live.shape):
            raise ValueError(
                f"{what}: size mismatch for buffer {b.fqn!r}: the value has shape {tuple(value.shape)} but the model's "
                f"buffer has shape {tuple(live.shape)}"
            )
        plan.buffers.append((b, value))
    return plan


def _commit_model(unit: FSDPUnit, plan: _ModelPlan) -> None:
    """Write an agreed plan into the shards and buffers, one flat parameter at a time (collective)."""
    items: List[Tuple[HandleLayout, List[Value], Tensor]] = []
    for hl, values in plan.handles:
        shard = hl.handle.fp32_shard
        assert shard is not None  # materialised by lazy init
        if any(v is not None for v in values):
            items.append((hl, values, shard))
    with torch.no_grad(), collectives.collective_phase("dcp_load"):
        chunks_to_flat(items)
        for b, value in plan.buffers:
            b.tensor().copy_(value)
    for u in unit.tree_units():
        for h in u.handles:
            h.free_full()  # gathered copies are stale now
            h.drop_zero2_slice()


def set_state_dict(
    unit: FSDPUnit,
    optimizers: Sequence[torch.optim.Optimizer],
    msd: Optional[Mapping[str, Any]],
    osd: Optional[Mapping[str, Any]],
    strict: bool,
    what: str,
) -> Tuple[List[str], List[str]]:
    """Load a model and/or an optimizer state dict; see :mod:`fairscale.nn.data_parallel.dcp`.

    Both dicts are checked on every rank and the ranks agree (on the outcome, then on the kinds of values) before
    anything is written, so a wrong dict on any rank changes neither the model nor the optimizers anywhere. Then
    the model's shards and buffers are written in place, one flat parameter at a time, and each optimizer's new
    flat state is built (in its current state tensors when they fit, else in new ones) and handed to
    ``optimizer.load_state_dict``.

    Returns:
        The model's ``(missing, unexpected)`` keys (empty without a model dict).
    """
    _require_dtensor(what)
    check_root(unit, what)
    if msd is not None and not isinstance(msd, Mapping):
        raise TypeError(f"{what}: model_state_dict must be a dict, got {type(msd).__name__}")
    _check_loadable(unit, what)
    with _initialized_tree(unit):
        layout = model_layout(unit, what)

        def plan() -> Tuple[Optional[_ModelPlan], List[_OptimPlan]]:
            model_plan = _plan_model_load(layout, msd, strict, what) if msd is not None else None
            optim_plans = _plan_optim_load(layout, optimizers, osd, what) if osd is not None else []
            return model_plan, optim_plans

        model_plan, optim_plans = loads.load_collectively(unit, what, plan, None, _nothing_to_restore)
        signature = [None if model_plan is None else model_plan.signature(), [p.signature() for p in optim_plans]]
        signature += [entry for k, p in enumerate(optim_plans) for entry in p.hyper_parameters(k)]
        _agree(unit, layout, what, signature)
        # Past the agreement only collectives of agreed sizes and local copies run.
        if model_plan is not None:
            _commit_model(unit, model_plan)
        flat_dicts = []
        with collectives.collective_phase("dcp_optim_load"):
            for optim_plan in optim_plans:
                flat_dicts.append(_build_flat(optim_plan))
        for optim_plan, flat in zip(optim_plans, flat_dicts):
            optim_plan.optim.load_state_dict(flat)
    if model_plan is None:
        return [], []
    return model_plan.missing, model_plan.unexpected
