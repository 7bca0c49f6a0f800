# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which backward task a unit's gradients belong to, when its parameters are used by nested backward tasks.

A unit's backward begins in the task that reaches its outputs' hooks first (:func:`.runtime.pre_backward` records
it as ``unit.backward_task``, with whether that task accumulates into the unit's parameters). A gradient that reaches
the parameters in a nested task while the recorded task still uses them (a reentrant ``torch.utils.checkpoint``
around part of the unit) is only part of the unit's gradient: it accumulates, and the recorded task reduces the sum.

``FSDP(checkpoint_wrapper(block))`` begins its backward in the user's task, which accumulates nothing into the
unit's parameters (the first pass ran without autograd); the recomputation's own backward, a nested task, does. That
task takes over as the unit's backward task when it reaches the recomputed outputs (hooked here, through
:mod:`fairscale.nn.checkpoint`'s recomputation hooks) or the outputs of an inner unit. A backward nested one level
further (a reentrant ``torch.utils.checkpoint`` inside ``block``) then accumulates and leaves the full parameters in
place. Before, that innermost backward reduced and freed them while the recomputation's backward still read them
("setStorage ... out of bounds for storage of size 0").
"""

import weakref
from typing import Sequence

from torch import Tensor, nn

from fairscale.internal import tensor_hooks
from fairscale.nn.checkpoint._recomputation_hooks import register_recomputation_hook
from fairscale.nn.checkpoint.checkpoint_activations import _CheckpointedForward

from .unit import FSDPUnit

__all__ = [
    "adopt_nested_task_if_it_uses_params",
    "only_nested_tasks_use_params",
    "task_uses_params",
    "watch_whole_unit_recomputation",
]

# The checkpointed module that is a unit's whole wrapped module -> that unit (both weakly).
_units_of_checkpointed_modules: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[FSDPUnit]]" = (
    weakref.WeakKeyDictionary()
)


def task_uses_params(unit: FSDPUnit) -> bool:
    """Whether the running backward task will accumulate gradients into the unit's parameters."""
    accs = unit.grad_accs
    if accs is None:
        accs = unit.grad_accs = [a for a in map(tensor_hooks.grad_accumulator, unit.params) if a is not None]
    will_execute = tensor_hooks.will_engine_execute_node
    try:
        if any(map(will_execute, accs)):
            return True
        if unit.forward_grad_accs:  # see FSDPUnit.forward_grad_accs
            return any(will_execute(a) for per_forward in list(unit.forward_grad_accs.values()) for a in per_forward)
        return False
    except RuntimeError:  # torch.autograd.grad(): no leaf accumulates, no gradient hook comes
        return False


def adopt_nested_task_if_it_uses_params(unit: FSDPUnit) -> None:
    """A unit whose backward began in a task that does not use its parameters: a nested task that does becomes the
    unit's backward task (see the module doc)."""
    if not unit.pre_backward_ran or unit.outer_task_uses_params:
        return
    task = tensor_hooks.current_graph_task()
    if task == -1 or task == unit.backward_task:
        return
    if task_uses_params(unit):
        unit.backward_task = task
        unit.outer_task_uses_params = True


def only_nested_tasks_use_params(unit: FSDPUnit) -> bool:
    """Whether a gradient of the unit arrives in a backward nested inside its backward task, which itself uses none of
    the unit's parameters: every parameter is used inside reentrant checkpoints (several of them, maybe, each with a
    nested backward of its own, run one after another: the full parameters must outlive the first)."""
    task = tensor_hooks.current_graph_task()
    return not unit.outer_task_uses_params and task != -1 and task != unit.backward_task


def watch_whole_unit_recomputation(unit: FSDPUnit) -> None:
    """If the unit's whole wrapped module is checkpointed, follow its recomputations' backward tasks."""
    module = getattr(unit.wrapped, "module", None)
    if isinstance(module, nn.Module) and isinstance(module.__dict__.get("forward"), _CheckpointedForward):
        _units_of_checkpointed_modules[module] = weakref.ref(unit)


def _on_recomputation(module: nn.Module, outputs: Sequence[Tensor]) -> None:
    unit_ref = _units_of_checkpointed_modules.get(module)
    if unit_ref is None:
        return

    def hook(_grad: Tensor) -> None:
        unit = unit_ref()
        if unit is not None:
            adopt_nested_task_if_it_uses_params(unit)

    for t in outputs:
        # Not on a leaf (a parameter the forward returns as it is): a leaf keeps its hooks for good, one more per step.
        if t.requires_grad and not t.is_leaf:
            tensor_hooks.register_grad_hook(t, hook)


register_recomputation_hook(_on_recomputation)
