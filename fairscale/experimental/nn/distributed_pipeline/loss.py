# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``DistributedLoss``: evaluate a loss on the worker that owns the model output."""

from typing import Any, Callable

import torch.distributed.rpc as rpc
import torch.nn as nn

__all__ = ["DistributedLoss"]


def _rloss(loss_func: Callable[..., Any], input_rref: rpc.RRef[Any], target_rref: rpc.RRef[Any]) -> Any:
    return loss_func(input_rref.local_value(), target_rref.to_here())


class DistributedLoss(nn.Module):
    """``DistributedLoss(nn.MSELoss)(output_rref, target_rref)`` returns an RRef of the loss, computed where the
    output lives.

    Args:
        loss: the loss class (or any callable building the loss function).
        args, kwargs: the arguments of ``loss``.
    """

    def __init__(self, loss: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.loss = loss(*args, **kwargs)

    def forward(self, input: rpc.RRef[Any], target: rpc.RRef[Any]) -> rpc.RRef[Any]:
        return rpc.remote(input.owner(), _rloss, args=(self.loss, input, target))
