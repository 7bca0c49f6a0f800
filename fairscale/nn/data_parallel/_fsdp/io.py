# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What crosses a FullyShardedDataParallel forward: casting its inputs, walking the tensors of its outputs."""

import dataclasses
from typing import Any, Callable, Dict, Tuple

import torch
from torch import Tensor

from fairscale.internal.containers import apply_to_type

__all__ = ["cast_inputs", "for_each_tensor", "map_tensors"]


def _is_tensor_or_dataclass(x: Any) -> bool:
    # A dataclass that is also a container (HF's ModelOutput is an OrderedDict) is walked as that container.
    if isinstance(x, Tensor):
        return True
    return dataclasses.is_dataclass(x) and not isinstance(x, (type, dict, list, tuple, set))


def _shallow_copy_with(x: Any, changes: Dict[str, Any]) -> Any:
    """A new instance of ``x``'s class holding ``x``'s attributes (``__dict__`` and slots), then ``changes``: made
    without ``__init__``, ``__post_init__``, ``__getstate__`` or ``__reduce__`` (``copy.copy`` goes through the last
    two, which may leave a field out), and set past a frozen dataclass's ``__setattr__``."""
    out = object.__new__(type(x))
    if hasattr(x, "__dict__"):
        out.__dict__.update(x.__dict__)
    for klass in type(x).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                object.__setattr__(out, name, getattr(x, name))
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def map_tensors(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to each tensor: the containers of ``apply_to_tensors`` and dataclass instances.

    ``apply_to_tensors`` (upstream's public helper, kept as upstream's) leaves dataclasses alone, as objects; a batch
    or output dataclass (a ``Batch`` of tensors) must be walked too: the root's mixed-precision cast left an fp32
    tensor inside one beside bf16 weights (torch's dtype error, found by a fuzz of FSDP with ordinary torch code). A
    dataclass where a field changed comes back as a shallow copy with the new values set directly (see
    :func:`_shallow_copy_with`): no ``__init__`` or ``__post_init__`` runs again (``dataclasses.replace``, torch FSDP's way, fails on ``InitVar`` fields and on
    classes with an ``__init__`` of their own, and applies a ``__post_init__`` twice), ``init=False`` fields included.
    """

    def convert(x: Any) -> Any:
        if isinstance(x, Tensor):
            return fn(x)
        changes = {}
        for f in dataclasses.fields(x):
            value = getattr(x, f.name, None)
            new = apply_to_type(_is_tensor_or_dataclass, convert, value)
            if new is not value:
                changes[f.name] = new
        return _shallow_copy_with(x, changes) if changes else x

    return apply_to_type(_is_tensor_or_dataclass, convert, obj)


def cast_inputs(dtype: torch.dtype, from_dtypes: Tuple[torch.dtype, ...], no_grad: bool, args: Any, kwargs: Any) -> Any:
    """Cast floating tensors of ``from_dtypes`` among ``args``/``kwargs`` to ``dtype`` (recursively).

    Args:
        dtype: target dtype.
        from_dtypes: only tensors of these dtypes are cast.
        no_grad: cast outside autograd (the copy is a new leaf that keeps ``requires_grad`` of a leaf input). The
            root's mixed-precision cast is recorded (``False``): under ``no_grad``, as upstream, gradients never
            reached a layer in front of the root or the input's ``.grad`` (a gradient penalty found no input).

    Returns:
        ``(args, kwargs)`` with the casts applied.
    """

    def cast(t: Tensor) -> Tensor:
        if not t.is_floating_point() or t.dtype not in from_dtypes or t.dtype == dtype:
            return t
        if no_grad:
            with torch.no_grad():
                out = t.to(dtype)
            if t.is_leaf and t.requires_grad:
                out.requires_grad_(True)
            return out
        return t.to(dtype)

    return map_tensors(cast, (args, kwargs))


def for_each_tensor(obj: Any, fn: Callable[[Tensor], None]) -> None:
    """Call ``fn`` on every tensor in ``obj``: nested tuples/lists/sets/dicts (namedtuples, ``ModelOutput``-style
    dicts and ``PackedSequence`` included) and dataclass instances."""
    if isinstance(obj, Tensor):
        fn(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            for_each_tensor(getattr(obj, f.name), fn)
    elif isinstance(obj, dict):
        for value in obj.values():
            for_each_tensor(value, fn)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            for_each_tensor(value, fn)
