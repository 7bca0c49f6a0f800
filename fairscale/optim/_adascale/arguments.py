# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale's argument checks: the constructor's and setters' values, and their agreement across ranks.

The ``FairscaleValueError`` raised here is an ``AssertionError`` too, as upstream asserted these rules.
"""

import math
import numbers
from typing import Any, Dict, Optional, Sequence

from fairscale.internal import collectives
from fairscale.internal.agreement import check_ranks_agree, comparable_number, first_device
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

__all__ = ["as_number", "check_num_gradients", "check_ranks_agree_on_settings", "check_scale", "checked_world_size"]


def checked_world_size(world_size: Optional[int]) -> int:
    """``world_size`` as an int, the default group's size for ``None`` (1 without torch.distributed).

    Raises:
        ValueError: not a whole number >= 1.
    """
    if world_size is None:
        world_size = collectives.group_size(None)
    if isinstance(world_size, bool) or not float(world_size).is_integer() or world_size < 1:
        # 0 or a negative count was caught only by the single-worker check, whose message misled.
        raise FairscaleValueError(f"AdaScale: world_size must be a whole number >= 1 (or None), got {world_size!r}")
    return int(world_size)


def as_number(name: str, value: Any) -> Any:
    """``value`` as a Python number: a one-element tensor or numpy value (what a config read through torch, or a
    scheduler, gives) is taken by its ``item()``; before, it failed deep inside the statistics with a numpy error.

    Raises:
        TypeError: ``value`` is a bool, or neither a real number nor a one-element tensor or array of one.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value
    size = getattr(value, "numel", None)
    count = size() if callable(size) else getattr(value, "size", None)
    if count == 1 and hasattr(value, "item") and not isinstance(value, bool):
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return item
    raise FairscaleTypeError(f"AdaScale: {name} must be a real number, got {type(value).__name__} {value!r}")


def check_scale(scale: float) -> None:
    """Raise unless ``scale`` is a finite number >= 1 (an infinite scale made the gain, and so the lr, NaN)."""
    if not scale >= 1:
        raise FairscaleValueError(f"AdaScale: Scale must be at least 1, got {scale}")
    if not math.isfinite(scale):
        raise FairscaleValueError(f"AdaScale: Scale must be a finite number >= 1, got {scale}")


def check_num_gradients(num_gradients_to_accumulate: int, world_size: int) -> None:
    """Raise unless ``num_gradients_to_accumulate`` is a whole number >= 1, and not 1 for a single worker.

    Raises:
        ValueError: not a whole number >= 1 (a fraction such as 2.5 never ends an accumulation window).
        RuntimeError: 1 with ``world_size`` 1 (no gradient variance to estimate).
    """
    if not num_gradients_to_accumulate >= 1:
        raise FairscaleValueError(
            f"AdaScale: Invalid value {num_gradients_to_accumulate}: num_gradients_to_accumulate must be at least 1"
        )
    # An integral float (2.0) stays accepted, as upstream accepted it; a fraction is never reached by counting.
    try:
        whole = float(num_gradients_to_accumulate) % 1 == 0  # inf % 1 is NaN: not whole
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise FairscaleValueError(
            f"AdaScale: Invalid value {num_gradients_to_accumulate!r}: num_gradients_to_accumulate must be a whole "
            "number of backward passes (an int >= 1)"
        )
    # The constructor's rule, for every later change too: one worker with one gradient per step has no gradient
    # variance to estimate, and the statistics divided by world_size * num_gradients_to_accumulate - 1 = 0.
    if world_size * num_gradients_to_accumulate <= 1:
        raise RuntimeError("AdaScale does not support a single worker without grad accumulation.")


def check_ranks_agree_on_settings(
    param_groups: Sequence[Dict[str, Any]],
    n_groups: int,
    num_gradients_to_accumulate: int,
    world_size: int,
    scale: Any,
    smoothing: float,
    debias_ewma: bool = True,
    is_scaled_loss: bool = True,
    has_trainable: bool = True,
) -> None:
    """Raise the same :class:`RanksDisagreeError` on every rank unless all of them have ``n_groups`` param groups,
    the same ``num_gradients_to_accumulate``, ``world_size``, ``scale``, smoothing, ``debias_ewma`` and
    ``is_scaled_loss``, and either all or none of them a parameter that requires grad (``has_trainable``) (one small
    all-gather; none at world size 1). Ranks with another scale, smoothing or statistics rule trained with other
    gains, so other learning rates, silently. A rank without a parameter to hook never reaches the all-reduce that
    ends each accumulation window, and the others waited in it until the group's timeout (``OSS(params,
    optim=AdaScaleWrapper)`` with a rank that owns no parameter)."""
    if world_size > 1 and collectives.group_size(None) > 1:
        check_ranks_agree(
            "AdaScale: (param groups, num_gradients_to_accumulate, world_size, scale, smoothing, debias_ewma, "
            "is_scaled_loss, holds a parameter that requires grad)",
            (
                n_groups,
                num_gradients_to_accumulate,
                world_size,
                comparable_number(scale),
                comparable_number(smoothing),
                bool(debias_ewma),
                bool(is_scaled_loss),
                bool(has_trainable),
            ),
            hint=(
                "Build the optimizer from the same param groups and arguments on every rank. Every rank's AdaScale "
                "must hold a parameter that requires grad when one does (its gradient hooks start the window's "
                "all-reduce): OSS(params, optim=AdaScaleWrapper, ...) leaves a rank that owns no parameter without "
                "one; wrap OSS in AdaScale instead: AdaScale(OSS(params, optim=SGD, ...)) or "
                "AdaScaleWrapper(params, optim_cls=OSS, optim=SGD, ...)."
            ),
            device=first_device(p for group in param_groups for p in group["params"]),
        )
