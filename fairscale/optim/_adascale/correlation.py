# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale's diagnostic: how alike the workers' gradients are (mean Pearson correlation of their flat gradients)."""

from typing import Any, Dict, List

import torch
from torch import Tensor

from fairscale.internal import collectives

__all__ = ["flat_grad", "intra_grad_corr_mean"]


def flat_grad(param_groups: List[Dict[str, Any]]) -> Tensor:
    """All gradients, flattened and concatenated in group order (zeros for parameters without one)."""
    parts = []
    for group in param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
            else:
                parts.append((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
    return torch.cat(parts)


def intra_grad_corr_mean(flat: Tensor, world_size: int) -> Tensor:
    """Mean of the strict upper triangle of the workers' gradient correlation matrix (one all-gather).

    Args:
        flat: this worker's gradients as one vector (:func:`flat_grad`, or a subclass's ``_gather_flat_grad``).
        world_size: the number of workers (more than one: the caller checks).
    """
    flat = flat.float().contiguous()
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    collectives.all_gather_into_flat(gathered, flat)
    corr = torch.corrcoef(gathered.view(world_size, -1))
    upper = torch.triu_indices(world_size, world_size, offset=1, device=corr.device)
    return corr[upper[0], upper[1]].mean()
