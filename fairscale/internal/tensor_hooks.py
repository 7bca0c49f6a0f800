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

__all__ = [
    "register_grad_hook",
    "register_post_accumulate_grad_hook",
    "current_graph_task",
    "grad_accumulator",
    "will_engine_execute_node",
    "apply_function",
    "unflatten_like",
]

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


# Bound once: FSDP asks these per unit and step (a wrapper function would add a Python call each time).
# current_graph_task(): the id of the autograd graph task running on this thread (-1 outside a backward); a reentrant
# checkpoint's nested backward has its own.
current_graph_task: Callable[[], int] = torch._C._current_graph_task_id
# will_engine_execute_node(node): whether the running graph task will execute ``node`` (call from a backward hook;
# raises RuntimeError for a leaf's accumulator under torch.autograd.grad(), which accumulates into no leaf). A torch
# without it answers False: FSDP then treats reentrant checkpoints as before (correct around whole units).
will_engine_execute_node = cast(
    Callable[[Any], bool], getattr(torch._C, "_will_engine_execute_node", lambda node: False)
)


def grad_accumulator(param: Tensor) -> Any:
    """The autograd node that accumulates into ``param.grad`` (``None`` for a tensor that does not require grad).

    Keep a reference: torch holds it weakly and makes a new one when none is alive.
    """
    if not param.requires_grad:
        return None
    with torch.enable_grad():  # backward hooks run without grad mode, where a view has no grad_fn
        grad_fn = param.view_as(param).grad_fn
    return None if grad_fn is None else grad_fn.next_functions[0][0]


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
