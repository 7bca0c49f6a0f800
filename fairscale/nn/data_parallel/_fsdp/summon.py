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
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.misc.flatten_params_wrapper import _set_plain_tensor

from .handle import FlatHandle
from .runtime import lazy_init
from .state import HandleState, TrainingState
from .unit import FSDPUnit


def _gather_fp32(unit: FSDPUnit, h: FlatHandle) -> Tensor:
    """The padded full parameter in the parameter dtype (a fresh tensor when sharded; the shard itself if not)."""
    assert h.fp32_shard is not None
    if not h.is_sharded:
        return h.fp32_shard.reshape(-1) if h.fp32_shard.is_contiguous() else h.fp32_shard.flatten()
    shard = h.fp32_shard.to(unit.config.compute_device, non_blocking=True)
    out = torch.empty(h.padded_numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather_into_flat(out, shard, unit.config.process_group)
    return out


_ViewSnapshot = Tuple[List[Tuple[Any, str, Any]], Any]


def _snapshot_views(fpw: Any) -> _ViewSnapshot:
    """The tensors the wrapped modules hold under their parameters' names (the views the last forward made)."""
    attrs = []
    for flat in fpw.flat_params:
        for _, m, n in flat._param_infos:
            attrs.append((m, n, m.__dict__.get(n)))
        for _, _, m, n, _, _ in flat._shared_param_infos:
            attrs.append((m, n, m.__dict__.get(n)))
    return attrs, getattr(fpw._fpw_module, "_unflattened_param_views", None)


def _restore_views(fpw: Any, snapshot: _ViewSnapshot) -> None:
    """Give the modules back the views of :func:`_snapshot_views`.

    Leaving the unflattened context makes fresh views of the flat parameters, whose data is the summoned copy at that
    moment: a checkpointed region recomputed by the pending backward then read those (fp32 under mixed precision:
    a dtype error; outside the optimize_backward_concat graph: gradients silently lost), and they kept the fp32 copy
    of every unit alive until the next forward.
    """
    attrs, views = snapshot
    for m, n, value in attrs:
        if value is not None:
            _set_plain_tensor(m, n, value)
    if views is not None:
        setattr(fpw._fpw_module, "_unflattened_param_views", views)


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
    unit.device.synchronize()
    handles = [h for h in unit.handles if not h.borrowed]
    previous_data = [h.param.data for h in handles]
    with collectives.collective_phase("summon"):
        fulls: List[Tensor] = [_gather_fp32(unit, h) for h in handles]
    unit.transition(TrainingState.SUMMON_FULL_PARAMS)
    unit.summon_volatile = volatile
    snapshot: Optional[_ViewSnapshot] = None
    fpw = unit.wrapped
    try:
        for h, full in zip(handles, fulls):
            h.param.data = full[: h.numel].view(h.orig_size)
        if getattr(fpw, "is_flattened", False) and unit.num_flatten_params > 0:
            flat = [h.param.data for h in handles[: unit.num_flatten_params]]
            snapshot = _snapshot_views(fpw)
            with fpw.unflatten_params(flat_params=flat):
                yield
        else:
            yield
    finally:
        try:
            if not volatile:
                _write_back(unit, handles, fulls)
        finally:
            for h, data in zip(handles, previous_data):
                h.param.data = data
            if snapshot is not None:
                _restore_views(fpw, snapshot)
            unit.transition(TrainingState.IDLE)


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
    with contextlib.ExitStack() as stack:
        for u in targets:
            stack.enter_context(_summon_one(u, volatile))
        yield
