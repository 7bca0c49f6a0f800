# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Whether a loaded per-parameter optimizer state can belong to its parameter: the rule of every fairscale loader.

An optimizer's ``load_state_dict`` pairs the saved states with its parameters by position only. A state dict from
another model therefore lands on parameters of other shapes, and the next ``step()`` either fails far from the cause
or, in a fused or foreach kernel that trusts the shapes, reads and writes out of bounds. Checking every state tensor
against its parameter before anything is loaded turns that into a clear error. The rule has to accept every
legitimate state, including optimizers it does not know, so it is:

* a tensor under a name that holds **one value per element of the parameter** in the PyTorch and fairscale
  optimizers (:data:`PER_ELEMENT_STATE`: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer`` ...) must have exactly
  the parameter's shape;
* any other tensor with more than one element must not have more elements than the parameter: per-parameter
  statistics are at most as large as the parameter, factored ones (Adafactor's row and column variances) smaller;
* tensors with at most one element (``eta``, ``mu_product`` ...) and non-tensor values are not checked, except
  ``step``, which torch's loader casts for every optimizer: a number or a one-element tensor.

A per-element tensor of the right shape can still have a crafted layout (a stride-0 view of one element, a
transposed one) that a fused kernel, which walks the memory of the parameter and its state in step, would read or
write out of bounds or misaligned. :func:`laid_out_like` gives such tensors the parameter's layout before they are
loaded (a copy only when the layout differs).
"""

import numbers
from typing import Any, Mapping

import torch

from fairscale.internal.errors import FairscaleValueError

__all__ = ["PER_ELEMENT_STATE", "check_param_state", "laid_out_like"]

#: State names that hold one value per parameter element in torch.optim (Adam, AdamW, Adamax, NAdam, RAdam, SGD,
#: RMSprop, Adagrad, Adadelta, ASGD, Rprop, SparseAdam) and fairscale.optim.Adam.
PER_ELEMENT_STATE = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_inf",
        "momentum_buffer",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "ax",
        "prev",
        "step_size",
    }
)


def check_param_state(who: str, key: Any, entry: Any, param: torch.Tensor) -> None:
    """Raise unless ``entry``, the loaded state of parameter ``key``, can belong to ``param`` (see the module doc).

    Args:
        who (str): the loader, for the message (e.g. ``"OSS.load_state_dict"``).
        key (Any): the parameter's index in the state dict, for the message.
        entry (Any): the loaded per-parameter state (a mapping from state names to values).
        param (torch.Tensor): the parameter it is loaded for.

    Raises:
        ValueError: (also an ``AssertionError``) the entry is not a mapping, or a state tensor cannot belong to
            the parameter; the message names the parameter, the state and both shapes.
    """
    if not isinstance(entry, Mapping):
        raise FairscaleValueError(
            f"{who}: the state of parameter {key} is a {type(entry).__name__}, not a dict of state values; "
            "pass a state dict written by an optimizer's state_dict()"
        )
    step = entry.get("step")
    if step is not None and not _is_count(step):
        # torch's loader casts a "step" of any optimizer; anything else failed there with a message about a
        # generator object, far from the cause.
        raise FairscaleValueError(
            f"{who}: state 'step' of parameter {key} is {_shown(step)}, but it must be a number or a one-element "
            "tensor (the steps taken); the state dict was edited or written by something else. Load the state dict "
            "saved with this model's optimizer."
        )
    for name, value in entry.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name in PER_ELEMENT_STATE:
            fits = tuple(value.shape) == tuple(param.shape)
            need = f"exactly the parameter's shape {tuple(param.shape)}"
        elif value.numel() > 1:
            fits = value.numel() <= param.numel()
            need = f"at most the parameter's {param.numel()} elements (its shape is {tuple(param.shape)})"
        else:
            continue
        if not fits:
            raise FairscaleValueError(
                f"{who}: state {name!r} of parameter {key} has shape {tuple(value.shape)}, but it must have {need}; "
                "the state dict belongs to a different model (or lists the parameters in another order). Load the "
                "state dict saved with this model's optimizer."
            )


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    # numbers.Real: numpy scalars too (torch's loaders take them).
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def laid_out_like(entry: Any, param: torch.Tensor) -> Any:
    """``entry`` with each per-element state tensor in ``param``'s memory layout (copied only where it is not).

    Args:
        entry (Any): one parameter's loaded state, already checked with :func:`check_param_state`.
        param (torch.Tensor): the parameter.

    Returns:
        Any: ``entry`` itself when nothing had to change, else a new dict.
    """
    if not isinstance(entry, Mapping):
        return entry
    changed = {
        name: torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)
        for name, value in entry.items()
        if name in PER_ELEMENT_STATE and isinstance(value, torch.Tensor) and value.stride() != param.stride()
    }
    return {**entry, **changed} if changed else entry
