# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Arbitrary dependencies between autograd lanes, expressed with phony tensors.

``fork`` makes a phony that depends on a tensor; ``join`` makes a tensor depend on a phony. The autograd engine
then runs the backward of the join's lane before the backward of the fork's lane, which is how the pipeline
orders micro-batches and skip connections without copying any data.
"""

from typing import Any, Tuple

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
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_grad: Tensor) -> Tensor:
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Return ``input'`` whose backward runs before the backward of whatever ``phony`` came from."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)
    return input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> Tuple[Tensor, None]:
        return grad_input, None
