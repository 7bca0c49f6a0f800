# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP state dicts of an FSDP model and of torch optimizers over its flat parameters.

See :mod:`fairscale.nn.data_parallel.dcp` for the user's view. The layout is FSDP2's: every original parameter (and
every per-parameter optimizer state) is a DTensor with ``Shard(0)`` over a 1-D DeviceMesh of the root's process group
(0-dim ones ``Replicate``), buffers and scalar optimizer states are plain tensors, keys are the user-visible names.

Saving cuts the chunks out of the flat shards with one exchange per flat parameter (or per few small ones, see
:mod:`.dcp_reshard`), never the whole model at once. Loading is all-or-nothing: every rank checks its dicts against
the model (keys, shapes, layouts) without touching anything, and the ranks agree on the outcome and on the kinds of
values they hold (:mod:`.loads`, :mod:`fairscale.internal.agreement`) before the first value is written; past that
point only exchanges of agreed sizes and local copies run. An optimizer load builds its new flat state (in its
current state tensors when they fit) and hands it to ``optimizer.load_state_dict`` once complete.
"""

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.agreement import check_ranks_agree

from . import loads
from .dcp_layout import BufferEntry, HandleLayout, ModelLayout, OrigParam, model_layout
from .dcp_reshard import CHUNK, FULL, chunks_to_flat, flat_to_chunks
from .runtime import lazy_init, lazy_init_for_call
from .state_dict import _check_loadable
from .unit import FSDPUnit

try:  # torch >= 2.4: public DTensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _DTENSOR_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - old torch
    _DTENSOR_ERROR = str(e)
try:  # what DTensor.from_local builds, without its autograd function (a tenth of a save's CPU time otherwise)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    _DIRECT_DTENSOR = [True]
except ImportError:  # pragma: no cover - another torch layout: from_local
    _DIRECT_DTENSOR = [False]

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_state_dict",
    "init_optim_state",
]

Value = Optional[Tuple[str, Tensor]]


def _require_dtensor(what: str) -> None:
    if _DTENSOR_ERROR is not None:  # pragma: no cover - old torch
        raise ImportError(
            f"{what} needs torch.distributed.tensor (DTensor, torch >= 2.4); this torch has none: {_DTENSOR_ERROR}"
        )


def check_root(unit: FSDPUnit, what: str) -> None:
    """Refuse a nested instance before lazy init could make it the root of its own subtree."""
    if unit.has_fsdp_parent or unit.is_root is False:
        raise ValueError(
            f"{what}: call it with the root FullyShardedDataParallel instance (the outermost one), not a nested one"
        )


# ---------------------------------------------------------------------------------------------------- DTensors


class _Meshes:
    """The 1-D DeviceMesh of the layout's group, per device type (``None`` without torch.distributed)."""

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout
        self._cache: Dict[str, Any] = {}

    def get(self, device_type: str) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if device_type not in self._cache:
            group = self.layout.group if self.layout.group is not None else dist.group.WORLD
            if group is None:
                return None
            self._cache[device_type] = DeviceMesh.from_group(group, device_type)
        return self._cache[device_type]


def _contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    stride: List[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


@torch.no_grad()
def _as_dtensor(local: Tensor, p: OrigParam, meshes: _Meshes) -> Any:
    """This rank's chunk of ``p`` as a DTensor (``Shard(0)``; ``Replicate`` for 0-dim), without communication."""
    mesh = meshes.get(local.device.type)
    if mesh is None:
        return local  # no process group: world size 1, the chunk is the whole tensor
    placements = (Replicate(),) if p.is_scalar else (Shard(0),)
    stride = _contiguous_stride(p.shape)
    if _DIRECT_DTENSOR[0]:
        try:
            spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(p.shape, stride, local.dtype))
            return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]
        except TypeError:  # pragma: no cover - the private constructor changed: the public path from now on
            _DIRECT_DTENSOR[0] = False
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=stride)


