# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Autograd-aware communication over the model-parallel group.

Four pairs of forward/backward operations, each the identity when the model-parallel group has
one rank:

=====================================  ==========================  ==========================
function                               forward                     backward
=====================================  ==========================  ==========================
``copy_to_model_parallel_region``      identity                    all-reduce (sum), in place
``reduce_from_model_parallel_region``  all-reduce (sum), in place  identity
``scatter_to_model_parallel_region``   keep my slice of last dim   all-gather along last dim
``gather_from_model_parallel_region``  all-gather along last dim   keep my slice of last dim
=====================================  ==========================  ==========================

The in-place reductions are upstream's (they save a copy): ``reduce_from_model_parallel_region``
overwrites its input with the sum, and the backward of ``copy_to_model_parallel_region``
overwrites the gradient it receives.
"""

from typing import Any, Optional

import torch
from torch import Tensor

from fairscale.internal import collectives

from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .utils import split_tensor_along_last_dim

__all__ = [
    "copy_to_model_parallel_region",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
    "gather_from_model_parallel_region",
]


def _reduce(ctx: Optional[Any], input_: Tensor) -> Tensor:
    """Sum ``input_`` over the model-parallel group in place and return it (marked dirty for autograd)."""
    group = get_model_parallel_group()
    if ctx is not None:
        ctx.mark_dirty(input_)
    if collectives.group_size(group) == 1:
        return input_
    if input_.is_contiguous():
        collectives.all_reduce(input_, group=group)
        return input_
    # A transposed 2-D input (``y.t()``) gets its gradient in that layout too, and ``sum()``'s gradient is an
    # expanded (stride 0) tensor; the in-place all-reduce needs contiguous storage (it failed with "the tensor must be
    # contiguous" in backward). The backward returns the summed copy; the forward writes it back (in place, as
    # upstream).
    summed = input_.contiguous()
    collectives.all_reduce(summed, group=group)
    if ctx is None:
        return summed
    input_.copy_(summed)
    return input_


def _split(input_: Tensor) -> Tensor:
    """This rank's contiguous slice of the last dimension."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return input_
    pieces = split_tensor_along_last_dim(input_, world_size)
    return pieces[get_model_parallel_rank()].contiguous()


def _gather(input_: Tensor) -> Tensor:
    """Concatenate every rank's ``input_`` along the last dimension, in model-parallel rank order."""
    group = get_model_parallel_group()
    world_size = collectives.group_size(group)
    if world_size == 1:
        return input_
    gathered = torch.empty((world_size,) + tuple(input_.shape), dtype=input_.dtype, device=input_.device)
    collectives.all_gather_into_flat(gathered, input_, group=group)
    return torch.cat(gathered.unbind(0), dim=-1).contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: Tensor) -> Tensor:
        return input_

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return _reduce(None, grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: Tensor) -> Tensor:
        return _reduce(ctx, input_)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: Tensor) -> Tensor:
        return _split(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return _gather(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: Tensor) -> Tensor:
        return _gather(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return _split(grad_output)


def copy_to_model_parallel_region(input_: Tensor) -> Tensor:
    """Identity forward; the backward sums the gradient over the model-parallel group (in place)."""
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_: Tensor) -> Tensor:
    """Sum ``input_`` over the model-parallel group, in place (the result is ``input_``); identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_model_parallel_region(input_: Tensor) -> Tensor:
    """Keep this rank's slice of the last dimension; the backward all-gathers the gradient."""
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_: Tensor) -> Tensor:
    """Concatenate every rank's ``input_`` along the last dimension; the backward keeps this rank's slice."""
    return _GatherFromModelParallelRegion.apply(input_)
