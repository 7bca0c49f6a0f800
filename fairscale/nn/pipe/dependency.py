# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Arbitrary dependencies between autograd lanes, expressed with phony tensors.

``fork`` makes a phony that depends on a tensor; ``join`` makes a tensor depend on a phony. The autograd engine
then runs the backward of the join's lane before the backward of the fork's lane, which is how the pipeline
orders micro-batches and skip connections without copying any data.
"""

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .phony import get_phony

__all__ = ["fork", "join", "Fork", "Join"]


def fork(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Return ``(input', phony)`` where ``phony`` depends on ``input'`` in the backward pass.

    Without grad (grad mode off or ``input`` not requiring grad) no autograd node is made: ``input`` itself and
    the cached non-grad phony of its device are returned.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        input, phony = Fork.apply(input)
    else:
        phony = get_phony(input.device, requires_grad=False)
    return input, phony


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tuple[Tensor, Tensor]:
        # The phony's gradient runs this backward even when the input lane got none (a pop layer that ignores its
        # input): a materialized zero passed on gave the layers before it zero gradients where the plain model leaves
        # them None (momentum, weight decay and Adam then moved them). Every function of the pipeline's lanes passes
        # "no gradient" on as None (Join, Copy, Wait, the checkpoint's); the ordering edges stay.
        ctx.set_materialize_grads(False)
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Optional[Tensor], grad_grad: Optional[Tensor]) -> Optional[Tensor]:
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Return ``input'`` whose backward runs before the backward of whatever ``phony`` came from."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)
    return input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)  # see Fork
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Optional[Tensor]) -> Tuple[Optional[Tensor], None]:
        return grad_input, None
