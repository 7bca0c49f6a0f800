# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Batch norms in a DistributedPipeline partition update their running statistics once per micro-batch, in
micro-batch order, as the plain module run micro-batch by micro-batch does.

A partition computes its micro-batches on the RPC threads that deliver their inputs, in whatever order they arrive,
several at once: the running statistics (exponential averages, so the order matters) came out different from run to
run, and a checkpointed micro-batch's recomputation in backward updated them a second time. So while a partition runs
in training mode its plain batch norms do not track statistics (their output is the same: training mode normalises
with the batch's own statistics); each micro-batch's batch mean and variance are recorded instead, and once every
micro-batch of the forward is done they are applied in order, with the layers' own update rule. A recomputation
records nothing, and runs with the same settings as the forward (torch's checkpoint compares what both save).

Layers that manage their statistics themselves are left alone: ``DeferredBatchNorm`` and those with a
``disable_patch_batchnorm`` attribute (the experimental ``SyncBatchNorm``).
"""

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fairscale.nn.pipe.batchnorm import DeferredBatchNorm

__all__ = ["plain_batch_norms", "MicroBatchStatistics"]


def plain_batch_norms(module: nn.Module) -> List[_BatchNorm]:
    """The batch norms of ``module`` whose running statistics this module orders."""
    return [
        m
        for m in module.modules()
        if isinstance(m, _BatchNorm)
        and not isinstance(m, DeferredBatchNorm)
        and not hasattr(m, "disable_patch_batchnorm")
    ]


@contextlib.contextmanager
def _not_tracking(layers: List[_BatchNorm]) -> Iterator[List[_BatchNorm]]:
    """Inside, the layers in training mode that tracked statistics do not (the ones returned). A layer in eval mode
    (frozen inside a training partition) reads its statistics and is left alone."""
    tracking = [
        layer for layer in layers if layer.training and layer.track_running_stats and layer.running_mean is not None
    ]
    for layer in tracking:
        layer.track_running_stats = False
    try:
        yield tracking
    finally:
        for layer in tracking:
            layer.track_running_stats = True


@contextlib.contextmanager
def recomputing(layers: List[_BatchNorm]) -> Iterator[None]:
    """Around a checkpointed micro-batch's recomputation: as its forward ran, recording nothing."""
    with _not_tracking(layers):
        yield


class MicroBatchStatistics:
    """The batch statistics of one forward's micro-batches, per layer, applied in micro-batch order at the end.

    Callers serialise :meth:`recording` (the partition's lock): ``track_running_stats`` is the layers' own flag.
    """

    def __init__(self, layers: List[_BatchNorm]) -> None:
        self.layers = layers
        self._recorded: Dict[int, List[Tuple[_BatchNorm, Tensor, Tensor]]] = {}

    @contextlib.contextmanager
    def recording(self, chunk: int) -> Iterator[None]:
        """Around micro-batch ``chunk``'s forward in training mode."""
        records: List[Tuple[_BatchNorm, Tensor, Tensor]] = []

        def record(layer: nn.Module, inputs: Tuple[Tensor, ...]) -> None:
            x = inputs[0].detach()
            dims = [0] + list(range(2, x.dim()))
            with torch.no_grad():
                stats_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
                x = x.to(stats_dtype)
                records.append((layer, x.mean(dims), x.var(dims, unbiased=True)))  # type: ignore[arg-type]

        with _not_tracking(self.layers) as tracking:
            handles = [layer.register_forward_pre_hook(record) for layer in tracking]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
        self._recorded[chunk] = records

    @torch.no_grad()
    def apply_in_order(self) -> None:
        """Update each layer's running statistics with the recorded micro-batches, in micro-batch order."""
        for chunk in sorted(self._recorded):
            for layer, mean, var in self._recorded[chunk]:
                _update(layer, mean, var)
        self._recorded.clear()


def _update(layer: _BatchNorm, mean: Tensor, var: Tensor) -> None:
    """What the layer's own training forward does to its running statistics, given a batch's mean and variance."""
    assert layer.running_mean is not None and layer.running_var is not None  # recorded only when tracking
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
    if layer.momentum is None:  # a cumulative moving average
        factor = 1.0 / float(layer.num_batches_tracked) if layer.num_batches_tracked is not None else 0.0
    else:
        factor = layer.momentum
    layer.running_mean.mul_(1.0 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    layer.running_var.mul_(1.0 - factor).add_(var.to(layer.running_var.dtype), alpha=factor)
