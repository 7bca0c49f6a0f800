# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale's gradient hooks: one per parameter that requires grad, each holding its AdaScale through a weak reference.

A bound method in the hook kept a dropped AdaScale alive for as long as the model lived: it went on measuring every
backward, and the window it had open broke the backward of a new AdaScale over the same model. Weakly held, a dropped
AdaScale is freed, its ``__del__`` removes its hooks, and a hook that still runs does nothing.

A frozen parameter cannot take a tensor hook: it is left out of the statistics until it requires grad, when
:func:`hook_unfrozen` hooks it.
"""

import functools
import weakref
from typing import Any, Callable, Dict, Iterable, List, Protocol, Sequence, Set, Tuple, cast

from torch import Tensor

__all__ = ["HookOwner", "hook_unfrozen", "hooked_grad_sqr", "register_hooks", "unmeasured_message", "weak_hook"]


class HookOwner(Protocol):
    """What the hooks call: AdaScale's per-parameter gradient handler."""

    def _backward_hook(self, pg_idx: int, grad: Tensor) -> None: ...


def _forward_to_owner(owner_ref: "weakref.ref[HookOwner]", pg_idx: int, grad: Tensor) -> None:
    # Module-level, so that the hook holds nothing but the weak reference: once the owner is gone this is a no-op.
    owner = owner_ref()
    if owner is not None:
        owner._backward_hook(pg_idx, grad)


def weak_hook(owner: HookOwner, pg_idx: int) -> Callable[[Tensor], None]:
    """The gradient hook of a parameter of group ``pg_idx``; it holds ``owner`` through a weak reference."""
    return functools.partial(_forward_to_owner, weakref.ref(owner), pg_idx)


def register_hooks(owner: HookOwner, groups: Sequence[Sequence[Any]]) -> Tuple[List[Any], Set[int]]:
    """Hook every parameter of ``groups`` that requires grad.

    Returns the new handles and the ids of the hooked parameters; on an error, the hooks registered so far are
    removed again, so that a failed call leaves no hook behind. Entries that are not tensors are skipped: the
    wrapped optimizer's ``add_param_group`` reports them in its own words.
    """
    handles: List[Any] = []
    hooked: Set[int] = set()
    try:
        for idx, params in enumerate(groups):
            for param in params:
                if isinstance(param, Tensor) and param.requires_grad and id(param) not in hooked:
                    handles.append(cast(Any, param).register_hook(weak_hook(owner, idx)))  # torch leaves it untyped
                    hooked.add(id(param))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles, hooked


def hook_unfrozen(
    owner: HookOwner, param_groups: Sequence[Dict[str, Any]], handles: List[Any], hooked: Set[int]
) -> List[str]:
    """Hook the parameters that require grad but have no hook (frozen when ``owner`` hooked them), adding to
    ``handles`` and ``hooked``.

    Returns where those of them that already hold a gradient are (``"group 0, param 3"``): no hook measured that
    gradient.
    """
    measured_without_hook = []
    for idx, group in enumerate(param_groups):
        for pos, param in enumerate(group["params"]):
            if param.requires_grad and id(param) not in hooked:
                handles.append(param.register_hook(weak_hook(owner, idx)))
                hooked.add(id(param))
                if param.grad is not None:
                    measured_without_hook.append(f"group {idx}, param {pos}")
    return measured_without_hook


def hooked_grad_sqr(params: Iterable[Tensor], hooked: Set[int]) -> float:
    """Sum of the squared norms of the (reduced, accumulated) gradients of the hooked ``params`` that require grad
    (the local statistics measure no others): fp32 per parameter, float64 across parameters, as upstream rounds."""
    total = 0.0
    for p in params:
        if p.grad is not None and p.requires_grad and id(p) in hooked:
            total += float(p.grad.detach().float().pow(2).sum().item())
    return total


def unmeasured_message(where: List[str], consequence: str) -> str:
    """The warning for gradients of parameters unfrozen since they were hooked (``where``: from :func:`hook_unfrozen`)."""
    return (
        f"AdaScale: parameters with a gradient but without AdaScale's hook ({'; '.join(where)}): they did not require "
        f"grad when AdaScale hooked the parameters (unfrozen since). They are hooked now; {consequence}, and later "
        "steps measure them."
    )
