# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``optimize_backward_concat``: gradients of the per-parameter views go straight into one flat buffer.

Default autograd path of a flattened parameter (see FlattenParamsWrapper._views_for_forward)::

    view -> SplitWithSizesBackward0 (concatenates all view grads into a new full-size tensor) -> AccumulateGrad(flat)

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

Rule (checked): the forward *and* backward of every non-last microbatch run inside ``root.no_sync()``; the
synchronizing microbatch's backward is the last backward of the window. A ``no_sync`` backward that arrives after its
window was reduced raises instead of silently dropping or double-counting gradients.
"""

import functools
import weakref
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch import Tensor

from .handle import FlatHandle
from .state import TrainingState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import FSDPRuntime


class _NodeInfo:
    """What one forward's views need to know in backward (captured at forward time: the mode is fixed then)."""

    def __init__(
        self,
        fsdp: "FSDPRuntime",
        handle: FlatHandle,
        numels: List[int],
        shapes: List[torch.Size],
        dtype: torch.dtype,
        sync: bool,
    ) -> None:
        # Weak: the autograd graph holding this info is kept by the module's views (C++ references the garbage
        # collector cannot see), so a strong reference to the instance would keep a dropped model alive.
        self._fsdp_ref = weakref.ref(fsdp)
        self._handle_ref = weakref.ref(handle)
        self.numels = numels
        self.shapes = shapes
        # The dtype of the full parameter the views come from: the accumulation buffer's (see module docstring).
        self.dtype = dtype
        self.sync = sync
        self.window = handle.grad_window
        # The anchor and its (empty) gradient live on the compute device: autograd runs a node on the worker thread
        # of its inputs' device, so the anchor's AccumulateGrad (where the post-backward point runs) stays on the
        # same thread as the rest of this unit's backward instead of racing it from the CPU thread.
        self.anchor_grad = torch.empty(0, device=fsdp.compute_device)

    @property
    def handle(self) -> FlatHandle:
        handle = self._handle_ref()
        if handle is None:
            raise RuntimeError("optimize_backward_concat: backward through the graph of a deleted FSDP model")
        return handle

    @property
    def fsdp(self) -> "FSDPRuntime":
        fsdp = self._fsdp_ref()
        if fsdp is None:
            raise RuntimeError("optimize_backward_concat: backward through the graph of a deleted FSDP model")
        return fsdp


