# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gradient clipping over sharded gradients: the norm of the whole model, combined across ranks."""

from typing import List

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError

from .state import TrainingState
from .unit import FSDPUnit


@torch.no_grad()
def clip_grad_norm_(root: FSDPUnit, grads: List[Tensor], max_norm: float, norm_type: float) -> Tensor:
    """See :meth:`FullyShardedDataParallel.clip_grad_norm_`; ``grads`` are the tree's (sharded) gradients."""
    if not root.is_root:
        raise FairscaleRuntimeError("clip_grad_norm_ should only be called on the root (not nested) FSDP instance")
    root.assert_state([TrainingState.IDLE])
    if len({id(u.config.process_group) for u in root.tree_units() if u.handles}) > 1:
        raise NotImplementedError("clip_grad_norm_ with nested instances on different process groups")
    c = root.config
    device = c.compute_device
    if not grads:
        local = torch.zeros((), device=device)
    elif norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max().to(device, torch.float32) for g in grads]).max()
    else:
        local = torch.stack(
            [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device) for g in grads]
        ).norm(norm_type)
    local = local.to(torch.float32)
    if norm_type == float("inf"):
        collectives.all_reduce(local, group=c.process_group, op="max")
        total = local
    else:
        local = local**norm_type
        collectives.all_reduce(local, group=c.process_group, op="sum")
        total = local ** (1.0 / norm_type)
    if c.move_grads_to_cpu:
        total = total.cpu()
    clip_coef = torch.tensor(max_norm, dtype=total.dtype, device=total.device) / (total + 1e-6)
    if clip_coef < 1:
        for g in grads:
            g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total
