# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``DistributedLoss``: evaluate a loss on the worker that owns the model output.

The loss runs as an ``async_execution`` RPC that does not wait in its handler (see the threading design in
:mod:`.partition_handler`): the target is fetched with ``rpc_async`` and the loss is computed in the callback that
receives it. Both RRefs must already hold their values (``DistributedPipeline.forward``'s output and
``rpc.RRef(tensor)`` do), so that reading them in a handler never waits.
"""

import functools
from typing import Any, Callable

import torch.distributed.rpc as rpc
from torch.futures import Future

from .partition_handler import _async_execution, _rpc_error

__all__ = ["DistributedLoss"]


def _local_value(rref: rpc.RRef[Any]) -> Any:
    """Runs on the owner of ``rref``."""
    return rref.local_value()


def _loss_of(loss_func: Callable[..., Any], input_rref: rpc.RRef[Any], target: "Future[Any]") -> Any:
    try:
        return loss_func(input_rref.local_value(), target.value())
    except Exception as e:  # returned, so that the loss RRef raises it as itself rather than as a RuntimeError
        return _rpc_error(e)


@_async_execution
def _rloss(loss_func: Callable[..., Any], input_rref: rpc.RRef[Any], target_rref: rpc.RRef[Any]) -> "Future[Any]":
    """Runs on the owner of ``input_rref``; returns at once with a future of the loss."""
    target: "Future[Any]"
    if target_rref.is_owner():
        target = Future()
        target.set_result(target_rref.local_value())
    else:
        # Not to_here(), which would hold this RPC thread until the owner replies.
        target = rpc.rpc_async(target_rref.owner(), _local_value, args=(target_rref,))
    return target.then(functools.partial(_loss_of, loss_func, input_rref))


def _remote_loss(loss_func: Callable[..., Any], input: rpc.RRef[Any], target: rpc.RRef[Any]) -> rpc.RRef[Any]:
    return rpc.remote(input.owner(), _rloss, args=(loss_func, input, target))


def DistributedLoss(loss: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., rpc.RRef[Any]]:
    """``DistributedLoss(nn.MSELoss)(output_rref, target_rref)`` returns an RRef of the loss, computed where the
    output lives.

    Args:
        loss: the loss class (or any callable building the loss function).
        args, kwargs: the arguments of ``loss``.

    Returns:
        A function ``(input_rref, target_rref) -> RRef`` (a ``functools.partial``, so it pickles). Both RRefs
        must hold their values already (``DistributedPipeline``'s output and ``rpc.RRef(tensor)`` do); the target
        may live on any worker.
    """
    return functools.partial(_remote_loss, loss(*args, **kwargs))
