# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``DistributedLoss``: evaluate a loss on the worker that owns the model output."""

import functools
from typing import Any, Callable

import torch.distributed.rpc as rpc

__all__ = ["DistributedLoss"]


def _rloss(loss_func: Callable[..., Any], input_rref: rpc.RRef[Any], target_rref: rpc.RRef[Any]) -> Any:
    return loss_func(input_rref.local_value(), target_rref.to_here())


def _remote_loss(loss_func: Callable[..., Any], input: rpc.RRef[Any], target: rpc.RRef[Any]) -> rpc.RRef[Any]:
    return rpc.remote(input.owner(), _rloss, args=(loss_func, input, target))


def DistributedLoss(loss: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., rpc.RRef[Any]]:
    """``DistributedLoss(nn.MSELoss)(output_rref, target_rref)`` returns an RRef of the loss, computed where the
    output lives.

    Args:
        loss: the loss class (or any callable building the loss function).
        args, kwargs: the arguments of ``loss``.

    Returns:
        A function ``(input_rref, target_rref) -> RRef`` (a ``functools.partial``, so it pickles).
    """
    return functools.partial(_remote_loss, loss(*args, **kwargs))