def _classify(
    value: Any, p: OrigParam, hl: HandleLayout, layout: ModelLayout, key: str, what: str
) -> Tuple[str, Tensor]:
    """``(CHUNK, this rank's chunk)`` or ``(FULL, full tensor)`` for a value given for parameter ``p``."""
    if _DTENSOR_ERROR is None and isinstance(value, DTensor):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what}: {key!r} has global shape {tuple(value.shape)} but the model's parameter has shape "
                f"{tuple(p.shape)}; the checkpoint was saved from another model"
            )
        placements = tuple(value.placements)
        if all(isinstance(pl, Replicate) for pl in placements):
            return FULL, value.to_local()
        mesh_ranks = tuple(int(r) for r in value.device_mesh.mesh.flatten().tolist())
        if len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
            raise ValueError(
                f"{what}: {key!r} is a DTensor with placements {placements}; only Shard(0) over a 1-D mesh (FSDP2's "
                "and this module's layout) or Replicate can be loaded. Load the checkpoint with dcp.load into "
                "get_model_state_dict(model) / get_optimizer_state_dict(model, optim) instead."
            )
        if mesh_ranks != layout.group_ranks:
            raise ValueError(
                f"{what}: {key!r} is sharded over ranks {list(mesh_ranks)} but this model shards over "
                f"{list(layout.group_ranks)}; load the checkpoint with dcp.load into the state dict that "
                "get_model_state_dict(model) / get_optimizer_state_dict(model, optim) returns, which reshards it"
            )
        local = value.to_local()
        expected = p.chunk_shape(hl.world_size, hl.rank)
        if tuple(local.shape) != tuple(expected):
            raise ValueError(
                f"{what}: the local chunk of {key!r} on group rank {hl.rank} has shape {tuple(local.shape)} but "
                f"Shard(0) of {tuple(p.shape)} over {hl.world_size} ranks gives {tuple(expected)}"
            )
        return CHUNK, local
    if isinstance(value, Tensor):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what}: size mismatch for {key!r}: the value has shape {tuple(value.shape)} but the model's "
                f"parameter has shape {tuple(p.shape)}; the checkpoint was saved from another model"
            )
        return FULL, value
    raise TypeError(f"{what}: {key!r} must be a Tensor or DTensor, got {type(value).__name__}")


@contextlib.contextmanager
def _initialized_tree(unit: FSDPUnit) -> Iterator[None]:
    """Lazy init of every unit of the tree for one call (undone afterwards if the model was not initialised)."""
    with lazy_init_for_call(unit):
        for u in unit.tree_units():
            lazy_init(u)  # nested units materialise their shards at their own first use otherwise
        unit.device.synchronize()
        yield


def _nothing_to_restore(unit: FSDPUnit) -> Any:
    """The validation phase changes nothing, so there is nothing to snapshot."""
    return contextlib.nullcontext()


def _agree(unit: FSDPUnit, layout: ModelLayout, what: str, signature: Any) -> None:
    """Every rank must hold the same kinds of values (the exchanges that follow depend on them)."""
    with unit.device.as_current():
        check_ranks_agree(
            f"{what}: the keys and kinds of the values (DTensor chunks, full tensors, absent)",
            signature,
            layout.group,
            hint="Pass every rank a state dict of the same structure (e.g. all from get_*_state_dict and dcp.load).",
        )


# ---------------------------------------------------------------------------------------------------- model


# What the chunks of a state dict hold: copies of the values, or nothing (a template for dcp.load to fill, made
# without communication).
COPIES, TEMPLATE = "copies", "template"


def _chunk_lists(items: List[Tuple[HandleLayout, Tensor, torch.device]], values: str) -> List[List[Tensor]]:
    """Per ``(handle, flat tensor, device)``: this rank's chunk of every parameter (collective), or a template."""
    if values != TEMPLATE:
        return flat_to_chunks(items)
    return [
        [torch.empty(p.chunk_shape(hl.world_size, hl.rank), dtype=flat.dtype, device=device) for p in hl.params]
        for hl, flat, device in items
    ]


