# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Activation checkpointing helpers of :class:`~fairscale.experimental.nn.offload.OffloadModel`: what the forward
keeps for its backward, how micro-batches split and join, and what the recomputation takes over from the forward it
repeats and must leave alone.

The recomputation in backward runs a slice a second time, possibly after the caller changed the model's state in
between (``eval()`` for a validation pass, the end of an autocast block). So the forward records, per slice, the
``training`` flag of every module and the autocast state of the compute device, and the recomputation runs under
them; the running statistics of normalisation layers, already updated by the forward, are kept from a second update.
"""

import contextlib
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from fairscale.internal.autocast import AutocastState
from fairscale.internal.errors import FairscaleTypeError
from fairscale.nn.checkpoint._training_flags import TrainingFlags, replay_training_flags, training_flags_of

__all__: List[str] = []

#: Each module of a slice with its ``training`` flag, as the slice's forward saw them.
ModuleModes = TrainingFlags

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

#: The ``training`` flag of every module in a slice (itself included).
module_modes = training_flags_of


@contextlib.contextmanager
def modes_replayed(module: nn.Module, modes: ModuleModes) -> Iterator[None]:
    """Run the block with each module of ``module`` in the ``training`` mode it had at the forward (``modes``, from
    :func:`module_modes`) and with the running statistics of its normalisation layers left alone.

    The flags are set on the attribute (not through ``train()``, which a module may override) and restored, with the
    statistics, even if the block raises.

    Args:
        module (nn.Module): the slice being recomputed.
        modes (ModuleModes): :func:`module_modes` of the slice at its forward.
    """
    # The statistics guard comes after the flags: which layers would update their statistics depends on the
    # forward's modes.
    with replay_training_flags(modes), running_stats_frozen(module):
        yield


def autocast_replayed(device_type: str, state: AutocastState) -> ContextManager[Any]:
    """A context with autocast for ``device_type`` as :func:`~fairscale.internal.autocast.autocast_state` recorded
    it (for the recomputed forward only: the backward pass runs outside autocast, as in the plain model)."""
    enabled, dtype = state
    if dtype is None:  # pragma: no cover - torch < 2.4 off CPU and CUDA: no autocast to replay
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Keep the normalisation layers of ``module`` from updating their running statistics inside the block.

    The recomputation in backward repeats a forward whose statistics update already happened (in the first pass,
    as in the plain model, so that a forward without backward, or one under ``no_grad``, updates them too).

    Batch norm (torch's, :class:`~fairscale.experimental.nn.SyncBatchNorm`) in training mode with
    ``track_running_stats`` off at run time still normalises with the batch statistics, so the output is unchanged and
    only the buffers are left alone. Other layers with running statistics (``InstanceNorm*`` with
    ``track_running_stats=True``) update them whatever that flag says, so they update scratch copies instead, and the
    layer gets its own buffers back afterwards. Everything is restored even if the block raises.

    ``fairscale.nn.checkpoint``'s ``patch_batchnorm`` is not used: it skips the update in every no-grad pass, which
    here is the first pass, so a forward whose backward never runs (validation in training mode, an abandoned
    forward) would leave the statistics as they were, unlike the plain model. It also keeps hooks on the layers.

    Args:
        module (nn.Module): the slice being recomputed.
    """
    updating: List[_NormBase] = [
        m
        for m in module.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats and m.running_mean is not None
    ]
    flagged = [m for m in updating if isinstance(m, _BatchNorm)]
    others = [m for m in updating if not isinstance(m, _BatchNorm)]
    swapped: List[Tuple[_NormBase, str, Tensor]] = []
    try:
        for bn in flagged:
            bn.track_running_stats = False
        for norm in others:
            for name in _STAT_BUFFERS:
                buffer = norm._buffers.get(name)
                if buffer is not None:
                    swapped.append((norm, name, buffer))
                    norm._buffers[name] = buffer.clone()
        yield
    finally:
        for bn in flagged:
            bn.track_running_stats = True
        for norm, name, buffer in swapped:
            norm._buffers[name] = buffer


class InPlaceSafeAlias(torch.autograd.Function):
    """Identity whose output is a new autograd node sharing the input's storage, not a view of it.

    A slice may start with an in-place op (``nn.ReLU(inplace=True)``), as a layer of the plain model may. Torch
    refuses in-place changes to a leaf that requires grad, and to a view returned by a custom Function, but not to
    this output: the change reaches the input's storage (and its version counter, so autograd still catches a change
    to a tensor that an earlier op saved for its backward, as in the plain model).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def checkpoint_inputs(inputs: Tuple[Any, ...]) -> Tuple[Tensor, ...]:
    """The input tensors of a checkpointed call: its one positional argument, a tensor or a tuple of tensors (each
    runs through the slices on its own)."""
    if len(inputs) != 1:
        raise TypeError(
            f"OffloadModel with checkpoint_activation=True takes one positional input (a tensor, or a tuple of "
            f"tensors that each run through the slices), got {len(inputs)}"
        )
    values = inputs[0] if isinstance(inputs[0], tuple) else (inputs[0],)
    if not values or not all(isinstance(v, Tensor) for v in values):
        raise TypeError(
            "OffloadModel with checkpoint_activation=True runs each input through the slices in micro-batches, so "
            f"the input must be a tensor or a non-empty tuple of tensors, got {_describe(inputs[0])}"
        )
    return values


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return "a tuple of (" + ", ".join(type(v).__name__ for v in value) + ")"
    return f"a {type(value).__name__}"


def chunks(x: Tensor, nmb: int) -> Sequence[Tensor]:
    """``x`` split along dim 0 into ``nmb`` micro-batches; a 0-d tensor (no batch dim) is one."""
    return (x,) if x.dim() == 0 else torch.chunk(x, nmb)


def output_rows(outs: List[Tensor]) -> Optional[List[int]]:
    """The dim-0 sizes of a slice's micro-batch outputs (``None`` for a single 0-d output), for :func:`grad_chunks`."""
    return None if any(o.dim() == 0 for o in outs) else [o.shape[0] for o in outs]


