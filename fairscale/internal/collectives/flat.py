# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""All-gather into, and reduce-scatter from, one flat buffer of any shape (FSDP's parameter and gradient shards)."""

from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from ..version import torch_version
from .checks import _check_pair, _real_view, _reduce_op
from .dispatch import (
    _all_gather_function,
    _all_gather_tensor,
    _dispatch,
    _reduce_scatter_function,
    _reduce_scatter_tensor,
    _chosen,
    _forced,
    _NotApplicable,
    _via_fp32,
)
from .groups import ProcessGroup, _GroupInfo, _member_info
from .recording import ACTIVE_COUNTERS, LINKS, _record
from .work import WorkHandle, _copy_back, _finish

# torch 2.2's gloo reduce-scatters a flat tensor by a fallback that all-reduces the input in place (the caller's
# buffer then holds the whole sum), reduces a strided input's memory as if it were contiguous (wrong sums) and
# refuses async_op=True. torch 2.1 has no such variant, 2.3 a correct one: on 2.2, gloo takes the all-reduce strategy.
_GLOO_FLAT_REDUCE_SCATTER_BROKEN = (2, 2, 0) <= torch_version() < (2, 3, 0)


def all_gather_into_flat(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """All-gather equal-sized pieces into one flat buffer, in group-rank order.

    Args:
        output (Tensor): contiguous, any shape, ``group size * input.numel()`` elements; receives
            the concatenation of every rank's ``input`` (rank 0 first). ``input`` may be a view of
            this rank's part of ``output``.
        input (Tensor): this rank's piece, any shape, same dtype and device as ``output``.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_gather_into_flat")
    if output.dtype is not input.dtype or output.device != input.device or not output.is_contiguous():
        _check_pair("all_gather_into_flat", output, input)  # raises
    if output.numel() != input.numel() * info.size:
        raise ValueError(
            f"all_gather_into_flat: output has {output.numel()} elements but input has {input.numel()} "
            f"and the group has {info.size} ranks; output needs input.numel() * {info.size} = "
            f"{input.numel() * info.size}"
        )
    # 1-D tensors (FSDP's buffers) go to torch as they are: a view of each would cost more than the rest of the call.
    out = output if output.dim() == 1 else output.view(-1)
    inp = input if input.dim() == 1 else input.reshape(-1)
    if info.on_all_gather is not None:  # a proxy group's listener (see groups._build_group_info)
        info.on_all_gather(output, input)
    ready_at = None
    if ACTIVE_COUNTERS or LINKS:  # off unless a test or benchmark opens them
        ready_at = _record("all_gather", info, output.dtype, output.numel(), output.element_size())
    # The common case (no simulated link delaying the call, the backend's tensor variant known to work): torch's call
    # and nothing else, as the first strategy of the generic path would make it. A counter only adds its record.
    if ready_at is None and info.size > 1 and not _forced:
        if _chosen.get((info.backend, "all_gather", out.dtype, out.device.type)) == "tensor":
            work = _all_gather_function()(out, inp, group=info.pg, async_op=async_op)
            return WorkHandle(work) if async_op else None
    return _finish(_all_gather(out, inp, info, async_op), async_op, ready_at)


def _all_gather(out: Tensor, inp: Tensor, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()
    if out.is_complex():  # here, not on the fast path: where gloo lacks complex kernels it is never chosen for them
        return _all_gather(_real_view("all_gather", out), _real_view("all_gather", inp), info, async_op)

    def tensor_variant() -> WorkHandle:
        return WorkHandle(_all_gather_tensor(out, inp, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        return WorkHandle(dist.all_gather(list(out.chunk(info.size)), inp, group=info.pg, async_op=async_op))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(out, inp, lambda o, i: _all_gather(o, i, info, async_op))

    strategies = [("tensor", tensor_variant), ("list", list_variant), ("fp32", fp32_variant)]
    return _dispatch("all_gather", info, out.dtype, strategies, out.device.type)


def reduce_scatter_from_flat(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce a flat buffer across ranks and keep this rank's contiguous chunk.

    Args:
        output (Tensor): contiguous, any shape; receives chunk ``r`` (``r`` = this rank's group
            rank) of the element-wise reduction of every rank's ``input``.
        input (Tensor): ``group size * output.numel()`` elements, any shape or layout (2-D
            buckets included); read in row-major order as ``size`` consecutive chunks.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "reduce_scatter_from_flat")
    if output.dtype is not input.dtype or output.device != input.device or not output.is_contiguous():
        _check_pair("reduce_scatter_from_flat", output, input)  # raises
    reduce_op = _reduce_op(op)
    if input.numel() != output.numel() * info.size:
        raise ValueError(
            f"reduce_scatter_from_flat: input has {input.numel()} elements but output has {output.numel()} "
            f"and the group has {info.size} ranks; input needs output.numel() * {info.size} = "
            f"{output.numel() * info.size}"
        )
    # reshape() copies a non-contiguous input (e.g. the used columns of a 2-D bucket) into the 1-D layout every
    # backend accepts; 1-D tensors (FSDP's gradients) go as they are.
    out = output if output.dim() == 1 else output.view(-1)
    inp = input if input.dim() == 1 else input.reshape(-1)
    ready_at = None
    if ACTIVE_COUNTERS or LINKS:  # off unless a test or benchmark opens them
        ready_at = _record("reduce_scatter", info, input.dtype, input.numel(), input.element_size())
    # The common case (no simulated link delaying the call, the backend's tensor variant known to work): torch's call
    # and nothing else, as the first strategy of the generic path would make it. A counter only adds its record.
    if ready_at is None and info.size > 1 and not _forced:
        if _chosen.get((info.backend, "reduce_scatter", out.dtype, out.device.type)) == "tensor":
            work = _reduce_scatter_function()(out, inp, op=reduce_op, group=info.pg, async_op=async_op)
            return WorkHandle(work) if async_op else None
    return _finish(_reduce_scatter(out, inp, reduce_op, info, async_op), async_op, ready_at)


def _reduce_scatter(out: Tensor, inp: Tensor, op: Any, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()
    if out.is_complex():  # as in _all_gather
        summing = op == _reduce_op("sum")
        real_out, real_in = (_real_view("reduce_scatter", t, summing) for t in (out, inp))
        return _reduce_scatter(real_out, real_in, op, info, async_op)

    def tensor_variant() -> WorkHandle:
        if _GLOO_FLAT_REDUCE_SCATTER_BROKEN and "gloo" in info.backend and out.device.type == "cpu":
            raise _NotApplicable()
        return WorkHandle(_reduce_scatter_tensor(out, inp, op=op, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        chunks = list(inp.chunk(info.size))
        return WorkHandle(dist.reduce_scatter(out, chunks, op=op, group=info.pg, async_op=async_op))

    def all_reduce_variant() -> WorkHandle:
        # Costs size x the traffic, but every backend has all-reduce.
        full = inp.clone()
        work = dist.all_reduce(full, op=op, group=info.pg, async_op=async_op)
        start = info.rank * out.numel()
        return WorkHandle(work, _copy_back(out, full[start : start + out.numel()]))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(out, inp, lambda o, i: _reduce_scatter(o, i, op, info, async_op))

    strategies = [
        ("tensor", tensor_variant),
        ("list", list_variant),
        ("all_reduce", all_reduce_variant),
        ("fp32", fp32_variant),
    ]
    return _dispatch("reduce_scatter", info, out.dtype, strategies, out.device.type)