def get_model_state_dict(
    unit: FSDPUnit, cpu_offload: bool, ignore_frozen_params: bool, values: str = COPIES
) -> Dict[str, Any]:
    """See :func:`fairscale.nn.data_parallel.dcp.get_model_state_dict`; ``values``: :data:`COPIES` or
    :data:`TEMPLATE` (buffers are copied in both cases)."""
    what = "get_model_state_dict"
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
            chunk_lists = _chunk_lists(items, values)
        for (hl, _, _), chunks in zip(items, chunk_lists):
            for p, chunk in zip(hl.params, chunks):
                value = _as_dtensor(chunk, p, meshes)
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


# ---------------------------------------------------------------------------------------------------- optimizers


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
) -> Dict[str, Any]:
    """See :func:`fairscale.nn.data_parallel.dcp.get_optimizer_state_dict` (``values``: as for the model)."""
    what = "get_optimizer_state_dict"
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
            init_optim_state(optim)
            osd = optim.state_dict()
            state = {int(i): entry for i, entry in osd["state"].items()}
            schema = {i: sorted((str(key), _schema(v)) for key, v in entry.items()) for i, entry in state.items()}
            with unit.device.as_current():
                check_ranks_agree(
                    f"{what}: the state of optimizer {k} (parameters, keys, shapes)",
                    schema,
                    layout.group,
                    hint="Every rank must step the same optimizer on the same model.",
                )
            kept = [i for i in sorted(state) if not (ignore_frozen_params and not hls[i].handle.param.requires_grad)]
            per_param = {i: _unflatten_entry(hls[i], state[i], cpu_offload, what) for i in kept}
            jobs = [(i, key) for i in kept for key in sorted(state[i], key=str) if key in per_param[i][1]]
            items = [(hls[i], state[i][key], per_param[i][1][key]) for i, key in jobs]
            with collectives.collective_phase("dcp_optim_state_dict"):
                chunk_lists = _chunk_lists(items, values)
            for (i, key), chunks in zip(jobs, chunk_lists):
                for d, p, chunk in zip(per_param[i][0], hls[i].params, chunks):
                    d[key] = _as_dtensor(chunk, p, meshes)
            for i in kept:
                order = list(state[i])  # the optimizer's own key order in every entry
                for p, d in zip(hls[i].params, per_param[i][0]):
                    state_out[p.fqn] = {key: d[key] for key in order}
            for group in osd["param_groups"]:
                new = {key: copy.deepcopy(v) for key, v in group.items() if key not in ("params", "param_names")}
                new["params"] = [
                    p.fqn
                    for i in group["params"]
                    if not (ignore_frozen_params and not hls[i].handle.param.requires_grad)
                    for p in hls[i].params
                ]
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
        out = []
        for i in sorted(self.entries):
            keys = []
            for key, (kind, v) in sorted(self.entries[i].items()):
                keys.append((key, kind, [None if x is None else x[0] for x in v] if kind == "param" else None))
            out.append((i, keys))
        return out


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
            new = {key: copy.deepcopy(v) for key, v in loaded.items() if key not in ("params", "param_names")}
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
            isinstance(v, Tensor) and not p.is_scalar and tuple(v.shape) == tuple(p.shape)
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
        signature = (None if model_plan is None else model_plan.signature(), [p.signature() for p in optim_plans])
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
            if isinstance(live, Tensor) and live.shape == shard.shape and live.dtype == first.dtype:
                # Its current state tensor (e.g. the placeholder made for dcp.load): no second copy of the state.
                # Every real element is written below; the padding is zeroed.
                out = live
                lo, hi = hl.shard_range()
                real = max(0, min(hi, hl.handle.numel) - lo)
                out.view(-1)[real:].zero_()
            else:
                out = torch.zeros(shard.shape, dtype=first.dtype, device=shard.device)
            items.append((hl, value, out))
            new[key] = out
        state[i] = {key: new[key] for key in plan.entries[i]}
    chunks_to_flat(items)
    return {"state": state, "param_groups": plan.groups}
