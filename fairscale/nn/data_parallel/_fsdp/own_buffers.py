# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Buffers registered on an FSDP instance itself (``fsdp.register_buffer(...)`` after wrapping).

``state_dict()`` writes them under the instance's own prefix, beside the wrapped module's keys, as torch writes any
module's buffers. Loading adds ``_fsdp_wrapped_module.`` to every key of the instance and, at the root, loads through
the wrapped module only: their keys came back as unexpected (and a nested instance's as missing as well), so a model
did not load its own ``state_dict()`` (found by a fuzz of FSDP with torch utilities, session 42). Their keys are
kept out of the renaming, and the root loads them itself, as ``nn.Module`` would.
"""

from typing import Any, Dict, List, Mapping, Tuple

import torch
from torch import Tensor, nn

__all__ = ["own_buffer_keys", "split_own_buffers", "load_own_buffers"]


def own_buffer_keys(module: nn.Module, prefix: str) -> List[str]:
    """The keys of ``module``'s own persistent buffers (not its children's) under ``prefix``."""
    skip = module._non_persistent_buffers_set
    return [prefix + name for name, b in module._buffers.items() if b is not None and name not in skip]


def split_own_buffers(module: nn.Module, sd: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``sd`` without the root's own buffer keys, and those entries (keys without a prefix, at the root)."""
    keys = set(own_buffer_keys(module, ""))
    if not keys:
        return dict(sd), {}
    rest = {k: v for k, v in sd.items() if k not in keys}
    own = {k: v for k, v in sd.items() if k in keys}
    return rest, own


def load_own_buffers(module: nn.Module, own: Mapping[str, Any], missing: List[str], errors: List[str]) -> None:
    """Copy the root's own buffers from ``own``, as ``nn.Module._load_from_state_dict`` does for any module's.

    Missing keys are appended to ``missing``, a value of another shape or a non-tensor to ``errors`` (nothing of
    those copied); the caller raises when ``strict`` and restores the model on failure.
    """
    with torch.no_grad():
        for key in own_buffer_keys(module, ""):
            if key not in own:
                missing.append(key)
                continue
            value, buffer = own[key], module._buffers[key]
            if buffer is None:  # not listed by own_buffer_keys: for the type checker
                continue
            if not isinstance(value, Tensor):
                errors.append(f'While copying the buffer named "{key}", expected torch.Tensor, got {type(value)}.')
            elif value.shape != buffer.shape:
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, the shape in "
                    f"current model is {buffer.shape}."
                )
            else:
                buffer.copy_(value)
