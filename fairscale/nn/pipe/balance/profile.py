# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Per-layer profiling of time and memory, on copies of the layers so the model is left untouched."""

import copy
import time
from typing import Any, Generator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from fairscale.internal.device import DeviceHandle, current_accelerator_device

from ..microbatch import Batch
from ..skip.layout import Namespace
from ..skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["layerwise_sandbox", "detach", "profile_times", "profile_sizes"]

Device = Union[torch.device, int, str]
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Generator[nn.Module, None, None]:
    """Yield a deep copy of each layer, moved to ``device`` and in training mode."""
    for layer in module:
        layer_copy = copy.deepcopy(layer)
        layer_copy.to(device)
        layer_copy.train()
        yield layer_copy


def detach(batch: Batch) -> None:
    """Detach every tensor of ``batch`` in place, keeping its ``requires_grad``."""
    for i, x in enumerate(batch):
        batch[i] = x.detach().requires_grad_(x.requires_grad)


def _own_input(x: Tensor) -> Tensor:
    """``x`` cut from its graph, keeping ``requires_grad``; one that requires grad is a copy, not a leaf, so that a
    layer may change it in place as it does in the model (``ReLU(inplace=True)`` after a ``Linear`` failed with
    "a leaf Variable that requires grad is being used in an in-place operation")."""
    return x.detach().requires_grad_().clone() if x.requires_grad else x.detach()


class _SandboxSkipTracker(SkipTracker):
    """Keeps each stashed tensor cut from the stash layer's graph: that layer's backward frees it before the popping
    layer's runs ("Trying to backward through the graph a second time" for a skip of a computed tensor)."""

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if tensor is not None:
            tensor = _own_input(tensor)
        super().save(batch, ns, name, tensor)


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float, device: torch.device) -> List[int]:
    """Microseconds of forward plus backward of each layer, summed over the passes that fit in ``timeout``."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient")

    handle = DeviceHandle.for_device(device)
    start_batch = Batch(sample, 0)
    for i, x in enumerate(start_batch):
        start_batch[i] = x.detach().to(device).requires_grad_(x.requires_grad)

    time_bufs: List[List[float]] = [[] for _ in module]
    begun_at = time.time()
    while time.time() - begun_at < timeout:
        # Each pass restarts from the sample (a layer's output shape need not fit the first layer), a copy of it:
        # the start batch shares the caller's storage on its device, and a first layer working in place (an
        # inplace Dropout) changed the caller's tensor once per pass, each pass timing the last one's values (a
        # fuzz of Pipe's utilities, session 45).
        copies = tuple(
            x.detach().clone().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in start_batch
        )
        batch = Batch(copies[0] if start_batch.atomic else copies, 0)
        with use_skip_tracker(_SandboxSkipTracker()):
            _time_layers(module, batch, device, handle, time_bufs)

    us = 1_000_000
    return [sum(int(t * us) for t in buf) for buf in time_bufs]


def _time_layers(
    module: nn.Sequential, batch: Batch, device: torch.device, handle: DeviceHandle, time_bufs: List[List[float]]
) -> None:
    for i, layer in enumerate(layerwise_sandbox(module, device)):
        for j, x in enumerate(batch):
            batch[j] = _own_input(x)
        handle.synchronize()
        tick = time.time()
        batch = batch.call(layer)
        backward_tensors = tuple(y for y in batch if y.requires_grad)
        if backward_tensors:
            torch.autograd.backward(backward_tensors, backward_tensors)
        handle.synchronize()
        tock = time.time()
        time_bufs[i].append(tock - tick)


def _micro_batches(chunks: Any) -> int:
    """``chunks`` as Pipe takes it (``int(chunks)``), checked: 0 divided by zero; a negative count made every
    activation size negative."""
    try:
        count = int(chunks) if not isinstance(chunks, bool) else 0
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise ValueError(
            f"balance_by_size: chunks must be a positive integer, got {chunks!r}; pass the number of micro-batches "
            "the Pipe will use"
        )
    return count


def profile_sizes(
    module: nn.Sequential, input: TensorOrTensors, chunks: int, param_scale: float, device: torch.device
) -> List[int]:
    """Bytes of each layer: activations of one sample scaled to a micro-batch, plus ``param_scale`` x parameters."""
    if device.type != "cuda":
        raise ValueError("size profiler supports only CUDA device")
    chunks = _micro_batches(chunks)
    available = current_accelerator_device()
    if available is None or available.type != "cuda":
        # torch's own error was "Torch not compiled with CUDA enabled", from the first allocation count.
        raise ValueError(
            f"balance_by_size: device {device} is not available on this host (the size profiler measures CUDA "
            "allocations); run it on a CUDA host, or balance by time: balance_by_time(..., device='cpu')"
        )
    handle = DeviceHandle.for_device(device)

    batch = Batch(input, 0)
    sizes: List[int] = []
    latent_scale = batch[0].size(0) / chunks
    for i, x in enumerate(batch):
        batch[i] = x[:1].detach().to(device).requires_grad_(x.requires_grad)

    for layer in layerwise_sandbox(module, device):
        for j, x in enumerate(batch):
            batch[j] = _own_input(x)
        memory_before = handle.memory_allocated()
        batch = batch.call(layer)
        memory_after = handle.memory_allocated()
        latent_size = memory_after - memory_before
        # Whole storages, as upstream counts them (a view still keeps its storage alive).
        param_size = sum(p.untyped_storage().nbytes() for p in layer.parameters())
        sizes.append(int(latent_size * latent_scale + param_size * param_scale))
    return sizes
