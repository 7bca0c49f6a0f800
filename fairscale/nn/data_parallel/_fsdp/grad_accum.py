# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``optimize_backward_concat``: gradients of the per-parameter views go straight into one flat buffer.

Default autograd path of a flattened parameter (see FlattenParamsWrapper._views_for_forward)::

    view -> SplitWithSizesBackward0 (concatenates all view grads into a new full-size tensor) -> AccumulateGrad(flat)

With the flag, the views come out of :class:`_ViewsIntoFlatBuffer`, a custom autograd function whose backward runs
once, when the gradients of all its views are ready, and adds each view's gradient into its slice of
``handle.grad_accum_flat`` (one persistent buffer per FlatParameter, fp32 under mixed precision). No ``cat``, no
full-size temporary, no flat-level AccumulateGrad. That backward is also the unit's "post-backward" point: it frees
the full parameters and, for a microbatch whose forward ran outside ``no_sync()``, reduce-scatters the buffer once.

Rule (checked): the forward *and* backward of every non-last microbatch run inside ``root.no_sync()``; the
synchronizing microbatch's backward is the last backward of the window. A ``no_sync`` backward that arrives after its
window was reduced raises instead of silently dropping or double-counting gradients.
"""

import functools
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch import Tensor

from .handle import FlatHandle
from .state import TrainingState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import FSDPRuntime


class _NodeInfo:
    """What one forward's views need to know in backward (captured at forward time: the mode is fixed then)."""

    def __init__(self, fsdp: "FSDPRuntime", handle: FlatHandle, numels: List[int], sync: bool) -> None:
        self.fsdp = fsdp
        self.handle = handle
        self.numels = numels
        self.sync = sync
        self.window = handle.grad_window


class _ViewsIntoFlatBuffer(torch.autograd.Function):
    """Views of a flat parameter whose gradients are accumulated into a flat buffer (see module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, info: _NodeInfo, data: Tensor, shapes: List[torch.Size]
    ) -> Tuple[Tensor, ...]:
        # `anchor` is an empty leaf that requires grad: it makes the outputs require grad without linking them to
        # the flat parameter (so no AccumulateGrad on it ever runs).
        ctx.set_materialize_grads(False)  # views that got no gradient arrive as None, not as zero tensors
        ctx.info = info
        return tuple(t.view(s) for t, s in zip(data.split(info.numels), shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, None, None, None]:
        info: _NodeInfo = ctx.info
        accumulate_view_grads(info, grads)
        info.fsdp._on_view_grads_accumulated(info.handle, info.sync)
        return None, None, None, None


@torch.no_grad()
def accumulate_view_grads(info: _NodeInfo, grads: Tuple[Optional[Tensor], ...]) -> None:
    h = info.handle
    if not info.sync and info.window != h.grad_window:
        raise RuntimeError(
            f"optimize_backward_concat: the backward of a no_sync() microbatch of {h.name} ran after the "
            "synchronizing backward of its accumulation window had already reduced the gradients. Rule: the forward "
            "and backward of every non-last microbatch run inside root.no_sync(), and the synchronizing "
            "microbatch's backward is the last backward of the window."
        )
    if h.grad_accum_flat is None:
        buf = torch.zeros(h.numel, dtype=info.fsdp._grad_accum_dtype(), device=info.fsdp.compute_device)
        h.grad_accum_flat = buf
        # One view per parameter slice, made once per window, so each microbatch is a single fused add.
        h.grad_accum_views = list(buf.split(info.numels))
    slices = [v for v, g in zip(h.grad_accum_views, grads) if g is not None]
    present = [g.reshape(-1) for g in grads if g is not None]
    if slices:
        torch._foreach_add_(slices, present)


def build_views(fsdp: "FSDPRuntime", flat: Any) -> List[Tensor]:
    """The FlattenParamsWrapper view builder installed by FSDP when ``optimize_backward_concat`` is on."""
    numels = list(flat._param_numels)
    shapes = list(flat._param_shapes)
    if fsdp.training_state != TrainingState.FORWARD or not torch.is_grad_enabled() or not flat.requires_grad:
        # Outside a training forward (re-flattening after summon, eval): plain views, no gradient path needed.
        return [t.view(s) for t, s in zip(flat.detach().split(numels), shapes)]
    handle = next(h for h in fsdp._handles if h.param is flat)
    info = _NodeInfo(fsdp, handle, numels, sync=fsdp._require_backward_grad_sync)
    return list(_ViewsIntoFlatBuffer.apply(fsdp._grad_anchor, info, flat.detach(), shapes))


def install(fsdp: "FSDPRuntime") -> None:
    """Route the wrapper's views through the flat buffer when the flag applies (flattened params only)."""
    if not fsdp.optimize_backward_concat or not fsdp.flatten_parameters:
        return
    fsdp._grad_anchor = torch.empty(0, requires_grad=True)
    fsdp._fsdp_wrapped_module._view_builder = functools.partial(build_views, fsdp)


def take_buffer_for_reduction(h: FlatHandle) -> Tensor:
    """Hand the window's buffer to the reduction and open a new window."""
    buf = h.grad_accum_flat
    assert buf is not None
    h.grad_accum_flat = None
    h.grad_accum_views = []
    h.grad_window += 1
    return buf
