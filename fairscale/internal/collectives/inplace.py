# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Collectives that update one tensor in place: all-reduce, broadcast, and reduce to one rank (OSS, ShardedDDP)."""

from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import Tensor

from .checks import _check_contiguous, _check_src, _real_view, _reduce_op
from .dispatch import _chosen, _dispatch, _forced, _via_fp32
from .groups import ProcessGroup, _GroupInfo, _member_info
from .recording import ACTIVE_COUNTERS, LINKS, _record
from .work import WorkHandle, _finish


def all_reduce(
    tensor: Tensor, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce ``tensor`` in place across the ranks of ``group``.

    Args:
        tensor (Tensor): contiguous tensor, same shape on every rank; holds the result afterwards.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_reduce")
    reduce_op = _reduce_op(op)
    _check_contiguous("all_reduce", tensor)
    if tensor.is_complex() and info.size > 1:
        tensor = _real_view("all_reduce", tensor, op == "sum")

    def issue(t: Tensor) -> Any:
        return dist.all_reduce(t, op=reduce_op, group=info.pg, async_op=async_op)

    return _in_place("all_reduce", tensor, info, async_op, issue)


def broadcast(
    tensor: Tensor, src: int, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place.

    Args:
        tensor (Tensor): contiguous; the data on ``src``, overwritten on the other ranks.
        src (int): the **global** rank that sends (as in ``torch.distributed.broadcast``).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "broadcast")
    _check_src("broadcast", src, info)
    _check_contiguous("broadcast", tensor)
    if tensor.is_complex() and info.size > 1:  # at world size 1 a no-op, also for a conjugated view
        tensor = _real_view("broadcast", tensor)

    def issue(t: Tensor) -> Any:
        return dist.broadcast(t, src=src, group=info.pg, async_op=async_op)

    return _in_place("broadcast", tensor, info, async_op, issue)


def reduce(
    tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce ``tensor`` across the ranks of ``group`` into global rank ``dst``'s ``tensor``.

    Only ``dst`` holds the result afterwards; on the other ranks the content of ``tensor`` is unspecified (some
    backends use it as scratch space).

    Args:
        tensor (Tensor): contiguous, same shape on every rank.
        dst (int): the **global** rank that receives the result (as in ``torch.distributed.reduce``).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "reduce")
    _check_src("reduce", dst, info)
    reduce_op = _reduce_op(op)
    _check_contiguous("reduce", tensor)
    if tensor.is_complex() and info.size > 1:
        tensor = _real_view("reduce", tensor, op == "sum")
    ready_at = _record("reduce", info, tensor.dtype, tensor.numel(), tensor.element_size())

    def issue(t: Tensor) -> Any:
        return dist.reduce(t, dst=dst, op=reduce_op, group=info.pg, async_op=async_op)

    return _finish(_dispatch_in_place("reduce", tensor, info, async_op, issue), async_op, ready_at)


def _in_place(
    name: str, tensor: Tensor, info: _GroupInfo, async_op: bool, issue: Callable[[Tensor], Any]
) -> Optional[WorkHandle]:
    """Run the collective ``name`` on ``tensor``; ``issue`` calls torch's function on ``tensor`` or its fp32 copy.

    Records the call when counters or simulated links are open, and takes the fast path (``issue(tensor)`` and
    nothing else) once the backend's tensor variant is known to work.
    """
    ready_at = None
    if ACTIVE_COUNTERS or LINKS:  # off unless a test or benchmark opens them
        ready_at = _record(name, info, tensor.dtype, tensor.numel(), tensor.element_size())
    # The common case (no simulated link delaying the call, the backend's tensor variant known to work): torch's call
    # and nothing else, as the first strategy of the generic path would make it. A counter only adds its record.
    if ready_at is None and info.size > 1 and not _forced:
        if _chosen.get((info.backend, name, tensor.dtype, tensor.device.type)) == "tensor":
            work = issue(tensor)
            return WorkHandle(work) if async_op else None
    return _finish(_dispatch_in_place(name, tensor, info, async_op, issue), async_op, ready_at)


def _dispatch_in_place(
    name: str, tensor: Tensor, info: _GroupInfo, async_op: bool, issue: Callable[[Tensor], Any]
) -> WorkHandle:
    """The generic path of :func:`_in_place`: the first strategy the backend accepts (torch's call on ``tensor``,
    else on an fp32 copy of it, for a dtype the backend rejects)."""
    if info.size == 1:
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(issue(tensor))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(tensor, tensor, lambda wire, _: _dispatch_in_place(name, wire, info, async_op, issue))

    strategies = [("tensor", tensor_variant), ("fp32", fp32_variant)]
    return _dispatch(name, info, tensor.dtype, strategies, tensor.device.type)
