# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The parameters a flattened module computes with: detached views of its flat parameter, joined by one autograd node.

Upstream made them as ``flat.split(numels)[i].view(shape)``. Autograd then knows them as outputs of a function
returning several views of one tensor and refuses to use any of them once something changed it in place, even an op
under ``no_grad``; ``F.embedding(..., max_norm=...)`` renormalises its weight in place in every forward and so failed
("a function that returns multiple views"). Here one custom function returns the same views, detached (same storage
and version counter, no autograd view), so an in-place change is an ordinary in-place op on a function's output.

The gradient path is the one ``split`` had, with the same arithmetic: one node (``FlatParamViewsBackward``) that runs
once every view's gradient is in, concatenates them into one flat gradient (zeros for a view that got none, as
``SplitWithSizesBackward`` does) and hands it to the flat parameter's ``AccumulateGrad``. Under ``create_graph=True``
the concatenation is recorded, so double backward works as before.
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal import tensor_hooks

__all__ = ["forward_views"]


class FlatParamViews(torch.autograd.Function):
    """Detached views of a flat parameter shaped like its parameters; backward concatenates their gradients."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, numels: Sequence[int], shapes: Sequence[torch.Size]) -> Tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # a view without a gradient arrives as None (zeros are made only then)
        ctx.numels = numels
        ctx.flat_shape = flat.shape
        return tuple(t.view(s).detach() for t, s in zip(torch.split(flat, list(numels)), shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], None, None]:
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None, None
        numels: Sequence[int] = ctx.numels
        pieces = [g.reshape(-1) if g is not None else like.new_zeros(n) for g, n in zip(grads, numels)]
        return torch.cat(pieces).view(ctx.flat_shape), None, None


def forward_views(flat: Any) -> List[Tensor]:
    """The views of ``flat`` (a FlatParameter) for a forward; plain views when no gradient can flow to it."""
    if not (torch.is_grad_enabled() and flat.requires_grad):
        return list(flat.get_param_views())
    if flat.numel() != sum(flat._param_numels):
        return list(flat.get_param_views())  # raises the size error FlatParameter words
    return list(tensor_hooks.apply_function(FlatParamViews, flat, flat._param_numels, flat._param_shapes))
