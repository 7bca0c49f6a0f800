# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Autograd-aware copies between devices (``Copy``) and stream synchronisation (``Wait``).

On CPU devices the streams are placeholders: ``Copy`` is a same-device ``.to`` and ``Wait`` an identity; the
autograd nodes still exist so the graph has the same shape everywhere.
"""

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .stream import AbstractStream, CPUStream, current_stream, get_device, record_stream, use_stream, wait_stream

__all__ = ["Copy", "Wait"]

Tensors = Tuple[Tensor, ...]


class Context(NamedTuple):
    """The two streams of a copy: read on ``prev_stream``, written for ``next_stream``'s device.

    Both default to :data:`~fairscale.nn.pipe.stream.CPUStream` (a copy between CPU tensors), so ``Context()``
    works as upstream's argument-less ``Context``.
    """

    prev_stream: AbstractStream = CPUStream
    next_stream: AbstractStream = CPUStream

    def reversed(self) -> "Context":
        return Context(self.next_stream, self.prev_stream)


def copy_tensors(streams: Context, tensors: Sequence[Tensor]) -> Tensors:
    """Copy ``tensors`` (non-blocking) from the device of ``prev_stream`` to the device of ``next_stream``.

    Both streams are current during the copies. The sources are recorded on ``prev_stream`` and the results on
    the destination device's current stream, where they will be consumed, so the caching allocator never reuses
    their memory too early.
    """
    prev_stream, next_stream = streams
    target = get_device(next_stream)
    output_stream = current_stream(target)
    output = []
    with use_stream(prev_stream), use_stream(next_stream):
        for x in tensors:
            y = x.to(target, non_blocking=True)
            output.append(y)
            record_stream(x, prev_stream)
            record_stream(y, output_stream)
    return tuple(output)


def _as_inputs_need_grad(ctx: Any, inputs: Sequence[Tensor], outputs: Tensors) -> Tensors:
    """Mark the outputs whose input needs no gradient as such: an autograd Function makes every float output require
    grad when any input does, so an element of a tuple that needs none (a mask, a position table) required one in the
    next partition, unlike in nn.Sequential, and in-place code on it failed in backward (a fuzz of Pipe, session 45).
    """
    frozen = [y for x, y in zip(inputs, outputs) if not x.requires_grad]
    if frozen and len(frozen) < len(outputs):
        ctx.mark_non_differentiable(*frozen)
    return outputs


class Copy(torch.autograd.Function):
    """Copy tensors to the device of ``next_stream``; the backward copies the gradients back."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor) -> Tensors:
        ctx.streams = Context(prev_stream, next_stream)
        ctx.set_materialize_grads(False)  # no gradient stays None (see dependency.Fork)
        return _as_inputs_need_grad(ctx, input, copy_tensors(ctx.streams, input))

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        # Reverse order, as the forward's last copy is the first whose gradient is complete.
        present = [g for g in reversed(grad_output) if g is not None]
        copied = iter(copy_tensors(ctx.streams.reversed(), tuple(present)))
        grads = [None if g is None else next(copied) for g in reversed(grad_output)]
        grad_input: List[Optional[Tensor]] = [None, None]
        grad_input.extend(reversed(grads))
        return tuple(grad_input)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream`` (and the reverse in the backward); values pass through."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor) -> Tensors:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)  # no gradient stays None (see dependency.Fork)
        wait_stream(next_stream, prev_stream)
        return _as_inputs_need_grad(ctx, input, tuple(x.detach() for x in input))

    @staticmethod
    def backward(ctx: Any, *grad_input: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None) + grad_input
