# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The parameters a flattened module computes with: detached views of its flat parameter, joined by one autograd node.

Upstream made them as ``flat.split(numels)[i].view(shape)``. Autograd then knows them as outputs of a function
returning several views of one tensor and refuses to use any of them once something changed it in place, even an op
under ``no_grad``; ``F.embedding(..., max_norm=...)`` renormalises its weight in place in every forward and so failed
("a function that returns multiple views"). Here one custom function returns the same views, detached (same storage
and version counter, no autograd view), so an in-place change is an ordinary in-place op on a function's output.

The gradient path is the one ``split`` had, with the same arithmetic: one node (``FlatParamViewsBackward``) that runs
once every view's gradient is in and hands one flat gradient to the flat parameter's ``AccumulateGrad``. Under
``create_graph=True`` the node records a concatenation of the view gradients (zeros for a view that got none, as
``SplitWithSizesBackward`` does), so double backward works as before.

Accumulation (a plain backward into a flat parameter that already has a gradient: every microbatch of a window after
the first) skips the concatenation, which would hold a second full-size copy of the unit's gradients at the busiest
moment of the backward: the node adds each view's gradient into its slice of ``flat.grad`` in place (the elementwise
sums ``AccumulateGrad`` would compute, so bitwise the same) and hands ``AccumulateGrad`` an expanded ``-0.0``, which
it adds in place as well (``x + -0.0`` is ``x`` for every float, signed zeros and NaN included). ``AccumulateGrad``
and its post-accumulate hooks (FSDP's post-backward point) run as before, on the same ``.grad`` tensor; a flat
parameter with tensor hooks (``register_hook``, which would see the gradient before accumulation), a partial
``autograd.grad`` and a ``.grad`` of another dtype, shape or layout keep the concatenation. (A pre-hook put on the
``AccumulateGrad`` node itself, ``register_prehook``, is not looked for: it would see the ``-0.0``.)
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal import tensor_hooks

__all__ = ["forward_views"]

# Whether a torch.func transform is running (present in every torch this package supports; read defensively).
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


class FlatParamViews(torch.autograd.Function):
    """Detached views of a flat parameter shaped like its parameters; backward concatenates their gradients."""

    @staticmethod
    def forward(
        ctx: Any, flat: Tensor, numels: Sequence[int], shapes: Sequence[torch.Size], layout: Optional["_Layout"] = None
    ) -> Tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # a view without a gradient arrives as None (zeros are made only then)
        ctx.numels = numels
        ctx.shapes = shapes
        ctx.flat_shape = flat.shape
        if layout is not None and flat.dim() == 1 and flat.stride(0) == 1:
            # One strided view per parameter, straight from the flat storage: the same elements, shapes and strides
            # as split + view, in two ops per parameter instead of three (this runs for every unit in every forward).
            base = flat.storage_offset()
            return tuple(flat.as_strided(size, stride, base + offset).detach() for size, stride, offset in layout)
        return tuple(t.view(s).detach() for t, s in zip(torch.split(flat, list(numels)), shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], None, None, None]:
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None, None, None
        numels: Sequence[int] = ctx.numels
        target = None if torch.is_grad_enabled() else _grad_to_add_into(ctx, like)
        if target is not None:
            # Slices shaped like the parameters: a gradient with other strides is added as it is, never copied.
            slices = [t.view(s) for t, s in zip(torch.split(target, list(numels)), ctx.shapes)]
            present = [(t, g) for t, g in zip(slices, grads) if g is not None]
            torch._foreach_add_([t for t, _ in present], [g for _, g in present])
            return like.new_full((), -0.0).expand(ctx.flat_shape), None, None, None
        pieces = [g.reshape(-1) if g is not None else like.new_zeros(n) for g, n in zip(grads, numels)]
        return torch.cat(pieces).view(ctx.flat_shape), None, None, None


def _grad_to_add_into(ctx: Any, like: Tensor) -> Optional[Tensor]:
    """``flat.grad`` flattened, when this backward may add the view gradients into it in place (module docstring)."""
    node = ctx.next_functions[0][0]
    flat: Optional[Tensor] = getattr(node, "variable", None)  # an AccumulateGrad node knows its leaf
    if flat is None or flat._backward_hooks:
        return None
    grad = flat.grad
    if grad is None:
        return None
    if grad.dtype != like.dtype or grad.device != like.device or grad.layout != torch.strided:
        return None
    if grad.shape != ctx.flat_shape or not grad.is_contiguous():
        return None
    try:
        # Defensive: without the flat parameter among backward(inputs=...) the engine does not run this node at all.
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad() asking for the flat parameter (it raises for a leaf): nothing accumulates
        return None
    flat_grad: Tensor = grad.view(-1)
    return flat_grad


# Per parameter: its shape, its contiguous strides and its offset in the flat parameter.
_Layout = List[Tuple[torch.Size, Tuple[int, ...], int]]


def _layout(flat: Any) -> _Layout:
    """``flat``'s view layout, computed once per layout (cached on the flat parameter with the lists it came from, so
    that replaced ``_param_numels``/``_param_shapes`` lists, as unpickling makes, are never read stale)."""
    numels, shapes = flat._param_numels, flat._param_shapes
    cached = getattr(flat, "_fpw_view_layout", None)
    if cached is not None and cached[0] is numels and cached[1] is shapes:
        layout: _Layout = cached[2]
        return layout
    layout, offset = [], 0
    for numel, shape in zip(numels, shapes):
        stride, step = [], 1
        for dim in reversed(shape):
            stride.append(step)
            step *= max(dim, 1)
        layout.append((shape, tuple(reversed(stride)), offset))
        offset += numel
    flat._fpw_view_layout = (numels, shapes, layout)
    return layout


def forward_views(flat: Any) -> List[Tensor]:
    """The views of ``flat`` (a FlatParameter) for a forward; plain views when no gradient can flow to it."""
    if not (torch.is_grad_enabled() and flat.requires_grad):
        # Cut from a detached alias (same storage): nothing flows back, and the views must not lead to the flat
        # parameter itself. Under FSDP its data is the full parameter while its .grad is still the reduced shard, and
        # torch.compile, which copies a view's base with that base's .grad, failed on the mismatch ("attempting to
        # assign a gradient of size [55] to a tensor of size [110]") in an evaluation forward after a step.
        return list(flat.get_param_views(flat.detach()))
    if flat.numel() != sum(flat._param_numels) or _transforms_active():
        # The size error FlatParameter words; or split views, as upstream made, inside a torch.func transform (vmap,
        # jacrev, jvp), which refuses an autograd.Function without setup_context (a fuzz, session 46).
        return list(flat.get_param_views())
    return list(
        tensor_hooks.apply_function(FlatParamViews, flat, flat._param_numels, flat._param_shapes, _layout(flat))
    )
