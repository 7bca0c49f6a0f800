# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pure helpers that turn constructor arguments into resolved values, with upstream's defaults."""

from typing import Any, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fairscale.internal.device import default_compute_device
from fairscale.internal.parallel import ProcessGroupName, get_process_group_cached


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
    """``compute_dtype``, else fp16 with mixed precision, else fp32. Rejects what no forward could run in.

    Raises:
        ValueError: ``compute_dtype`` is not a floating-point ``torch.dtype`` (at construction, rather than as an
            unrelated error deep in the first forward).
    """
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(
                f"compute_dtype must be a floating-point torch.dtype (torch.float32, torch.float16 or "
                f"torch.bfloat16), got {compute_dtype!r}"
            )
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


def _is_member(group: Any) -> bool:
    if group is None or isinstance(group, ProcessGroupName) or isinstance(group, str):
        return True  # a name: FSDP creates (or reuses) a group over all ranks
    if group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    ):
        return False
    rank = getattr(group, "rank", None)
    return not callable(rank) or int(rank()) >= 0


def check_group_membership(process_group: Any, process_group_reduce_scatter: Any) -> None:
    """Raise a clear ``ValueError`` when this rank is not a member of a group it was given.

    ``dist.new_group(ranks)`` returns ``GroupMember.NON_GROUP_MEMBER`` on the ranks outside ``ranks``; an FSDP
    instance cannot shard over a group it is not in. Before raising, the rank makes the same group-creation calls
    as a member would at construction (the cached reduce-scatter group): ``new_group`` is collective over the
    whole world, so skipping it here would leave the member ranks blocked in it instead of going on.
    """
    bad = [
        (arg, group)
        for arg, group in (
            ("process_group", process_group),
            ("process_group_reduce_scatter", process_group_reduce_scatter),
        )
        if not _is_member(group)
    ]
    if not bad:
        return
    if process_group_reduce_scatter == ProcessGroupName.reduce_scatter:
        get_process_group_cached(ProcessGroupName.reduce_scatter)
    arg, group = bad[0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise ValueError(
        f"FullyShardedDataParallel: global rank {rank} is not a member of the {arg} it was given ({group!r}, "
        "which dist.new_group(ranks) returns on ranks outside `ranks`). Construct this FSDP instance only on the "
        f"ranks of its group, or pass a {arg} that contains rank {rank}."
    )
