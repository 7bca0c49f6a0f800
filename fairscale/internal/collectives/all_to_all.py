# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""All-to-all of equal blocks (mixture of experts, :mod:`fairscale.nn.moe`), with list and all-gather fallbacks."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import _check_pair
from .dispatch import _dispatch, _via_fp32
from .flat import _all_gather
from .groups import ProcessGroup, _GroupInfo, _member_info
from .recording import _record
from .work import WorkHandle, _finish


def all_to_all_single(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """Exchange equal blocks along dim 0: block ``j`` of ``input`` goes to group rank ``j``.

    After the call, block ``i`` of ``output`` on rank ``j`` is block ``j`` of ``input`` on rank ``i``
    (torch's ``all_to_all_single`` with equal splits). A backend without all-to-all for the tensor
    falls back to torch's list variant, then (for fp16/bf16 without kernels) to fp32 blocks, then to an
    all-gather of every input (``size`` x the traffic, but available everywhere).

    Args:
        output (Tensor): contiguous, same shape, dtype and device as ``input``; receives the blocks.
        input (Tensor): dim 0 divisible by the group size; any layout (made contiguous for the wire).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_to_all_single")
    _check_pair("all_to_all_single", output, input)
    if output.shape != input.shape:
        raise ValueError(
            f"all_to_all_single: output shape {tuple(output.shape)} differs from input {tuple(input.shape)}"
        )
    if input.dim() == 0 or input.shape[0] % info.size != 0:
        raise ValueError(
            f"all_to_all_single: dim 0 of the input (shape {tuple(input.shape)}) must divide into {info.size} equal "
            "blocks, one per rank of the group"
        )
    ready_at = _record("all_to_all", info, input.dtype, input.numel(), input.element_size())
    return _finish(_all_to_all(output, input.contiguous(), info, async_op), async_op, ready_at)


def _all_to_all(out: Tensor, inp: Tensor, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(dist.all_to_all_single(out, inp, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        outs = list(out.chunk(info.size))
        return WorkHandle(dist.all_to_all(outs, list(inp.chunk(info.size)), group=info.pg, async_op=async_op))

    def all_gather_variant() -> WorkHandle:
        # Everyone's whole input, then keep block `my rank` of each: size x the traffic, synchronous.
        full = torch.empty((info.size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
        _all_gather(full.view(-1), inp.reshape(-1), info, async_op=False).wait()
        mine = full.view(info.size, info.size, -1)[:, info.rank]
        out.view(info.size, -1).copy_(mine)
        return WorkHandle()

    def fp32_variant() -> WorkHandle:
        # A backend without kernels for the dtype (torch 2.1's gloo has no bf16): the blocks travel as fp32, which
        # holds every fp16/bf16 value exactly, so the exchange is unchanged.
        return _via_fp32(out, inp, lambda o, i: _all_to_all(o, i, info, async_op))

    strategies = [
        ("tensor", tensor_variant),
        ("list", list_variant),
        ("fp32", fp32_variant),
        ("all_gather", all_gather_variant),
    ]
    return _dispatch("all_to_all", info, out.dtype, strategies, out.device.type)
