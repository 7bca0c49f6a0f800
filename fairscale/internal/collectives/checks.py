# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Argument checks shared by the collectives: paired tensors, in-place tensors, ranks and reduce operations; and
the real view that complex tensors travel as."""

from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import _GroupInfo

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
# torch's ReduceOp of each name, looked up once per name (every all-reduce and reduce-scatter needs one).
_REDUCE_OP_OBJECTS: Dict[str, Any] = {}


def _reduce_op(op: str) -> Any:
    found = _REDUCE_OP_OBJECTS.get(op)
    if found is not None:
        return found
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}")
    found = _REDUCE_OP_OBJECTS[op] = getattr(dist.ReduceOp, _REDUCE_OPS[op])
    return found


def _check_pair(what: str, output: Tensor, input: Tensor) -> None:
    if output.dtype != input.dtype:
        raise ValueError(f"{what}: output dtype {output.dtype} differs from input dtype {input.dtype}; cast first")
    if output.device != input.device:
        raise ValueError(f"{what}: output is on {output.device} but input is on {input.device}; move one of them")
    if not output.is_contiguous():
        raise ValueError(f"{what}: output must be contiguous (it is written in place); pass .contiguous() storage")


def _check_contiguous(what: str, tensor: Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (it is updated in place); pass .contiguous() storage")


def _check_src(what: str, src: int, info: _GroupInfo) -> None:
    if src not in info.ranks:
        raise ValueError(f"{what}: src={src} is not in the group (global ranks {info.ranks}); src is a global rank")


def _real_view(what: str, tensor: Tensor, summing: bool = True) -> Tensor:
    """A complex ``tensor`` as its real view, 1-D (the same bytes: what the collective writes lands in ``tensor``).

    gloo has no complex kernels on several torch releases (2.1 to 2.6 at least), where the dtype check before a call
    (see ``dispatch._dispatch``) refuses complex tensors; torch's own functions make this view for some collectives
    and releases, not all (broadcast only after 2.6). Gathering, broadcasting and summing complex numbers are the same
    operations on their real and imaginary parts; the other reductions have no meaning for them, as
    torch.distributed says too.

    Raises:
        ValueError: ``summing`` is false (a max, min or product).
    """
    if not summing:
        raise ValueError(f"{what}: only a sum has a meaning for complex tensors ({tensor.dtype}); use op='sum'")
    return torch.view_as_real(tensor).view(-1)