class _ViewsIntoFlatBuffer(torch.autograd.Function):
    """Views of a flat parameter whose gradients are accumulated into a flat buffer (see module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, flat: Tensor, info: _NodeInfo, data: Tensor, shapes: List[torch.Size]
    ) -> Tuple[Tensor, ...]:
        # `anchor` is an empty leaf that requires grad: the usual backward sends it an empty gradient, and the
        # post-backward point runs in its AccumulateGrad hook. `flat` (the flat parameter) gets a gradient only from
        # a partial backward that does not reach the anchor (see backward).
        ctx.set_materialize_grads(False)  # views that got no gradient arrive as None, not as zero tensors
        ctx.info = info
        return tuple(t.view(s) for t, s in zip(data.split(info.numels), shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor], None, None, None]:
        info: _NodeInfo = ctx.info
        anchor_node = ctx.next_functions[0][0]
        if anchor_node is not None and not torch._C._will_engine_execute_node(anchor_node):
            # backward(inputs=...) or autograd.grad() asking for the flat parameter: answer exactly as the default
            # path does (one concatenated gradient for it), and leave the accumulation buffer alone.
            return None, _concat(info, grads), None, None, None
        if torch.is_grad_enabled():  # backward(create_graph=True): the buffer must not join the graph
            with torch.no_grad():
                accumulate_view_grads(info, grads)
        else:  # the usual backward already runs without grad mode (and a no_grad context costs per unit)
            accumulate_view_grads(info, grads)
        # The (empty) gradient of the anchor makes autograd run the anchor's AccumulateGrad right after this node,
        # once this node's incoming view gradients are released: the post-backward point runs there (_after_views),
        # so the reduction's temporaries never coexist with the view gradients.
        return info.anchor_grad, None, None, None, None


def _concat(info: _NodeInfo, grads: Tuple[Optional[Tensor], ...]) -> Optional[Tensor]:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    like = present[0]
    return torch.cat([g.reshape(-1) if g is not None else like.new_zeros(n) for g, n in zip(grads, info.numels)])


def _after_views(info: _NodeInfo, anchor: Tensor) -> None:
    anchor.grad = None
    info.fsdp._on_view_grads_accumulated(info.handle, info.sync)


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
    if first:
        # Padded like the full parameter (shard_numel * world_size) so the reduce-scatter reads this buffer as is,
        # without a padded copy. One view per parameter, shaped like it (the gradients are added without a reshape),
        # made once per window.
        padded = h.shard_numel * h.world_size if h.is_sharded else h.numel
        buf = torch.empty(padded, dtype=info.dtype, device=info.fsdp.compute_device)
        buf[h.numel :].zero_()
        h.grad_accum_flat = buf
        h.grad_accum_views = [v.view(s) for v, s in zip(buf[: h.numel].split(info.numels), info.shapes)]
    views: List[Tensor] = h.grad_accum_views
    present: List[Tensor] = list(grads)  # type: ignore[arg-type]  # checked just below
    if any(g is None for g in grads):  # views that got no gradient in this microbatch (unused parameters)
        if first:
            for v, g in zip(views, grads):
                if g is None:
                    v.zero_()
        views = [v for v, g in zip(views, grads) if g is not None]
        present = [g for g in grads if g is not None]
        if not present:
            return
    if first:
        # The first microbatch writes instead of adding into zeros (one pass over the buffer, not two), as the
        # default path's AccumulateGrad takes the first gradient as is.
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(views, present)
        else:  # torch < 2.2 has no fused copy
            for v, g in zip(views, present):
                v.copy_(g)
    else:
        torch._foreach_add_(views, present)


def build_views(fsdp: "FSDPRuntime", flat: Any) -> List[Tensor]:
    """The FlattenParamsWrapper view builder installed by FSDP when ``optimize_backward_concat`` is on."""
    numels = list(flat._param_numels)
    shapes = list(flat._param_shapes)
    if fsdp.training_state != TrainingState.FORWARD or not torch.is_grad_enabled() or not flat.requires_grad:
        # Outside a training forward (re-flattening after summon, eval): plain views, no gradient path needed.
        return [t.view(s) for t, s in zip(flat.detach().split(numels), shapes)]
    handle = next(h for h in fsdp._handles if h.param is flat)
    info = _NodeInfo(fsdp, handle, numels, shapes, flat.dtype, sync=fsdp._require_backward_grad_sync)
    # A fresh anchor per forward: its AccumulateGrad has exactly one producer, this forward's node.
    anchor = torch.empty(0, device=fsdp.compute_device, requires_grad=True)
    anchor.register_post_accumulate_grad_hook(functools.partial(_after_views, info))
    return list(_ViewsIntoFlatBuffer.apply(anchor, flat, info, flat.detach(), shapes))


def install(fsdp: "FSDPRuntime") -> None:
    """Route the wrapper's views through the flat buffer when the flag applies (flattened params only)."""
    if not fsdp.optimize_backward_concat or not fsdp.flatten_parameters:
        return
    fsdp._fsdp_wrapped_module._view_builder = functools.partial(build_views, fsdp)


def take_buffer_for_reduction(h: FlatHandle) -> Tensor:
    """Hand the window's buffer to the reduction and open a new window."""
    buf = h.grad_accum_flat
    assert buf is not None
    h.grad_accum_flat = None
    h.grad_accum_views = []
    h.grad_window += 1
    return buf
