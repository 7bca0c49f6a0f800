# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Whether a checkpointed call may need a gradient: when nothing it can see requires grad, autograd saves no
activations, and checkpointing would only cost a second forward."""

from typing import List

import torch
from torch import nn

__all__: List[str] = []


def _may_need_grad(module: nn.Module, input_tensors: List[torch.Tensor]) -> bool:
    """Whether anything the forward can see requires grad: an input, a parameter, or a plain tensor
    attribute (``FlattenParamsWrapper`` replaces parameters by such views and also lists them in
    ``_unflattened_param_views``)."""
    if any(t.requires_grad for t in input_tensors):
        return True
    if any(p.requires_grad for p in module.parameters()):
        return True
    return _views_need_grad(module)


def _views_need_grad(module: nn.Module) -> bool:
    # A FlattenParamsWrapper inside (alone or in FSDP) makes the views from its flat parameters, which parameters()
    # covers: the views its last forward left keep requires_grad=True after the parameters were frozen, and a frozen
    # module's output then required grad (a frozen backbone before a trainable head crashed in backward, and a
    # training-mode forward with no backward never updated the batch-norm statistics). Its subtree is skipped. The
    # views of a wrapper around this module (checkpointing inside FlattenParamsWrapper) are fresh and do count.
    if "_fpw_module" in module._modules:
        return False
    # The module's own attribute: FSDP forwards unknown attribute reads to what it wraps (the stale views).
    views = module.__dict__.get("_unflattened_param_views") or []
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in views):
        return True
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in vars(module).values()):
        return True
    return any(_views_need_grad(child) for child in module.children())
