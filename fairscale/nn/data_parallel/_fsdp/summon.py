# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``summon_full_params``: full-precision full parameters for the user, at any point of a step.

Unlike upstream, the summon never touches the training buffers (``full_padded``, zero2 slices): it gathers the fp32
shards into fresh tensors and, on exit, restores ``p.data`` to whatever it pointed at before. That is what makes
``state_dict()`` safe between a forward and its backward: the pending backward still finds the parameters it was
promised, and memory returns to where it was.
"""

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.misc.flatten_params_wrapper import _ViewSnapshot, _UnwritableRebind

from . import recovery
from .handle import FlatHandle
from .param_hooks import check_data_is_the_shard
from .runtime import lazy_init
from .state import HandleState, TrainingState
from .unit import FSDPUnit, unit_of


def _gather_fp32(unit: FSDPUnit, h: FlatHandle) -> Tensor:
    """The padded full parameter in the parameter dtype (a fresh tensor when sharded; the shard itself if not)."""
    assert h.fp32_shard is not None
    if not h.is_sharded:
        return h.fp32_shard.reshape(-1) if h.fp32_shard.is_contiguous() else h.fp32_shard.flatten()
    shard = h.fp32_shard.to(unit.config.compute_device, non_blocking=True)
    out = torch.empty(h.padded_numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather_into_flat(out, shard, unit.config.process_group)
    return out


@contextlib.contextmanager
def _summon_one(unit: FSDPUnit, volatile: bool) -> Iterator[None]:
    lazy_init(unit)
    if unit.training_state == TrainingState.SUMMON_FULL_PARAMS:
        yield  # already summoned by an enclosing call (e.g. state_dict inside summon_full_params)
        return
    if unit.training_state != TrainingState.IDLE:
        raise FairscaleRuntimeError(  # also an AssertionError, as upstream
            f"summon_full_params() called while the instance is in {unit.training_state.name}; it can be used "
            "between steps and between a forward and its backward, but not inside forward or backward."
        )
    for h in unit.handles:  # a p.data = tensor since the last forward: before the gather reads the shard
        check_data_is_the_shard(h)
    unit.device.synchronize()
    owned = [h for h in unit.handles if not h.borrowed]
    lent = _lent_handles(unit)
    handles = owned + [h for _, h in lent]
    previous_data = [h.param.data for h in handles]
    fpw = unit.wrapped
    flattened = getattr(fpw, "is_flattened", False) and unit.num_flatten_params > 0
    # The parameters FlattenParamsWrapper does not unflatten (all of them with flatten_parameters=False) are the
    # modules' own: a rebind of one inside the summon is taken back here, on exit (the flattened ones: by the wrapper).
    plain = handles[unit.num_flatten_params :] if flattened else handles
    places = _places(fpw, plain) if plain else []
    with collectives.collective_phase("summon"):
        fulls: List[Tensor] = [_gather_fp32(unit, h) for h in owned] + [_gather_fp32(u, h) for u, h in lent]
    unit.transition(TrainingState.SUMMON_FULL_PARAMS)
    unit.summon_volatile = volatile
    # Leaving the unflattened context makes fresh views of the flat parameters, whose data is the summoned copy at
    # that moment: a checkpointed region recomputed by a pending backward would read those (fp32 under mixed
    # precision: a dtype error; outside the optimize_backward_concat graph: gradients silently lost), and they kept
    # the fp32 copy of every unit alive until the next forward. The views of the last forward are put back.
    snapshot: Optional[_ViewSnapshot] = None
    problems: List[str] = []
    refused = False  # the wrapper refused a rebind of a flattened parameter: nothing is written back then
    try:
        for h, full in zip(handles, fulls):
            h.param.data = full[: h.numel].view(h.orig_size)
        if flattened:
            flat = [h.param.data for h in handles[: unit.num_flatten_params]]
            snapshot = fpw._snapshot_views()
            try:
                with fpw.unflatten_params(flat_params=flat):
                    yield
            except _UnwritableRebind:
                refused = True
                if not volatile:  # a volatile summon writes nothing back anyway, as with flatten_parameters=False
                    raise
        else:
            yield
    finally:
        try:
            updates, problems = _take_back_rebinds(plain, fulls[len(handles) - len(plain) :], places)
            if snapshot is not None:
                # Before the write-back, which may free the unit's full buffers: freeing one hides the modules'
                # views of it (freed_views.py), so they must be back first, or they point at freed memory.
                fpw._restore_views(snapshot)
                snapshot = None
            if not volatile and not problems and not refused:
                with torch.no_grad():
                    for view, value in updates:
                        view.copy_(value)
                _write_back(unit, handles, fulls)
        finally:
            for h, data in zip(handles, previous_data):
                h.param.data = data
            if snapshot is not None:
                fpw._restore_views(snapshot)
            unit.transition(TrainingState.IDLE)
    if problems and not volatile:
        raise ValueError(
            "summon_full_params: parameters were replaced inside the context by tensors that cannot be written back "
            f"({'; '.join(problems)}); nothing was written back, the model keeps its values. Edit parameters in "
            "place (p.copy_(...)), or replace them by tensors of the same shape."
        )


def _lent_handles(unit: FSDPUnit) -> List[Tuple[FSDPUnit, FlatHandle]]:
    """The owners' handles of the parameters ``unit`` borrowed (``append_shared_param``) whose owner is not summoned.

    A summon of the borrower alone (each instance's ``state_dict()`` summons only itself) left the borrowed parameter
    as the owner's flat shard, so the full state dict listed it, under the borrower's name, as this rank's shard
    (upstream gathers it with the borrower's own parameters). Its owner lies in the same tree (checked at lazy init);
    when the owner is summoned too, the parameter is full already. The same on every rank: summons are collective.
    """
    if not any(h.borrowed for h in unit.handles):
        return []
    root = unit.tree.root() if unit.tree is not None and unit.tree.root is not None else None
    units = root.tree_units() if root is not None else [unit]
    owners = {id(h.param): (u, h) for u in units for h in u.handles if not h.borrowed}
    lent = []
    for h in unit.handles:
        owner = owners.get(id(h.param)) if h.borrowed else None
        if owner is not None and owner[0].training_state != TrainingState.SUMMON_FULL_PARAMS:
            lent.append(owner)
    return lent


_Place = Tuple[nn.Module, str]


def _places(module: nn.Module, handles: List[FlatHandle]) -> List[List[_Place]]:
    """Where each handle's parameter is registered: ``(module, attribute)`` pairs (several for a tied parameter)."""
    index = {id(h.param): i for i, h in enumerate(handles)}
    places: List[List[_Place]] = [[] for _ in handles]
    stack = [module]
    while stack:  # not into nested instances: they hold none of these (and summon their own)
        m = stack.pop()
        stack.extend(child for child in m.children() if unit_of(child) is None)
        for attr, p in m._parameters.items():
            i = index.get(id(p)) if p is not None else None
            if i is not None:
                places[i].append((m, attr))
    return places


def _take_back_rebinds(
    handles: List[FlatHandle], fulls: List[Tensor], places: List[List[_Place]]
) -> Tuple[List[Tuple[Tensor, Tensor]], List[str]]:
    """Give every module its FSDP parameter back and say what the user rebound inside the summon.

    A rebind (``m.weight.data = t``, ``m.weight = nn.Parameter(t)``, ``= None``) was dropped silently before, or left
    a plain parameter in the module that FSDP neither sharded nor reduced (the ranks then trained apart).

    Returns:
        ``(full view, value)`` pairs to copy (a rebind to a tensor of the parameter's shape, any dtype), and what
        cannot be written back (no tensor, or another shape).
    """
    updates: List[Tuple[Tensor, Tensor]] = []
    problems: List[str] = []
    for h, full, where in zip(handles, fulls, places):
        view = full[: h.numel].view(h.orig_size)
        rebound: List[Any] = []  # the distinct values the names of one (tied) parameter were rebound to
        for m, attr in where:
            current = m._parameters[attr] if attr in m._parameters else m.__dict__.get(attr)
            value = h.param.data if current is h.param else current
            if current is not h.param and not any(current is r for r in rebound):
                rebound.append(current)
            if len(rebound) == 2:
                problems.append(
                    f"{h.name}: one tied parameter, rebound to two different tensors (it holds one value for all its "
                    "names; rebind them all to the same tensor)"
                )
            if not isinstance(value, Tensor) or value.shape != view.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                problems.append(f"{h.name}: {shape} where {tuple(view.shape)} was expected")
            elif value.data_ptr() != view.data_ptr():
                updates.append((view, value.detach()))
            if current is not h.param:
                m.__dict__.pop(attr, None)  # a plain attribute set after ``del m.weight``
                m._parameters[attr] = h.param
    return updates, problems


@torch.no_grad()
def _write_back(unit: FSDPUnit, handles: List[FlatHandle], fulls: List[Tensor]) -> None:
    """Copy this rank's slice of each (possibly edited) full tensor back into its fp32 shard."""
    tree = unit.tree
    for h, full in zip(handles, fulls):
        assert h.fp32_shard is not None
        if h.is_sharded:
            h.fp32_shard.copy_(full.narrow(0, h.rank * h.shard_numel, h.shard_numel))
        elif full.data_ptr() != h.fp32_shard.data_ptr():
            h.fp32_shard.copy_(full.view_as(h.fp32_shard))
        # Compute copies gathered before the edit are stale now. Keep them only while a backward is pending on them:
        # that backward must see the weights its forward used.
        if h.state != HandleState.SHARDED and not (tree is not None and tree.backward_pending):
            h.free_full()
            h.drop_zero2_slice()


@contextlib.contextmanager
def summon_full_params(unit: FSDPUnit, recurse: bool, volatile: bool) -> Iterator[None]:
    """See :meth:`FullyShardedDataParallel.summon_full_params`."""
    targets = unit.tree_units() if recurse else [unit]
    # Every handle of the summoned units materialized before the first is summoned: a handle borrowing a parameter
    # of an earlier unit (append_shared_param) took that unit's summoned full tensor as its own shard, and the first
    # forward after the summon failed in its all-gather.
    for u in targets:
        lazy_init(u)
    recovery.recover_between_steps(unit)
    with contextlib.ExitStack() as stack:
        for u in targets:
            stack.enter_context(_summon_one(u, volatile))
        yield


def tree_summoned(unit: FSDPUnit) -> bool:
    """Whether ``unit`` and every unit below it are inside a ``summon_full_params()`` (its full parameters are out).

    ``FullyShardedDataParallel.apply`` there (``model.module.apply(init)`` inside the user's summon, HF's
    ``post_init`` reaching nested instances) runs ``fn`` on them as they are, and that summon's exit writes them
    back; it raised "apply needs every FSDP instance idle" (upstream's assert; found by a fuzz, session 42).
    """
    return all(u.training_state == TrainingState.SUMMON_FULL_PARAMS for u in unit.tree_units())
