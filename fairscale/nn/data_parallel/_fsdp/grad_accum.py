# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``optimize_backward_concat``: gradients of the per-parameter views go straight into one flat buffer.

Default autograd path of a flattened parameter (see FlattenParamsWrapper._views_for_forward)::

    view -> FlatParamViewsBackward (concatenates all view grads into a new full-size tensor) -> AccumulateGrad(flat)

With the flag, the views come out of :class:`_ViewsIntoFlatBuffer`, a custom autograd function whose backward runs
once, when the gradients of all its views are ready, and adds each view's gradient into its slice of
``handle.grad_accum_flat`` (one persistent buffer per FlatParameter, padded like the full parameter). No ``cat``, no
full-size temporary, no flat-level AccumulateGrad. The unit's "post-backward" point runs right after that backward,
in a hook on the AccumulateGrad of an empty per-forward anchor leaf (by then autograd has released the view
gradients, so they never coexist with the reduction's buffers): it frees the full parameters and, for a microbatch
whose forward ran outside ``no_sync()``, reduce-scatters the buffer once.

The flag changes speed and memory, never numerics: the buffer has the dtype of the full parameter the views come
from, which is the dtype the default path accumulates ``flat_param.grad`` in (the compute dtype under mixed
precision, the parameter dtype otherwise; ``fp32_reduce_scatter`` casts to fp32 for the reduction, in both paths).
Each microbatch then adds the same values with the same kernel arithmetic as the default path's AccumulateGrad, so
gradient shards after a window are bitwise equal with the flag on and off. Equal dtypes also keep the per-microbatch
work to one fused ``_foreach_add_`` over the views (a multi-tensor kernel on CUDA; mixed dtypes would fall back to
one kernel per view), into buffer views shaped like the parameters, so nothing in Python runs per view.

The flag's fixed cost per unit and microbatch is Python (the gradient path itself is cheaper than the default one: no
full-size concat), so it is kept small: what never changes for a handle (numels, shapes, owner, device) is computed
once in a :class:`_UnitPlan`, the views are made by one C++ call, and the per-forward state is a slotted object.

