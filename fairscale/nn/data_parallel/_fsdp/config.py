# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pure helpers that turn constructor arguments into resolved values, with upstream's defaults."""

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from fairscale.internal.device import default_compute_device


def default_gradient_predivide_factor(world_size: int) -> float:
    """Upstream's default pre-divide factor: the largest power of two ``f`` with ``f * f <= world_size``-ish.

    Starting at 1, keep doubling while ``world_size % f == 0`` and ``world_size / f > f``. Dividing half before and
    half after the reduction keeps fp16 gradients away from both overflow and underflow.

    Args:
        world_size: number of ranks the gradient is averaged over.

    Returns:
        The factor gradients are divided by before the reduce-scatter.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def divide_factors(world_size: int, predivide: Optional[float]) -> Tuple[float, float]:
    """(pre, post) divide factors; their product is ``world_size``."""
    pre = default_gradient_predivide_factor(world_size) if predivide is None else float(predivide)
    return pre, world_size / pre


def resolve_compute_device(params: Iterable[nn.Parameter], compute_device: Optional[torch.device]) -> torch.device:
    """The fork's rule: explicit value, else the params' accelerator, else the current accelerator, else CPU."""
    if compute_device is not None:
        return torch.device(compute_device)
    first = next(iter(params), None)
    return default_compute_device(first.device if first is not None else None)


def resolve_compute_dtype(mixed_precision: bool, compute_dtype: Optional[torch.dtype]) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    return torch.float16 if mixed_precision else torch.float32


def validate_param_dtypes(params: Iterable[nn.Parameter], mixed_precision: bool, compute_dtype: torch.dtype) -> None:
    """Upstream's rule: pure fp16 needs fp16 params; every other mode needs fp32 params."""
    pure_fp16 = compute_dtype == torch.float16 and not mixed_precision
    expected = torch.float16 if pure_fp16 else torch.float32
    for p in params:
        if p.dtype != expected:
            if pure_fp16:
                hint = "compute_dtype=torch.float16 without mixed_precision ('pure fp16') needs fp16 parameters"
            else:
                hint = (
                    "parameters must be fp32 (use mixed_precision=True with compute_dtype=torch.bfloat16/float16 "
                    "for low-precision compute; pure bf16 parameters are not supported)"
                )
            raise ValueError(f"FullyShardedDataParallel: found a {p.dtype} parameter of shape {tuple(p.shape)}: {hint}")


def validate_grad_placement(compute_device: torch.device, move_params_to_cpu: bool, move_grads_to_cpu: bool) -> None:
    """A gradient must live on its parameter's device: reject flag pairs that would put them apart.

    On a CPU compute device both always live on the CPU, so any pair works there.
    """
    if compute_device.type == "cpu" or move_params_to_cpu == move_grads_to_cpu:
        return
    if move_grads_to_cpu:
        raise ValueError(
            f"move_grads_to_cpu=True needs move_params_to_cpu=True when computing on {compute_device}: the fp32 "
            "shards (and so the optimizer) live on the compute device and a CPU gradient cannot be assigned to them. "
            "Pass move_params_to_cpu=True to offload both, or leave move_grads_to_cpu unset."
        )
    raise ValueError(
        f"move_params_to_cpu=True with move_grads_to_cpu=False is not supported when computing on {compute_device}: "
        "the fp32 shards live on the CPU, so their gradients must too. Leave move_grads_to_cpu unset (it follows "
        "move_params_to_cpu)."
    )
