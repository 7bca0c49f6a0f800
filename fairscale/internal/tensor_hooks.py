# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Typed entry points to torch's tensor hooks and a few other torch calls its stubs leave unannotated.

Strict mypy rejects every direct call of an unannotated torch function; the casts here state the signatures torch
documents, once, so that the callers stay fully typed.
"""

from typing import Any, Callable, List, Sequence, cast

import torch
from torch import Tensor
from torch._utils import _unflatten_dense_tensors
from torch.utils.hooks import RemovableHandle

__all__ = ["register_grad_hook", "register_post_accumulate_grad_hook", "apply_function", "unflatten_like"]

# Built once: a subscripted Callable in a cast() is evaluated at every call (FSDP registers a hook per unit and step).
_AddHook = Callable[[Callable[[Tensor], None]], RemovableHandle]


def register_grad_hook(tensor: Tensor, hook: Callable[[Tensor], None]) -> RemovableHandle:
    """``tensor.register_hook(hook)``: ``hook(grad)`` runs when the gradient of ``tensor`` is computed."""
    add = cast(_AddHook, tensor.register_hook)
    return add(hook)


def register_post_accumulate_grad_hook(param: Tensor, hook: Callable[[Tensor], None]) -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)``: ``hook(param)`` runs after ``param.grad`` was updated."""
    add = cast(_AddHook, param.register_post_accumulate_grad_hook)
    return add(hook)


def apply_function(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` for a ``torch.autograd.Function`` subclass."""
    apply = cast(Callable[..., Any], getattr(function, "apply"))
    return apply(*args)


def unflatten_like(flat: Tensor, templates: Sequence[Tensor]) -> List[Tensor]:
    """Views of ``flat`` shaped like ``templates``, made in one C++ call (torch's ``_unflatten_dense_tensors``)."""
    unflatten = cast(Callable[[Tensor, Sequence[Tensor]], Sequence[Tensor]], _unflatten_dense_tensors)
    return list(unflatten(flat, templates))


def split(tensor: Tensor, sizes: Sequence[int]) -> List[Tensor]:
    """``torch.split(tensor, sizes)`` along dim 0, typed."""
    return list(torch.split(tensor, list(sizes)))
