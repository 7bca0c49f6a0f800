# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What a checkpoint's weight of another shape than a model-parallel layer's partition most likely is.

torch only says "size mismatch for weight": a checkpoint saved at another model-parallel size (or the full master
weight) deserves a message that says so and what to do.
"""

from typing import Any, List, Mapping, Optional, cast

import torch
from torch import Tensor

from .initialize import get_model_parallel_world_size, model_parallel_is_initialized

__all__ = ["load_partition", "partition_hint"]


def partition_hint(layer: torch.nn.Module, dim: int, saved: Any) -> Optional[str]:
    """What a checkpoint's ``weight`` of another shape than ``layer``'s partition (cut along ``dim``) most likely is:
    the full weight, or the partition of another model-parallel size (torch only says "size mismatch")."""
    mine = tuple(cast(Tensor, layer.weight).shape)
    if not isinstance(saved, Tensor) or saved.dim() != len(mine) or tuple(saved.shape) == mine:
        return None
    # The size the layer was built for (its partition's); the current groups may be gone (destroy_model_parallel()).
    built = getattr(layer, "_mp_layout", None)
    if built is not None:
        p = int(built[1])
    elif model_parallel_is_initialized():
        p = get_model_parallel_world_size()
    else:
        return None
    full = list(mine)
    full[dim] *= p
    where = f"this rank's partition {mine} of the full {tuple(full)} weight (model-parallel size {p})"
    if list(saved.shape) == full:
        what = "the full weight (a checkpoint of model-parallel size 1, or a master weight): load it at that size"
    elif (
        all(a == b for i, (a, b) in enumerate(zip(saved.shape, full)) if i != dim)
        and saved.shape[dim] > 0
        and full[dim] % saved.shape[dim] == 0
    ):
        what = f"the partition of model-parallel size {full[dim] // saved.shape[dim]}: load it at that size"
    else:
        return f"{type(layer).__name__}.weight is {where}; the checkpoint's {tuple(saved.shape)} is of another model"
    return (
        f"{type(layer).__name__}.weight is {where}; the checkpoint's {tuple(saved.shape)} looks like {what}, gather "
        "the full weights there (get_master_weight()) and cut this size's partitions from them"
    )


def load_partition(
    self: torch.nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    """``nn.Module._load_from_state_dict``, saying what a weight of another size most likely is (a checkpoint of
    another model-parallel size), also when a parent module loads."""
    before = len(error_msgs)
    torch.nn.Module._load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    )
    hint = partition_hint(self, getattr(self, "_partition_dim"), state_dict.get(prefix + "weight"))
    if len(error_msgs) > before and hint is not None:
        error_msgs.append(hint)
