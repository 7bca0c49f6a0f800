# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How ``.to()``, ``.double()``, ``.to_empty()``... convert a :class:`FlatParameter`.

torch's ``Module._apply`` converts a parameter in one of three ways: ``param.data = new`` (same object), a new
plain ``nn.Parameter`` (when the two tensors cannot share a Python object, e.g. ``to_empty`` of a meta tensor, or
when ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` is set), or ``swap_tensors`` (when
``set_swap_module_params_on_conversion(True)`` is set). The last two lose what makes a flat parameter one: the second
registers a plain ``Parameter`` (its layout gone, the wrapper's ``flat_params`` still naming the old tensor), the third
refuses outright, because the forward views' autograd graph holds the flat parameter.

So the wrapper converts its flat parameters itself, with these rules: the same object whenever ``.data`` assignment
can take the result (this also serves the swap mode's aim, keeping the optimizer's references valid); otherwise, or in
the overwrite mode, a new :class:`FlatParameter` carrying the old one's layout and attributes. ``.grad`` follows as
torch converts it.
"""

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from .flat_parameter import FlatParameter

__all__ = ["convert_flat_params", "converted_apart"]


@torch.no_grad()
def convert_flat_params(flats: List[FlatParameter], fn: Callable[[Tensor], Tensor]) -> List[FlatParameter]:
    """Apply ``fn`` to each flat parameter (and its ``.grad``); return the flat parameters to use from now on."""
    return [_convert(flat, fn) for flat in flats]


@contextlib.contextmanager
def converted_apart(
    params: Dict[str, Optional[nn.Parameter]],
    names: Sequence[str],
    flats: List[FlatParameter],
    fn: Callable[[Tensor], Tensor],
) -> Iterator[List[FlatParameter]]:
    """Around torch's ``_apply`` of a wrapper: its flat parameters are taken out of ``params`` (its ``_parameters``)
    while torch converts the rest, then converted here and put back in their places.

    Yields the list that holds the flat parameters to use afterwards (filled in on exit; the old ones when torch's
    conversion raised).
    """
    order = list(params.keys())
    for name in names:
        params.pop(name, None)
    result = list(flats)
    try:
        yield result
        result[:] = convert_flat_params(flats, fn)
    finally:
        back = dict(zip(names, result))
        rest = dict(params)
        params.clear()
        for key in order:  # the wrapper's own parameters keep their order (state_dict keys, parameters())
            params[key] = back.pop(key) if key in back else rest.pop(key, None)
        params.update(back)
        params.update(rest)


def _convert(flat: FlatParameter, fn: Callable[[Tensor], Tensor]) -> FlatParameter:
    applied = fn(flat)
    grad = flat.grad
    grad_applied = fn(grad) if grad is not None else None
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    # A conversion to what the tensor already is (.float() of fp32, .cpu() on the CPU) returns the tensor itself:
    # nothing to convert, under any setting (wrapping the parameter itself in a new one failed inside torch).
    unchanged = applied is flat
    if unchanged or (not overwrite and torch._has_compatible_shallow_copy_type(flat, applied)):
        if not unchanged:
            flat.data = applied
        if grad is not None and grad_applied is not None and grad_applied is not grad:
            if torch._has_compatible_shallow_copy_type(grad, grad_applied):
                grad.data = grad_applied
            else:
                flat.grad = grad_applied
        return flat
    # nn.Parameter's constructor makes the subclass around ``applied`` without copying it (FlatParameter's own
    # constructor concatenates, which would copy).
    new = nn.Parameter.__new__(FlatParameter, applied, requires_grad=flat.requires_grad)
    new.__dict__.update(flat.__dict__)  # the layout lists, and whatever owners attached
    if grad_applied is not None:
        new.grad = grad_applied
    return new
