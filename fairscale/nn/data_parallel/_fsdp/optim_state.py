# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Full (unsharded) optimizer state: gather it from the shards, and cut a rank's shard out of it.

The format is upstream's (see :mod:`fairscale.nn.data_parallel.fsdp_optim_utils`). Differences, all fixes:

* the live optimizer is never modified: ``step`` becomes a Python number only in the returned dict (upstream
  converted the optimizer's own 0-dim tensors, after which torch 2.x Adam could not step again);
* every instance is gathered and sharded over its *own* process group (upstream sharded nested instances with the
  root's rank and world size), so a checkpoint also resumes on another world size with such groups;
* the full dict given to :func:`get_shard_from_optim_state_dict` is not modified, and is checked against the model
  (parameter count and shapes) with errors that name the parameter.
"""

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.parallel import chunk_and_pad
from .naming import clean_path
from .optim_format import check_param_counts_before_sharding, flatten_for_model, is_singleton_tensor
from .unit import FSDPUnit

__all__ = ["gather_full_optim_state_dict", "get_shard_from_optim_state_dict"]


@dataclass
class _Layout:
    """One non-empty FSDP instance as the optimizer sees it: local id ``local``, global ids ``first_gid...``."""

    local: int
    instance: FSDPUnit
    path: str
    names: List[str]
    shapes: List[torch.Size]
    numels: List[int]
    first_gid: int

    @property
    def gids(self) -> range:
        return range(self.first_gid, self.first_gid + len(self.names))


def _layouts(root: FSDPUnit) -> List[_Layout]:
    """The model's non-empty instances in module pre-order; every one must own exactly one flat parameter, or (as
    upstream: "only flatten param or a single non-shared param") be an instance with ``flatten_parameters=False``
    that holds a single parameter of its own, which it shards like a flat one. The root must flatten."""
    if not root.config.flatten_parameters:
        raise NotImplementedError(
            "full optimizer state dicts need flatten_parameters=True on the root FullyShardedDataParallel instance "
            "(as upstream). Save optim.state_dict() per rank instead."
        )
    out: List[_Layout] = []
    gid = 0
    for path, m in root.named_units():
        owned = [h.param for h in m.handles if not h.borrowed]
        if not owned:
            continue
        fpw: Any = m.wrapped
        flatten = m.config.flatten_parameters
        # Borrowed parameters (append_shared_param) are their owners' in the optimizer, as upstream counts them.
        single = not flatten and len(owned) == 1 and not m.handles[0].borrowed
        if not single and (not flatten or len(owned) != 1 or len(getattr(fpw, "flat_params", [])) != 1):
            raise NotImplementedError(
                "full optimizer state dicts need every FullyShardedDataParallel instance that owns parameters to "
                "flatten them (flatten_parameters=True), or to hold a single parameter of its own; the instance at "
                f"{clean_path(path)!r} has flatten_parameters={flatten} and {len(owned)} parameters of its own. Save "
                "optim.state_dict() per rank instead."
            )
        if single:
            h = m.handles[0]  # its own parameter comes first: append_shared_param appends the borrowed ones
            names, shapes, numels = [m.param_name_groups[0][0]], [torch.Size(h.orig_size)], [h.numel]
        else:
            names, shapes, numels = fpw.metadata(0)
        where = clean_path(path)
        names = [clean_path(f"{where}.{clean_path(n)}" if where else n) for n in names]
        out.append(_Layout(len(out), m, where, names, list(shapes), list(numels), gid))
        gid += len(names)
    return out


# ---------------------------------------------------------------------------------------------------- gather


def gather_full_optim_state_dict(fsdp: FSDPUnit, optim: Any, **ignored: Any) -> Optional[Dict[str, Any]]:
    """See :meth:`FullyShardedDataParallel.gather_full_optim_state_dict`."""
    if ignored.get("recipient_rank", 0) not in (0, None):
        # Upstream accepts and ignores it too; said, as the dict silently went to rank 0 (found by a fuzz, session 43).
        warnings.warn(
            f"gather_full_optim_state_dict: recipient_rank={ignored['recipient_rank']!r} is ignored (as upstream): the "
            "dict is returned on rank 0 of the root's group, None elsewhere. Send it on yourself if needed.",
            stacklevel=3,
        )
    layouts = _layouts(fsdp)
    # A wrong optimizer on one rank raised there alone, and the other ranks waited in the gathers below until the
    # group's timeout: its error rides in the schema gather, and every rank raises it.
    problem: Optional[Exception] = None
    try:
        _check_optimizer(optim, layouts)
    except (NotImplementedError, ValueError) as e:
        problem = e
    osd = optim.state_dict() if problem is None else {"state": {}, "param_groups": []}
    odd = [k for k in osd["state"] if not isinstance(k, int)]
    if odd and problem is None:  # int() of it raised a bare "invalid literal for int()" (found by a fuzz, session 43)
        problem = ValueError(
            f"the optimizer keeps state under keys that are not parameters ({odd[:3]}): the consolidated format holds "
            "per-parameter state only. Keep such values in param_groups or save them beside the dict yourself."
        )
        osd = {"state": {}, "param_groups": []}
    # New per-parameter dicts: optim.state_dict() shares them with the live optimizer.
    state = {int(k): {key: _plain_step(key, v) for key, v in s.items()} for k, s in osd["state"].items()}
    _check_same_schema(fsdp, state, layouts, problem)
    # Keys some parameter holds element-wise: a 0-dim parameter's are 0-dim too, like the shared scalars'.
    per_element = {key for s in state.values() for key, v in s.items() if isinstance(v, Tensor) and v.dim() > 0}
    # Rank 0 of the root's group, as upstream: with tensor parallelism (FSDP over each tensor-parallel rank's
    # data-parallel group) each such group's rank 0 holds its part of the model's state, and global rank 0 alone
    # returned one part (the other data-parallel leaders got None and saved nothing). With hybrid sharding, the
    # first replica's: the replicas hold the same state, and their shard and replicate groups make up the model's.
    on_rank0 = fsdp.config.rank == 0 and fsdp.config.replicate_rank == 0
    full_state: Dict[int, Dict[str, Any]] = {}
    uncollected: List[int] = []
    for lay in layouts:
        if lay.instance.config.no_broadcast_optim_state:
            # Expert-style instances: each rank holds different values; rank 0's own state, not gathered.
            uncollected.append(lay.local)
            if on_rank0 and lay.local in state:
                full_state.update(_own_state_entries(lay, state[lay.local]))
            continue
        if lay.local not in state:
            continue  # unused parameters: no state on any rank (checked above)
        gathered = _gather_instance(lay, state[lay.local], per_element)
        if on_rank0:
            full_state.update(_unflatten(lay, gathered))
    if not on_rank0:
        return None
    group = copy.deepcopy({k: v for k, v in osd["param_groups"][0].items() if k != "params"})
    n_global = sum(len(lay.names) for lay in layouts)
    group["params"] = list(range(n_global))
    out: Dict[str, Any] = {
        "state": dict(sorted(full_state.items())),
        "param_groups": [group],
        "param_id_map": {g: lay.local for lay in layouts for g in lay.gids},
        "uncollected_local_ids": uncollected,
    }
    out.update({k: copy.deepcopy(v) for k, v in osd.items() if k not in ("state", "param_groups")})
    return out


def _check_optimizer(optim: Any, layouts: List[_Layout]) -> None:
    groups = getattr(optim, "param_groups", None)
    if groups is None:
        return  # a wrapper without param_groups: trust that it follows model.parameters()
    if len(groups) != 1:
        raise NotImplementedError(
            f"gather_full_optim_state_dict supports optimizers with exactly one parameter group; this one has "
            f"{len(groups)}"
        )
    params = list(groups[0]["params"])
    expected = [lay.instance.handles[0].param for lay in layouts]
    if len(params) < len(expected) and _is_subsequence(params, expected):
        # The usual cause: the optimizer was built over the trainable parameters only (a frozen instance filtered
        # out by requires_grad). The format numbers every parameter of the model, frozen ones included.
        left_out = [lay.instance.handles[0].param for lay in layouts if not _contains(params, lay)]
        frozen = sum(1 for p in left_out if not p.requires_grad)
        raise ValueError(
            f"the optimizer leaves out {len(left_out)} of the model's {len(expected)} flat parameters (one per FSDP "
            f"instance with parameters; {frozen} of those left out are frozen): gather_full_optim_state_dict needs "
            "an optimizer over all of model.parameters(), frozen ones included (they get no state). Build it as "
            "optim = Optimizer(model.parameters(), ...) instead of filtering by requires_grad."
        )
    if len(params) != len(expected) or any(a is not b for a, b in zip(params, expected)):
        raise ValueError(
            "the optimizer's parameters must be the model's flat parameters in model.parameters() order (one per "
            f"FSDP instance with parameters: {len(expected)}); it has {len(params)} parameters in another order or "
            "from another model. Build it as optim = Optimizer(model.parameters(), ...) after wrapping."
        )


def _is_subsequence(params: List[Any], expected: List[Any]) -> bool:
    """Whether ``params`` are some of ``expected``, in ``expected``'s order (compared by identity)."""
    it = iter(expected)
    return all(any(p is e for e in it) for p in params)


def _contains(params: List[Any], lay: _Layout) -> bool:
    flat = lay.instance.handles[0].param
    return any(p is flat for p in params)


def _plain_step(key: str, value: Any) -> Any:
    """The format keeps ``step`` as a Python number; convert a copy, never the optimizer's tensor."""
    if key == "step" and is_singleton_tensor(value):
        return value.item()
    return value


def _cpu_copy(entry: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: (v.detach().cpu().clone() if isinstance(v, Tensor) else copy.deepcopy(v)) for k, v in entry.items()}


def _schema(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("value", type(value).__name__)


def _check_same_schema(
    fsdp: FSDPUnit, state: Dict[int, Dict[str, Any]], layouts: List[_Layout], problem: Optional[Exception] = None
) -> None:
    """Every rank must gather the same keys and shapes, or the gathers below would mismatch or hang; a rank's own
    ``problem`` (its optimizer is refused) is raised on every rank, the first rank's type and every rank's message."""
    collected = [lay.local for lay in layouts if not lay.instance.config.no_broadcast_optim_state]
    mine = {k: [(key, _schema(v)) for key, v in state[k].items()] for k in collected if k in state}
    own = None if problem is None else (type(problem).__name__, str(problem))
    with fsdp.device.as_current():  # NCCL object collectives allocate on the current device
        gathered = collectives.all_gather_object((own, mine), group=fsdp.config.process_group)
    problems = [(r, p) for r, (p, _) in enumerate(gathered) if p is not None]
    if problems:
        kind = NotImplementedError if problems[0][1][0] == "NotImplementedError" else ValueError
        raise kind("; ".join(f"group rank {r}: {message}" for r, (_, message) in problems))
    everyone = [theirs for _, theirs in gathered]
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(
                f"gather_full_optim_state_dict: the optimizer state of group rank {r} has other parameters, keys or "
                f"shapes than this rank's ({theirs} vs {mine}); every rank must step the same optimizer type on the "
                "same model"
            )


def _gather_instance(lay: _Layout, entry: Mapping[str, Any], per_element: Set[str]) -> Dict[str, Any]:
    """All-gather one flat parameter's state over the instance's group; tensors come back unpadded, flat.

    A single 0-dim parameter on a group of one rank has 0-dim element-wise state: taken as a shared scalar, it was
    saved as a per-rank list, and a resume at a larger world (a 1-element shard) failed at the first step (found by
    a fuzz, session 43). Keys other parameters hold element-wise (``per_element``) are element-wise there too.
    """
    m = lay.instance
    h = m.handles[0]
    c = m.config
    world = c.world_size
    scalar_param = not h.is_sharded and tuple(h.orig_size) == ()
    out: Dict[str, Any] = {}
    for key, value in entry.items():
        if scalar_param and isinstance(value, Tensor) and value.dim() == 0 and key in per_element:
            out[key] = value.detach().cpu().reshape(1).clone()
        elif isinstance(value, Tensor) and value.dim() > 0:
            if value.numel() != h.shard_numel:
                raise ValueError(
                    f"optimizer state {key!r} of the flat parameter of {lay.path or 'the root'!r} has "
                    f"{value.numel()} elements but the shard has {h.shard_numel}"
                )
            src = value.detach().to(c.compute_device).reshape(-1).contiguous()
            buf = torch.empty(h.padded_numel, dtype=src.dtype, device=src.device)
            collectives.all_gather_into_flat(buf, src, c.process_group)
            # Chunk-and-pad puts all padding at the end, so the first numel elements are the real ones.
            out[key] = buf[: h.numel].cpu()
        elif is_singleton_tensor(value):
            src = value.detach().to(c.compute_device).reshape(1)
            buf = torch.empty(world, dtype=src.dtype, device=src.device)
            collectives.all_gather_into_flat(buf, src, c.process_group)
            out[key] = [buf[i].cpu().clone() for i in range(world)]
        else:
            out[key] = copy.deepcopy(value)
    return out


def _own_state_entries(lay: _Layout, entry: Mapping[str, Any]) -> Dict[int, Dict[str, Any]]:
    """Rank 0's state of an uncollected instance, one entry per original parameter as upstream splits it, when its
    flat state is the whole flat parameter (an expert on a group of one rank: no other rank holds a piece of it).

    It was kept as one flat entry under the instance's first global id, so the dict had fewer entries than the
    unwrapped model's optimizer (upstream's MoE consolidation test counts them). Values that are not per-element
    (``step``, 0-dim tensors) go to every parameter, as for gathered instances. A shard of a larger group stays one
    flat entry (it cannot be split into whole parameters). Both forms load back (:func:`flatten_optim_state_dict`).
    """
    h = lay.instance.handles[0]
    per_element = [v for v in entry.values() if isinstance(v, Tensor) and v.dim() > 0]
    if h.is_sharded and h.shard_numel != h.numel or any(v.numel() < h.numel for v in per_element):
        return {lay.first_gid: _cpu_copy(entry)}
    per_gid: Dict[int, Dict[str, Any]] = {g: {} for g in lay.gids}
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            flat = value.detach().cpu().reshape(-1)[: h.numel]
            for g, shape, piece in zip(lay.gids, lay.shapes, torch.split(flat, lay.numels)):
                per_gid[g][key] = piece.view(shape).clone()
        else:
            for g in lay.gids:
                per_gid[g][key] = value.detach().cpu().clone() if isinstance(value, Tensor) else copy.deepcopy(value)
    return per_gid


def _unflatten(lay: _Layout, gathered: Mapping[str, Any]) -> Dict[int, Dict[str, Any]]:
    """Split a flat parameter's full state into one entry per original parameter (global id)."""
    per_gid: Dict[int, Dict[str, Any]] = {g: {} for g in lay.gids}
    for key, value in gathered.items():
        if isinstance(value, Tensor):
            for g, shape, piece in zip(lay.gids, lay.shapes, torch.split(value, lay.numels)):
                per_gid[g][key] = piece.view(shape).clone()
        else:
            for g in lay.gids:
                per_gid[g][key] = value
    return per_gid


# ---------------------------------------------------------------------------------------------------- shard


def get_shard_from_optim_state_dict(fsdp: FSDPUnit, full_optim_state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """See :meth:`FullyShardedDataParallel.get_shard_from_optim_state_dict`."""
    layouts = _layouts(fsdp)
    full = full_optim_state_dict
    if not isinstance(full, Mapping):
        # gather_full_optim_state_dict() returns None on the ranks other than the recipient.
        raise TypeError(
            "get_shard_from_optim_state_dict expects the dict that gather_full_optim_state_dict() returned on its "
            f"recipient rank (None elsewhere), got {type(full).__name__}. Load (or broadcast) that dict on every "
            "rank, then call this on every rank."
        )
    for key in ("state", "param_groups", "param_id_map"):
        if key not in full:
            raise ValueError(
                f"get_shard_from_optim_state_dict expects a gather_full_optim_state_dict() result, which has "
                f"{key!r}; got keys {sorted(map(str, full))}. Only a per-rank optim.state_dict() of this FSDP model's own "
                "optimizer loads directly (optim.load_state_dict); a torch optimizer's dict over the unwrapped "
                "module is neither: its state is full-size and follows the unwrapped module's parameters"
            )
    param_id_map = _resolved_param_id_map(full["param_id_map"], layouts)
    check_param_counts_before_sharding({"state": full["state"], "param_id_map": param_id_map}, len(layouts))
    uncollected = {int(k) for k in full.get("uncollected_local_ids", [])}
    _check_shapes(full["state"], layouts, uncollected)
    scalar_gids = {g for lay in layouts for g, shape in zip(lay.gids, lay.shapes) if len(shape) == 0}
    flat = flatten_for_model({**full, "param_id_map": param_id_map}, scalar_gids)
    for group in flat["param_groups"]:
        group["params"] = list(range(len(layouts)))
    for local, entry in flat["state"].items():
        lay = layouts[local]
        for key, value in list(entry.items()):
            if local in uncollected:
                # Rank 0's own state, used on every rank as upstream does; shaped as the parameter the optimizer
                # steps (a single non-flat parameter that its group of one rank does not shard keeps its shape).
                entry[key] = _uncollected_value(lay, key, value)
            else:
                entry[key] = _shard_value(lay, key, value)
    return flat


def _resolved_param_id_map(given: Mapping[Any, Any], layouts: List[_Layout]) -> Dict[int, int]:
    """The model's global -> local id map, after checking the dict's map against it (``None`` entries accepted)."""
    expected = {g: lay.local for lay in layouts for g in lay.gids}
    names = {g: lay.names[i] for lay in layouts for i, g in enumerate(lay.gids)}
    keys = sorted(int(g) for g in given)
    if keys != sorted(expected):
        raise ValueError(
            f"the optimizer state dict describes {len(keys)} parameters but this model has {len(expected)} "
            f"({', '.join(list(names.values())[:6])}{', ...' if len(names) > 6 else ''}); was it saved from another "
            "model, or with another wrapping?"
        )
    for g, local in given.items():
        if local is not None and int(local) != expected[int(g)]:
            raise ValueError(
                f"param_id_map maps parameter {int(g)} ({names[int(g)]}) to flat parameter {local}, but in this model "
                f"it belongs to flat parameter {expected[int(g)]}; the model is wrapped differently than when saved"
            )
    return expected


def _check_shapes(state: Mapping[Any, Any], layouts: List[_Layout], uncollected: set) -> None:  # type: ignore[type-arg]
    by_gid = {g: (lay, i) for lay in layouts for i, g in enumerate(lay.gids)}
    for g, entry in state.items():
        if int(g) not in by_gid:
            raise ValueError(
                f"the optimizer state dict has state for parameter {int(g)}, but this model's parameters are "
                f"0..{len(by_gid) - 1}; was it saved from another model, or with another wrapping?"
            )
        lay, i = by_gid[int(g)]
        if lay.local in uncollected:
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(lay.shapes[i]):
                raise ValueError(
                    f"optimizer state {key!r} of parameter {int(g)} ({lay.names[i]}) has shape {tuple(value.shape)} "
                    f"but the model's parameter has shape {tuple(lay.shapes[i])}; was it saved from another model?"
                )


def _stepped_shape(lay: _Layout) -> torch.Size:
    """The shape of the tensor the optimizer steps for this instance: this rank's 1-D shard, or, where the group
    does not shard (one rank), the flat parameter or the single non-flat parameter whole, in its own shape."""
    h = lay.instance.handles[0]
    return torch.Size([h.shard_numel]) if h.is_sharded else torch.Size(h.orig_size)


def _uncollected_value(lay: _Layout, key: str, value: Any) -> Any:
    """Rank 0's saved state of an instance that was not gathered, as the tensor this rank's optimizer steps."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    shape = _stepped_shape(lay)
    if value.numel() == shape.numel():
        return value.reshape(shape).clone()
    if value.numel() == sum(lay.numels):
        # Saved whole (on a group of one rank) and sharded now: shard it as a gathered state.
        return _shard_value(lay, key, value)
    # Saved as rank 0's shard of a larger group, resumed with another shard size: the other ranks' parts are not in
    # the dict (the load was accepted and the next step failed on the shapes).
    raise ValueError(
        f"optimizer state {key!r} of the FullyShardedDataParallel instance at {lay.path or '(root)'!r} (built with "
        f"no_broadcast_optim_state=True, so saved as rank 0's own state) has {value.numel()} elements, but this rank steps {shape.numel()} and the whole "
        f"parameter has {sum(lay.numels)}: either it was saved as one rank's shard at another world size (resume it "
        "at the world size it was saved at), or the state is not element-wise (factored moments, as Adafactor's), "
        "which cannot be resharded. Save that instance's optimizer state per rank instead (optim.state_dict())"
    )


def _shard_value(lay: _Layout, key: str, value: Any) -> Any:
    c, h = lay.instance.config, lay.instance.handles[0]
    if isinstance(value, Tensor) and value.dim() > 0:
        shard = chunk_and_pad(value, c.world_size)[c.rank]
        if shard.numel() != h.shard_numel:  # shapes were checked before: only a bug gets here
            raise RuntimeError(
                f"fairscale internal error: optimizer state {key!r} shards to {shard.numel()} elements, not {h.shard_numel}"
            )
        # The live state has the stepped tensor's shape: a single non-flat parameter on a group of one rank keeps
        # its own (a 1-D state was accepted by load_state_dict and the next step failed on the shapes).
        return shard.reshape(_stepped_shape(lay)).clone()
    if isinstance(value, list) and value and all(is_singleton_tensor(v) for v in value):
        # One value per rank of the saving world; a larger world reuses rank 0's (as upstream).
        return (value[c.rank] if c.rank < len(value) else value[0]).clone()
    return value
