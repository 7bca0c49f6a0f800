# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Clear errors for two ``optimizer.step()`` mistakes: a step inside a ``no_sync()`` accumulation window, and an
optimizer built on parameters that FSDP flattened away.

Inside a window a sharded parameter holds this rank's unreduced, full-size gradient (or, with
``optimize_backward_concat``, a view of the window's buffer) next to its shard. An optimizer step then failed inside
torch with "The size of tensor a ... must match the size of tensor b", which names neither FSDP nor the window. FSDP
does not see the optimizer's call, so a global optimizer pre-step hook (torch's, registered once, on the first
backward that leaves a gradient unreduced) asks the trees that did so whether the stepped parameters hold one.

Cost: every optimizer step of the process calls the hook; without a watched tree it returns at once. A watched tree
is looked at in the next step only, and forgotten once none of its parameters holds an unreduced gradient.

An optimizer built before wrapping (``opt = SGD(model.parameters()); model = FSDP(model)``) holds the original
parameters, which ``flatten_parameters=True`` copied into flat parameters: they get no gradient, so every step did
nothing, silently (upstream the same). Once an instance has flattened parameters, a second hook looks at each
optimizer's parameters once (again when their count changes: ``add_param_group``) and raises when one of them was
flattened away. Per step it costs a lookup and a count of the parameter groups.
"""

import functools
import weakref
from typing import Any, Callable, Optional, Set, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fairscale.internal.compiler import call_outside_compiler
from fairscale.internal.errors import FairscaleRuntimeError

from .cleared_window import settle_cleared_windows
from .handle import FlatHandle
from .recovery import recover_between_steps
from .ties import is_flattened_away
from .unit import FSDPUnit

# Roots (weak: a dropped model is no longer watched): every root, for the recovery before a step.
_roots: "weakref.WeakSet[FSDPUnit]" = weakref.WeakSet()
_recovery_registered = False


def _eager(hook: Callable[..., Optional[Any]]) -> Callable[..., Optional[Any]]:
    """``hook``, run as eager Python inside a compiled ``optimizer.step()``: traced, it read an FSDP parameter's
    full-size gradient beside its shard and failed in the compiler ("attempting to assign a gradient of size [74] to
    a tensor of size [37]") before its own message (found by a fuzz of torch.compile, session 43)."""
    return functools.partial(call_outside_compiler, hook)


def recover_before_steps(root: FSDPUnit) -> None:
    """From now on, an ``optimizer.step()`` first resets ``root``'s tree after a backward that raised (registered
    once, when a root is found). Before, the step saw the full parameters that backward had gathered (a shape
    error), and skipped the parameters whose reduced gradient FSDP had moved aside for it."""
    global _recovery_registered
    if not _recovery_registered:
        register_optimizer_step_pre_hook(_eager(_recover_before_step))
        _recovery_registered = True
    _roots.add(root)


def _recover_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Optional[Any]:
    # Cost per step: one flag per root (a backward left unfinished keeps its end-of-backward callback queued).
    for root in list(_roots):
        if not root.alive:  # a replaced model whose graph is still referenced: nothing of it is stepped any more
            _roots.discard(root)
            continue
        tree = root.tree
        if tree is not None and tree.root is not None and tree.final_callback_queued:
            recover_between_steps(root)
    return None


# Roots whose last backward left gradients unreduced (weak: a dropped model is no longer watched).
_watched: "weakref.WeakSet[FSDPUnit]" = weakref.WeakSet()
_registered = False


def watch(root: FSDPUnit) -> None:
    """Note that ``root``'s tree left gradients unreduced (a ``no_sync()`` backward)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_eager(_before_step))
        _registered = True
    _watched.add(root)


def _unreduced(root: FSDPUnit, stepped: Set[int]) -> Tuple[bool, Optional[FlatHandle]]:
    """Whether ``root``'s tree still holds an unreduced gradient, and the first such handle whose parameter is among
    ``stepped`` (ids of the optimizer's parameters)."""
    held = False
    for u in root.tree_units():
        for h in u.handles:
            # A gradient cleared to None inside the window (zero_grad()) is skipped by the optimizer: nothing to refuse.
            if h.param.grad is not None and h.holds_unreduced_grad():
                if id(h.param) in stepped:
                    return True, h
                held = True
    return held, None


def _path(root: FSDPUnit, handle: FlatHandle) -> str:
    """The parameter's name as the root's ``named_parameters()`` gives it (the error path only)."""
    for path, unit in root.named_units():
        if any(h is handle for h in unit.handles):
            return f"{path}.{handle.name}" if path else handle.name
    return handle.name


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Optional[Any]:
    if not _watched:
        return None
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for root in list(_watched):
        if not root.alive:  # replaced (a kept loss holds its unit): every later step of the process raised here
            _watched.discard(root)
            continue
        settle_cleared_windows(root)  # a window cleared with zero_grad(set_to_none=False) steps with zeros
        held, found = _unreduced(root, stepped)
        if found is not None:
            raise FairscaleRuntimeError(
                f"optimizer.step() inside a no_sync() accumulation window: FSDP parameter {_path(root, found)!r} holds "
                "this rank's unreduced, full-size gradient of the window's backward passes, which the optimizer "
                "cannot apply to the parameter's shard. Step after the window's last backward, the one outside "
                "no_sync(), or drop the window's gradients first with zero_grad(); nothing was changed."
            )
        if not held:
            _watched.discard(root)  # its window was reduced or cleared
    return None


# Optimizers already looked at, with their parameter count and the flattening generation then (weak: a dropped
# optimizer is forgotten).
_checked_optimizers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[int, int]]" = weakref.WeakKeyDictionary()
_flattened_guard_registered = False
# Counts the instances that flattened parameters: an optimizer checked (and stepped) before its model was wrapped is
# checked again after, which had stepped over the flattened-away parameters silently (a fuzz, session 50).
_flattening_generation = 0


def guard_flattened_parameters() -> None:
    """Refuse, from now on, an optimizer step over parameters that an FSDP instance flattened away (registered once,
    when an instance first flattens parameters; called by every instance that flattens, so that optimizers checked
    before are checked again)."""
    global _flattened_guard_registered, _flattening_generation
    _flattening_generation += 1
    if not _flattened_guard_registered:
        register_optimizer_step_pre_hook(_eager(_before_step_flattened))
        _flattened_guard_registered = True


def _before_step_flattened(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Optional[Any]:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    try:
        if _checked_optimizers.get(optimizer) == (count, _flattening_generation):
            return None
    except TypeError:  # pragma: no cover - an optimizer class that cannot be weakly referenced: checked every step
        pass
    dead = [
        (g, i)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if is_flattened_away(p)
    ]
    if dead:
        g, i = dead[0]
        raise FairscaleRuntimeError(
            f"{type(optimizer).__name__}.step(): {len(dead)} of the optimizer's {count} parameters (the first: param "
            f"group {g}, index {i}) were flattened into FullyShardedDataParallel's flat parameters: they get no "
            "gradient, so this step would change nothing. Build the optimizer on the wrapped model's parameters, "
            "after wrapping: optimizer = SGD(fsdp_model.parameters(), ...); nothing was changed."
        )
    try:
        _checked_optimizers[optimizer] = (count, _flattening_generation)
    except TypeError:  # pragma: no cover - an optimizer class that cannot be weakly referenced: checked every step
        pass
    return None