Rule (checked): the forward *and* backward of every non-last microbatch run inside ``root.no_sync()``; the
synchronizing microbatch's backward is the last backward of the window. A ``no_sync`` backward that arrives after its
window was reduced raises instead of silently dropping or double-counting gradients.
"""

import functools
import warnings
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal import tensor_hooks
from fairscale.nn.misc._flatten.forward_views import forward_views

from . import reduction
from .handle import FlatHandle
from .state import TrainingState
from .unit import FSDPUnit

_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


class _UnitPlan:
    """What every forward of one flat parameter shares, made once per handle (not per microbatch).

    The per-microbatch cost of the flag is Python per unit; everything here is fixed for the life of the handle
    (its parameter's numels and shapes, its owner and device), so it is computed once and looked up per forward.
    """

    __slots__ = ("_unit_ref", "_handle_ref", "numels", "shapes", "templates", "device", "anchor_grad", "__weakref__")

    def __init__(self, unit: FSDPUnit, handle: FlatHandle, flat: Any) -> None:
        # Weak: the autograd graph holding this plan is kept by the module's views (C++ references the garbage
        # collector cannot see), so a strong reference to the unit would keep a dropped model alive.
        self._unit_ref = weakref.ref(unit)
        self._handle_ref = weakref.ref(handle)
        self.numels: List[int] = list(flat._param_numels)
        self.shapes: List[torch.Size] = list(flat._param_shapes)
        # Shape-only stand-ins: torch's C++ unflatten makes all the views in one call (narrow + view per parameter,
        # the same views as split + view). It gives a zero-size parameter a fresh tensor instead of a view, so a
        # flat parameter holding one keeps the Python split (None here).
        self.templates: Optional[List[Tensor]] = None
        if all(n > 0 for n in self.numels):
            self.templates = [torch.empty(s, device="meta") for s in self.shapes]
        self.device = unit.config.compute_device
        # The anchor's (empty) gradient lives on the compute device: autograd runs a node on the worker thread of its
        # inputs' device, so the anchor's AccumulateGrad (where the post-backward point runs) stays on the same
        # thread as the rest of this unit's backward instead of racing it from the CPU thread. Never written to, so
        # one tensor serves every forward.
        self.anchor_grad = torch.empty(0, device=self.device)

    def valid_for(self, unit: FSDPUnit, handle: FlatHandle) -> bool:
        """Whether this plan still describes ``handle`` of ``unit`` (a copied model gets plans of its own)."""
        return self._unit_ref() is unit and self._handle_ref() is handle and self.device == unit.config.compute_device

    def views(self, data: Tensor) -> Tuple[Tensor, ...]:
        """Views of ``data`` shaped like the parameters, in order."""
        if self.templates is not None:
            return tuple(tensor_hooks.unflatten_like(data, self.templates))
        return tuple(t.view(s) for t, s in zip(torch.split(data, self.numels), self.shapes))


# One plan per handle, dropped with it (handles are pickled and copied with their model; a plan holds weak
# references, so it is kept beside the handle rather than on it).
_PLANS: "weakref.WeakKeyDictionary[FlatHandle, _UnitPlan]" = weakref.WeakKeyDictionary()


class _NodeInfo:
    """What one forward's views need to know in backward (captured at forward time: the mode is fixed then)."""

    __slots__ = ("plan", "dtype", "sync", "window")

    def __init__(self, plan: _UnitPlan, dtype: torch.dtype, sync: bool, window: int) -> None:
        self.plan = plan
        # The dtype of the full parameter the views come from: the accumulation buffer's (see module docstring).
        self.dtype = dtype
        self.sync = sync
        self.window = window

    @property
    def numels(self) -> List[int]:
        return self.plan.numels

    @property
    def handle(self) -> FlatHandle:
        handle = self.plan._handle_ref()
        if handle is None:
            raise RuntimeError("optimize_backward_concat: backward through the graph of a deleted FSDP model")
        return handle

    @property
    def unit(self) -> FSDPUnit:
        unit = self.plan._unit_ref()
        if unit is None:
            raise RuntimeError("optimize_backward_concat: backward through the graph of a deleted FSDP model")
        return unit


class _ViewsIntoFlatBuffer(torch.autograd.Function):
    """Views of a flat parameter whose gradients are accumulated into a flat buffer (see module docstring)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, flat: Tensor, info: _NodeInfo, data: Tensor) -> Tuple[Tensor, ...]:
        # `anchor` is an empty leaf that requires grad: the usual backward sends it an empty gradient, and the
        # post-backward point runs in its AccumulateGrad hook. `flat` (the flat parameter) gets a gradient only from
        # a partial backward that does not reach the anchor (see backward).
        ctx.set_materialize_grads(False)  # views that got no gradient arrive as None, not as zero tensors
        ctx.info = info
        # Detached: outputs of a custom Function that are views of one tensor may not be modified in place, not even
        # under no_grad (autograd cannot rebase them), which broke F.embedding(..., max_norm=...): it renormalises
        # the weight in place. Detached views share the storage (and version counter) but are not autograd views.
        return tuple(v.detach() for v in info.plan.views(data))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor], None, None]:
        info: _NodeInfo = ctx.info
        anchor_node = ctx.next_functions[0][0]
        if anchor_node is not None and not torch._C._will_engine_execute_node(anchor_node):
            # backward(inputs=...) or autograd.grad() asking for the flat parameter: answer exactly as the default
            # path does (one concatenated gradient for it), and leave the accumulation buffer alone.
            return None, _concat(info, grads), None, None
        flat = getattr(ctx.next_functions[1][0], "variable", None)
        if flat is not None and flat._backward_hooks:
            # Registered after this forward chose the buffer's path (build_views): torch calls it with None. Said,
            # not raised: a raise on the ranks that registered it left the others waiting in the reduction.
            warnings.warn(
                f"optimize_backward_concat: a hook was registered on FSDP parameter "
                f"{info.unit.qualified_name(info.handle.name)!r} (p.register_hook) between a forward and its "
                "backward; that forward sums its gradient into the accumulation buffer, so torch calls the hook with "
                "None for it. Register such hooks before the forward: a flat parameter with hooks takes the default "
                "path from its next forward."
            )
        if torch.is_grad_enabled():  # backward(create_graph=True): the buffer must not join the graph
            with torch.no_grad():
                accumulate_view_grads(info, grads)
        else:  # the usual backward already runs without grad mode (and a no_grad context costs per unit)
            accumulate_view_grads(info, grads)
        # The (empty) gradient of the anchor makes autograd run the anchor's AccumulateGrad right after this node,
        # once this node's incoming view gradients are released: the post-backward point runs there (_after_views),
        # so the reduction's temporaries never coexist with the view gradients.
        return info.plan.anchor_grad, None, None, None


def _concat(info: _NodeInfo, grads: Tuple[Optional[Tensor], ...]) -> Optional[Tensor]:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    like = present[0]
    return torch.cat([g.reshape(-1) if g is not None else like.new_zeros(n) for g, n in zip(grads, info.numels)])


def _after_views(info: _NodeInfo, anchor: Tensor) -> None:
    anchor.grad = None
    unit = info.unit
    # The backward's no_sync() context decides, as on the flag-off path: a forward outside with its backward inside
    # accumulates (it issued its reduce-scatter, and the end of that backward failed on the unflushed reduction), a
    # forward inside with its backward outside reduces the window (it took the forward's context and did not, and the
    # reduced shards came out wrong, silently; found by a fuzz, session 43).
    reduction.on_view_grads_accumulated(unit, info.handle, unit.require_backward_grad_sync)


def _new_buffer(info: _NodeInfo, h: FlatHandle) -> List[Tensor]:
    """Open the window's buffer; returns its views, one per parameter and shaped like it.

    The views are made once per window, so gradients are added without a reshape.
    """
    return h.open_accum_buffer(info.dtype, info.plan.device, info.plan.views)


def accumulate_view_grads(info: _NodeInfo, grads: Tuple[Optional[Tensor], ...]) -> None:
    """Add this microbatch's view gradients into the window's buffer (called with grad mode off)."""
    h = info.handle
    if not info.sync and info.window != h.grad_window:
        raise RuntimeError(
            f"optimize_backward_concat: the backward of a no_sync() microbatch of {h.name} ran after the "
            "synchronizing backward of its accumulation window had already reduced the gradients. Rule: the forward "
            "and backward of every non-last microbatch run inside root.no_sync(), and the synchronizing "
            "microbatch's backward is the last backward of the window."
        )
    first = h.grad_accum_flat is None
    views = _new_buffer(info, h) if first else h.grad_accum_views
    try:
        # The common case costs no Python per view: the fused op's argument parser rejects a None (a view that got
        # no gradient) before any element is written, so the loop below only runs for unused parameters.
        if not first:
            torch._foreach_add_(views, grads)  # type: ignore[arg-type]
        elif _HAS_FOREACH_COPY:
            # The first microbatch writes instead of adding into zeros (one pass over the buffer, not two), as the
            # default path's AccumulateGrad takes the first gradient as is.
            torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
        else:  # torch < 2.2 has no fused copy
            for v, g in zip(views, grads):
                v.copy_(g)  # type: ignore[arg-type]
        return
    except TypeError:
        if all(g is not None for g in grads):
            raise
    _accumulate_some(views, grads, first)


def _accumulate_some(views: List[Tensor], grads: Tuple[Optional[Tensor], ...], first: bool) -> None:
    """The microbatch left some views without a gradient (unused parameters): they add nothing (zero if first)."""
    if first:
        for v, g in zip(views, grads):
            if g is None:
                v.zero_()
    pairs = [(v, g) for v, g in zip(views, grads) if g is not None]
    if not pairs:
        return
    dst, src = [v for v, _ in pairs], [g for _, g in pairs]
    if first:
        for v, g in pairs:
            v.copy_(g)
    else:
        torch._foreach_add_(dst, src)


def _plan_for(unit: FSDPUnit, flat: Any) -> _UnitPlan:
    handle = next(h for h in unit.handles if h.param is flat)
    plan = _PLANS.get(handle)
    if plan is None or not plan.valid_for(unit, handle):
        plan = _PLANS[handle] = _UnitPlan(unit, handle, flat)
    return plan


def build_views(unit: FSDPUnit, flat: Any) -> List[Tensor]:
    """The FlattenParamsWrapper view builder installed by FSDP when ``optimize_backward_concat`` is on."""
    if unit.training_state != TrainingState.FORWARD or not torch.is_grad_enabled() or not flat.requires_grad:
        # Outside a training forward (re-flattening after summon, eval): plain views, no gradient path needed.
        return [t.view(s) for t, s in zip(flat.detach().split(flat._param_numels), flat._param_shapes)]
    if flat._backward_hooks:
        # A hook of the user's on the flat parameter (p.register_hook) sees and may change its gradient: the
        # buffer's path bypasses the parameter's AccumulateGrad and handed it None (a fuzz, session 49). The
        # default views feed flat_param.grad, as with the flag off.
        _continue_in_param_grad(next(h for h in unit.handles if h.param is flat))
        return forward_views(flat)
    plan = _plan_for(unit, flat)
    handle: FlatHandle = plan._handle_ref()  # type: ignore[assignment]  # alive: the unit holds it
    info = _NodeInfo(plan, flat.dtype, unit.require_backward_grad_sync, handle.grad_window)
    # A fresh anchor per forward: its AccumulateGrad has exactly one producer, this forward's node.
    anchor = torch.empty(0, device=plan.device, requires_grad=True)
    tensor_hooks.register_post_accumulate_grad_hook(anchor, functools.partial(_after_views, info))
    return list(tensor_hooks.apply_function(_ViewsIntoFlatBuffer, anchor, flat, info, flat.detach()))


def _continue_in_param_grad(h: FlatHandle) -> None:
    """A window whose earlier microbatches summed into the buffer goes on in ``flat_param.grad`` (the default path).

    ``p.grad`` shows the buffer's view between microbatches (:meth:`FlatHandle.leave_window_grad`); it becomes an
    ordinary full-size gradient, the one autograd adds to. Kept as the window buffer, it was taken in again once
    autograd had added to it out of place (``view + new``): the earlier microbatches counted twice.
    """
    h.drop_window_if_cleared()  # a zero_grad() since the last backward drops the window first, as at a backward
    if h.grad_accum_flat is None or h.grad_accum_grad is None or h.param.grad is not h.grad_accum_grad:
        return  # no buffer, or p.grad replaced by hand: the buffer takes that in at the end of the backward
    h.grad_accum_flat = None
    h.grad_accum_views = []
    h.grad_accum_grad = None
    h.leave_window_grad()  # remembers p.grad as the window's gradient (what a zero_grad() is seen on)


def install(unit: FSDPUnit) -> None:
    """Route the wrapper's views through the flat buffer when the flag applies (flattened params only)."""
    if not unit.config.optimize_backward_concat or not unit.config.flatten_parameters:
        return
    unit.wrapped._view_builder = functools.partial(build_views, unit)
