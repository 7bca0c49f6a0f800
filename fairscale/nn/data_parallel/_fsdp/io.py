# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What crosses a FullyShardedDataParallel forward: casting its inputs, walking the tensors of its outputs."""

import dataclasses
from typing import Any, Callable, Tuple

import torch
from torch import Tensor

from fairscale.internal.containers import apply_to_tensors

__all__ = ["cast_inputs", "for_each_tensor"]


def cast_inputs(dtype: torch.dtype, from_dtypes: Tuple[torch.dtype, ...], no_grad: bool, args: Any, kwargs: Any) -> Any:
    """Cast floating tensors of ``from_dtypes`` among ``args``/``kwargs`` to ``dtype`` (recursively).

    Args:
        dtype: target dtype.
        from_dtypes: only tensors of these dtypes are cast.
        no_grad: cast outside autograd (the copy is a new leaf that keeps ``requires_grad`` of a leaf input).

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

    return apply_to_tensors(cast, (args, kwargs))


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
