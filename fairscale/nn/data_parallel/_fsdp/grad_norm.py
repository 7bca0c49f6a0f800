# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gradient clipping over sharded gradients: the norm of the whole model, combined across ranks."""

import math
from typing import List

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.internal.grad_norm import total_norm_across_ranks

from .naming import clean_path
from .state import TrainingState
from .unit import FSDPUnit


@torch.no_grad()
def clip_grad_norm_(root: FSDPUnit, grads: List[Tensor], max_norm: float, norm_type: float) -> Tensor:
    """See :meth:`FullyShardedDataParallel.clip_grad_norm_`; ``grads`` are the tree's (sharded) gradients."""
    if not root.is_root:
        raise FairscaleRuntimeError("clip_grad_norm_ should only be called on the root (not nested) FSDP instance")
    root.assert_state([TrainingState.IDLE])
    _check_arguments(max_norm, norm_type)
    refusal = None
    if any(h.holds_unreduced_grad() for u in root.tree_units() for h in u.handles):
        # Qualified by the instance's path (every instance names its first flat parameter flat_param_0): the
        # cheap walk above finds them, this one runs only for the message (a fuzz, session 44).
        unreduced = [
            clean_path(f"{path}.{h.name}")
            for path, u in root.named_units()
            for h in u.handles
            if h.holds_unreduced_grad()
        ]
        # Each rank holds its own full-size gradients there: their combined norm is neither the norm of the
        # averaged gradient nor the same clip on every rank. Raised after the norm's collective, on every rank: a
        # rank that raised before it left the others waiting there (their window cleared by zero_grad(), its not).
        refusal = (
            "clip_grad_norm_ after a backward inside no_sync(): the gradients are not reduced yet (unreduced on "
            f"{unreduced[:3]}{' ...' if len(unreduced) > 3 else ''}). Call it after the last backward of the "
            "accumulation window, the one outside no_sync(); nothing was clipped."
        )
    # The root's group (over which the norm is combined below, even when the root owns no parameter) and the group
    # of every instance that owns parameters. Groups of one rank (e.g. a DummyProcessGroup per instance, as on one
    # process without torch.distributed) communicate nothing, so they differ in identity only: the local norm is
    # the total either way, and nothing is combined.
    configs = [root.config] + [u.config for u in root.tree_units() if u.handles]
    all_local = all(c.world_size == 1 and c.replicate_size == 1 for c in configs)
    if len({id(c.process_group) for c in configs}) > 1 and not all_local:
        raise NotImplementedError(
            "clip_grad_norm_ with nested instances on different process groups (e.g. mixture-of-experts layers "
            "wrapped over a group of one rank) is not supported (as upstream). Clip yourself: sum the squared norms "
            "of each instance's gradient shards over that instance's own process group (all_reduce), add them up, "
            "and scale the gradients by max_norm / total norm where it is larger."
        )
    c = root.config
    device = c.compute_device
    # fp32 as upstream (half gradients are upcast), float64 for a model converted with .double(): an fp32 norm made
    # its clipping differ from torch's clip_grad_norm_ by the fp32 rounding (found by a fuzz, session 42).
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if not grads:
        local = torch.zeros((), device=device)
    elif norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max().to(device, acc) for g in grads]).max()
    else:
        local = torch.stack(
            [torch.linalg.vector_norm(g.detach(), norm_type, dtype=acc).to(device) for g in grads]
        ).norm(norm_type)
    total = total_norm_across_ranks(
        local.to(acc),
        max_norm,
        norm_type,
        c.process_group,
        "clip_grad_norm_",
        refusal=refusal,
        refused_elsewhere=_ELSEWHERE,
    )
    if c.move_grads_to_cpu:
        total = total.cpu()
    clip_coef = torch.tensor(max_norm, dtype=total.dtype, device=total.device) / (total + 1e-6)
    if clip_coef < 1:
        for g in grads:
            g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total


# What the ranks that could clip say when others could not.
_ELSEWHERE = (
    "{what}: the gradients of rank(s) {ranks} of the group are not reduced yet, those of this rank are: every rank "
    "must run the same backward passes inside and outside no_sync(), and clear its gradients (zero_grad()) at the same "
    "points; nothing was clipped."
)


def _check_arguments(max_norm: float, norm_type: float) -> None:
    # A negative max_norm would flip every gradient's sign and NaN would skip clipping, both silently; torch computes
    # order 0 and negative orders differently from this sum-of-powers combination across ranks.
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm}")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a positive number or inf (e.g. 2.0 or float('inf')), got {norm_type}"
        )
