# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The SGP entries of a SlowMo state dict: ``ps_weight`` (a one-element CPU tensor) and ``is_sgp_ps_numerator``
(a bool), next to the module's own entries and under the same prefix.

They are no parameters or buffers, so torch neither saves nor loads them: the wrapper adds them on save and takes
them out before torch loads the rest. Every check runs before anything is loaded, so that a dict that does not fit
changes nothing.
"""

from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

from ._sgp import SgpGossip

__all__ = ["SgpValues", "add_sgp_entries", "check_sgp_assign", "set_sgp_values", "take_sgp_entries"]

# What a load sets: the push-sum weight (on the SGP state's device and dtype) and whether the parameters are numerators.
SgpValues = Tuple[Tensor, bool]

_NAMES = ("ps_weight", "is_sgp_ps_numerator")


def add_sgp_entries(sgp: SgpGossip, state: Dict[str, Any], prefix: str) -> None:
    """Add the SGP entries to ``state`` under ``prefix`` (two SGP models in one parent must not share keys)."""
    state[prefix + _NAMES[0]] = sgp.ps_weight.cpu()
    state[prefix + _NAMES[1]] = sgp.is_sgp_ps_numerator


def take_sgp_entries(
    sgp: SgpGossip, state: Dict[str, Any], prefix: str, missing_keys: Optional[List[str]]
) -> Optional[SgpValues]:
    """Take the SGP entries under ``prefix`` out of ``state`` and check them: the values to set, or ``None``.

    Args:
        sgp: the SGP state the entries are for.
        state: the state dict being loaded (entries are removed from it).
        prefix: the model's prefix in it.
        missing_keys: where absent entries are reported (a non-strict load, or a parent's load, which then decides);
            ``None`` raises ``KeyError`` for them, as upstream's lookup did.

    Raises:
        KeyError: an entry is absent and ``missing_keys`` is ``None``.
        FairscaleValueError: an entry is present but is not what an SGP model saves.
    """
    names = [prefix + name for name in _NAMES]
    absent = [k for k in names if k not in state]
    if absent:
        if missing_keys is None:
            raise KeyError(
                f"SlowMoDistributedDataParallel.load_state_dict: the state dict lacks {absent}; pass a state dict "
                "saved by an SGP model's state_dict(), or strict=False to keep the current SGP state"
            )
        missing_keys.extend(absent)
        for k in names:  # half a pair is not loaded (and is no unexpected key either)
            state.pop(k, None)
        return None
    ps_weight, is_numerator = state.pop(names[0]), state.pop(names[1])
    if ps_weight is None:
        raise FairscaleValueError(
            "SlowMoDistributedDataParallel.load_state_dict: the state dict's 'ps_weight' is None; pass a state "
            "dict saved by an SGP model's state_dict() (its ps_weight is a one-element tensor)"
        )
    expected = sgp.ps_weight
    if not isinstance(ps_weight, Tensor) or ps_weight.numel() != expected.numel() or ps_weight.is_meta:
        # A meta tensor (no data) failed in the copy after the module was loaded.
        raise FairscaleValueError(
            "SlowMoDistributedDataParallel.load_state_dict: the state dict's 'ps_weight' is not a "
            f"{expected.numel()}-element tensor with data; pass a state dict saved by an SGP model's state_dict()"
        )
    if isinstance(is_numerator, Tensor) and is_numerator.numel() != 1:
        # bool() of it failed after the weights and ps_weight were loaded.
        raise FairscaleValueError(
            "SlowMoDistributedDataParallel.load_state_dict: the state dict's 'is_sgp_ps_numerator' is not a "
            f"bool (a {is_numerator.numel()}-element tensor); pass a state dict saved by an SGP model's "
            "state_dict()"
        )
    return ps_weight.detach().to(device=expected.device, dtype=expected.dtype), bool(is_numerator)


def set_sgp_values(sgp: SgpGossip, values: Optional[SgpValues]) -> None:
    """Set what :func:`take_sgp_entries` returned (nothing for ``None``)."""
    if values is not None:
        sgp.ps_weight.copy_(values[0])
        sgp.is_sgp_ps_numerator = values[1]


def check_sgp_assign(named_params: Iterable[Tuple[str, Tensor]], state: Dict[str, Any], prefix: str) -> None:
    """Refuse a load with ``assign=True`` that would change a parameter's dtype or device under SGP.

    The gossip thread's messages and the push-sum weight were laid out for the parameters' dtypes and device at
    construction: another dtype would be gossiped in the old one, and another device fails at the next push-sum
    step. (The device is not compared against a ``meta`` stand-in of a dry run: the real load compares it.)

    Raises:
        FairscaleValueError: naming the first such entry.
    """
    for name, p in named_params:
        value = state.get(prefix + name)
        if not isinstance(value, Tensor):
            continue  # absent, or not a tensor: torch's own checks report it
        if value.dtype != p.dtype or (not p.is_meta and value.device != p.device):
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel.load_state_dict(assign=True): the state dict's {prefix + name!r} is "
                f"{value.dtype} on {value.device}, but with SGP each parameter must keep its dtype and device "
                f"({p.dtype}{'' if p.is_meta else f' on {p.device}'}): the gossip buffers were laid out for them; "
                "convert the entries first, or load with assign=False (which copies into the parameters)"
            )
