# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Assignments to names that a wrapper (FSDP, FlattenParamsWrapper) only forwards to the module it wraps.

Both wrappers forward unknown attribute reads to the wrapped module, so ``fsdp.weight`` reads the inner module's
weight. ``nn.Module.__setattr__`` does not forward: assigning a tensor there stored it on the wrapper, where it
shadowed the real one for every later read while the module kept computing with its own (silently wrong), and
assigning an ``nn.Parameter`` failed inside torch with ``KeyError: "attribute 'weight' already exists"``.
"""

from typing import Any

import torch
import torch.nn as nn

__all__ = ["refuse_shadowing_assignment"]


def refuse_shadowing_assignment(wrapper: nn.Module, wrapped: nn.Module, name: str, value: Any, who: str) -> None:
    """Raise ``AttributeError`` if ``wrapper.name = value`` would shadow a tensor or module of ``wrapped``.

    Plain Python values are left alone (stored on the wrapper, as torch and upstream do): only tensors and modules,
    whose shadowing changes what is trained or saved without a word.
    """
    if not isinstance(value, (torch.Tensor, nn.Module)) or _own_attribute(wrapper, name):
        return
    try:
        forwarded = getattr(wrapped, name)
    except AttributeError:
        return
    if not isinstance(forwarded, (torch.Tensor, nn.Module)):
        return
    raise AttributeError(
        f"{who}: cannot assign {type(value).__name__} to '{name}': it belongs to the wrapped module (the wrapper only "
        f"forwards reads). Assign on the module that owns it, `model.{_owner_path(wrapped, name)}.{name} = ...` (for "
        "FSDP inside summon_full_params(), which writes a rebound parameter back), or copy in place: "
        f"`with torch.no_grad(): model.{name}.copy_(new)`."
    )


def _owner_path(wrapped: nn.Module, name: str) -> str:
    """``module`` or ``module.module``...: where ``name`` is an attribute of its own, down the wrappers' chain
    (each wrapper exposes what it wraps as ``.module``)."""
    path, owner = ["module"], wrapped
    while not _own_attribute(owner, name):
        inner = owner._modules.get("_fpw_module") or owner._modules.get("_fsdp_wrapped_module")
        if inner is None:
            break
        path.append("module")
        owner = inner
    return ".".join(path)


def _own_attribute(module: nn.Module, name: str) -> bool:
    return (
        name in module.__dict__
        or name in module._parameters
        or name in module._buffers
        or name in module._modules
        or hasattr(type(module), name)
    )