def grad_chunks(grad: Optional[Tensor], rows: Optional[List[int]], count: int) -> Sequence[Optional[Tensor]]:
    """The gradient of a slice's joined output, split as the micro-batch outputs were joined.

    By the outputs' rows, not the inputs': a slice that changes the number of rows (``x.reshape(-1, 4)`` of a
    ``(b, 8)`` batch) gave uneven micro-batches gradients of the wrong sizes, and the backward failed in torch's
    shape check (a fuzz, session 45; upstream split the same way).

    Args:
        grad: the gradient (``None`` when nothing depends on the output).
        rows: :func:`output_rows` of the forward's micro-batch outputs.
        count: the number of micro-batches.
    """
    if grad is None:
        return [None] * count
    return (grad,) if rows is None else torch.split(grad, rows)


def join_chunks(outs: List[Tensor], index: int) -> Tensor:
    """The micro-batch outputs of slice ``index`` concatenated along dim 0 (a single 0-d output as it is).

    Raises:
        ValueError: a 0-d output (a reduction over the batch, such as a loss) from one of several micro-batches,
            which cannot be concatenated (torch's error named neither OffloadModel nor the slice).
    """
    if len(outs) == 1 and outs[0].dim() == 0:
        return outs[0]
    if any(o.dim() == 0 for o in outs):
        raise ValueError(
            f"OffloadModel: slice {index} returned a 0-d tensor (a reduction over the batch, such as a loss) for one "
            f"of {len(outs)} micro-batches; with checkpoint_activation=True the micro-batches' outputs are "
            "concatenated along dim 0, which a 0-d tensor does not have: use num_microbatches=1, or compute the "
            "reduction outside the model"
        )
    return torch.cat(outs)


def chunk_output(out: Any, index: int) -> Tensor:
    """``out``, the output of slice ``index`` on one micro-batch, checked to be one tensor.

    With checkpointing each slice runs on each of its inputs separately and the chunks' outputs are concatenated,
    so a slice that returns a tuple (an LSTM's ``(output, (h, c))``) cannot be checkpointed: without this check
    ``torch.cat`` raised a bare TypeError that named neither OffloadModel nor the slice.

    Args:
        out (Any): what the slice returned.
        index (int): the slice's position in the model.

    Returns:
        Tensor: ``out`` itself.

    Raises:
        FairscaleTypeError: ``out`` is not a tensor.
    """
    if not isinstance(out, Tensor):
        raise FairscaleTypeError(
            f"OffloadModel: slice {index} returned a {type(out).__name__}, not a tensor; checkpoint_activation=True "
            "needs each slice to return one tensor (use checkpoint_activation=False for slices that return tuples)"
        )
    return out


def save_slice_inputs(ctx: Any, activations: List[Tuple[Any, ...]]) -> None:
    """Keep each slice's inputs for the backward: the tensors through ``save_for_backward`` (autograd frees them
    after a backward that does not retain the graph, as a plain attribute it did not: every kept loss held a copy of
    every slice's inputs), the other values and the layout on ``ctx``."""
    tensors: List[Tensor] = []
    layout: List[Tuple[Any, ...]] = []
    for inputs in activations:
        entry = []
        for value in inputs:
            if isinstance(value, Tensor):
                entry.append(_SavedTensor(len(tensors)))
                tensors.append(value)
            else:
                entry.append(value)
        layout.append(tuple(entry))
    ctx.save_for_backward(*tensors)
    ctx.slice_input_layout = layout


def saved_slice_inputs(ctx: Any) -> List[Tuple[Any, ...]]:
    """The slice inputs :func:`save_slice_inputs` kept (raises torch's error after the graph was freed)."""
    tensors = ctx.saved_tensors
    return [
        tuple(tensors[v.index] if isinstance(v, _SavedTensor) else v for v in entry) for entry in ctx.slice_input_layout
    ]


class _SavedTensor:
    """Where a saved tensor goes back in a slice's inputs."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def join_grads(collected: List[Optional[Tensor]]) -> Optional[Tensor]:
    """The input gradient of a slice from its micro-batches' (``None`` when a micro-batch has none)."""
    if any(c is None for c in collected):
        return None
    grads = cast(List[Tensor], collected)
    return grads[0] if len(grads) == 1 else torch.cat(grads)
