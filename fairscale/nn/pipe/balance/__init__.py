# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Automatic balancing of a :class:`~fairscale.nn.Pipe` by profiling each layer's time or memory.

Example::

    from fairscale.nn import Pipe
    from fairscale.nn.pipe.balance import balance_by_time

    sample = torch.empty(128, 3, 224, 224)
    balance = balance_by_time(torch.cuda.device_count(), model, sample)
    pipe = Pipe(model, balance, chunks=8)
"""

import math
from typing import Any, List, Tuple, Union

import torch
from torch import Tensor, nn

from fairscale.internal.device import accelerator_available

from . import blockpartition
from .profile import profile_sizes, profile_times

__all__ = ["balance_by_time", "balance_by_size"]

Device = Union[torch.device, int, str]
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


def balance_cost(cost: List[int], partitions: int) -> List[int]:
    """The block lengths of :func:`blockpartition.solve` on ``cost``."""
    partitioned = blockpartition.solve(cost, partitions)
    return [len(p) for p in partitioned]


def _check_partitions(partitions: Any, module: nn.Sequential, what: str) -> None:
    # A float (2.0) failed deep inside the partitioning with a TypeError about range(); a bool counted as 1 or 0.
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"{what}: partitions must be an int, got {type(partitions).__name__} {partitions!r}")
    if partitions > len(module):
        # Raised by the partitioning too, but only after profiling (for the whole timeout of balance_by_time).
        raise ValueError(
            f"{what}: sequence is shorter than intended partitions ({len(module)} < {partitions}): the module has "
            f"{len(module)} layers; ask for at most that many partitions"
        )


def _profiling_device(device: Device, what: str) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool) and not accelerator_available():
        # An accelerator index: torch.device(0) itself failed ("Cannot access accelerator device...").
        raise ValueError(f"{what}: device {device} is not available on this host; pass device='cpu' to profile on CPU")
    dev = torch.device(device)
    if dev.type not in ("cpu", "meta") and not accelerator_available():
        raise ValueError(f"{what}: device {dev} is not available on this host; pass device='cpu' to profile on CPU")
    return dev


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    timeout: float = 1.0,
    device: Device = torch.device("cuda"),
) -> List[int]:
    """Balance by the time each layer takes (forward and backward), measured on ``device``.

    Every layer is timed on a copy (the model, its gradients and its buffers are untouched), repeatedly until
    ``timeout`` seconds have passed.

    Args:
        partitions (int): the number of partitions.
        module (nn.Sequential): the model.
        sample (torch.Tensor or tuple): an example mini-batch (its size matters, not its values).

    Keyword Args:
        timeout (float): seconds of profiling (default ``1.0``).
        device: where to profile (default ``cuda``; pass ``"cpu"`` on a CPU host).

    Returns:
        List[int]: the balance, a number of layers per partition.

    Raises:
        ValueError: a parameter already has a gradient, ``device`` is not available or is ``meta``, or ``timeout``
            is not a positive number.
        TypeError: ``partitions`` is not an int.
    """
    _check_partitions(partitions, module, "balance_by_time")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        # 0, a negative number or NaN ran no measurement and returned an even split, silently.
        raise ValueError(f"balance_by_time: timeout must be a positive number of seconds, got {timeout!r}")
    dev = _profiling_device(device, "balance_by_time")
    if dev.type == "meta":
        # Nothing is computed on meta: the "timings" were the Python overhead of each layer, a meaningless balance.
        raise ValueError(
            "balance_by_time: the meta device runs no computation, so its timings mean nothing; pass the device the "
            "pipe will run on (device='cpu' or an accelerator)"
        )
    return balance_cost(profile_times(module, sample, timeout, dev), partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device = torch.device("cuda"),
) -> List[int]:
    """Balance by the CUDA memory each layer needs: activations for a micro-batch plus scaled parameters.

    Activations are measured on the first sample only and scaled by ``batch size / chunks``.

    Args:
        partitions (int): the number of partitions.
        module (nn.Sequential): the model.
        input (torch.Tensor or tuple): an example mini-batch.

    Keyword Args:
        chunks (int): the number of micro-batches the pipe will use (default ``1``).
        param_scale (float): weight of parameter memory relative to activations (default ``2.0``; about
            ``2`` for SGD, ``3`` with momentum, ``4`` for Adam).
        device: a CUDA device (the profiler measures CUDA allocations).

    Returns:
        List[int]: the balance, a number of layers per partition.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    _check_partitions(partitions, module, "balance_by_size")
    sizes = profile_sizes(module, input, chunks, param_scale, torch.device(device))
    return balance_cost(sizes, partitions)
