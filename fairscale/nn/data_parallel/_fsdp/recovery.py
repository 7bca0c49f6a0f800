# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recovery from a backward that raised: the root's next forward resets the tree before the next step.

A backward that raises (an error in a hook or a layer, or a second ``loss.backward()`` through a freed graph) never
runs FSDP's final callback: instances stay in a backward state, full parameters stay gathered and partial reductions
stay pending. The root's next forward detects this and puts every instance back to idle. Partial reductions of the
failed backward are dropped (its gradients are incomplete anyway). What earlier *completed* backwards left is given
back, as ``nn.Module`` would keep it, unless the user cleared the gradients since: a reduced gradient that FSDP had
taken out of ``p.grad`` for the failed backward (and the reduced shards of earlier windows it holds aside) cannot be
seen by an optimizer's ``zero_grad()``, which is the usual way to drop a step after a failed backward (before, they
came back and the next step applied them: silently wrong). ``p.grad`` empty or all zero at the recovery counts as
cleared; a gradient the failed backward never reached is then dropped too (a plain module would keep it, mixed with
the failed backward's partial gradients elsewhere: after a failed backward, call ``zero_grad()``). An
``optimize_backward_concat`` window buffer that the failed backward itself opened holds only its partial writes and
is dropped; one a completed backward of the window exposed as ``p.grad`` follows that ``p.grad`` at the next backward
(see ``FlatHandle.drop_window_if_cleared``).

The calls a training loop makes next without a forward (``state_dict()`` to save a checkpoint after a failed step,
``summon_full_params()``, ``clip_grad_norm_()``, ``no_sync()``, ``copy.deepcopy``, and an ``optimizer.step()``, through
a global pre-step hook) recover the same way first (:func:`recover_between_steps`): they were refused before, with
messages about being "inside forward or backward", and a step saw the gathered full parameters.
"""

import warnings
from typing import List, Optional

import torch

from .handle import FlatHandle
from .state import TrainingState
from .unit import FSDPUnit


def recover_from_aborted_backward(root: FSDPUnit, units: Optional[List[FSDPUnit]] = None) -> None:
    """Reset ``root``'s tree after a backward that raised (a no-op when the last backward finished).

    ``units``: ``root.tree_units()`` when the caller listed them already (the root's forward).
    """
    tree = root.tree
    if tree is None:
        return
    if units is None:
        units = root.tree_units()
    if not (tree.final_callback_queued or any(u.pre_backward_ran for u in units)):
        return
    warnings.warn(
        "FullyShardedDataParallel: the previous backward did not finish (it raised); resetting. Gradients of earlier "
        "backwards of the step that FSDP held aside for it are dropped where p.grad is empty or zero (call zero_grad() "
        "after a failed backward to drop the step)."
    )
    tree.bucketer.discard()
    tree.release_held()
    tree.abandon_started_backwards()
    for u in units:
        u.release_all()
        for h in u.iter_materialized():
            undo_partial_backward(h)
        u.transition(TrainingState.IDLE)
    tree.final_callback_queued = False
    tree.any_post_backward = False


def recover_between_steps(unit: FSDPUnit) -> None:
    """Reset the tree of ``unit`` after a backward that raised, when called outside any forward and backward (a
    no-op otherwise, and when the last backward finished)."""
    tree = unit.tree
    if tree is None or tree.root is None or tree.forward_running:
        return
    if torch._C._current_graph_task_id() != -1 or tree.backward_running():
        # Inside a backward (a hook, a recomputation), or called from another thread while the tree's backward runs
        # (the graph task id is per thread; the engine still holds that backward's end-of-backward callback): that
        # backward is running, not aborted.
        return
    root = tree.root()
    if root is not None:
        recover_from_aborted_backward(root)


def undo_partial_backward(h: FlatHandle) -> None:
    """Drop the partial reductions of a backward that raised; give back what completed backwards left, unless the
    user cleared ``p.grad`` since (see the module docstring)."""
    if h.grad_before_backward is None:
        return  # this handle took no part in the failed backward: nothing of it to drop
    saved, parked = h.grad_before_backward
    if h.grad_accum_flat is not None and not h.window_open_before_backward:
        # The window buffer holds the failed backward's partial writes only (no completed backward of the window
        # exposed it): nothing a zero_grad() could have reached, and nothing to keep.
        if h.param.grad is not None and h.param.grad is h.grad_accum_grad:
            h.param.grad = None
        h.grad_accum_flat = None
        h.grad_accum_views = []
        h.grad_accum_grad = None
    grad = h.param.grad
    if grad is None or not bool(grad.any()):
        h.saved_grad_shard = None  # cleared (or never reached): the step's gradient is gone, as the user's zero_grad()
    else:
        h.saved_grad_shard = saved
        if parked is not None:
            # Whatever p.grad holds now was written by the failed backward (p.grad held the reduced shard when it began).
            h.param.grad = parked
            h.remember_assigned_grad(parked)
        elif h.no_grad_before_backward and h.grad_accum_flat is None:
            # p.grad was empty when the failed backward began, so an unreduced gradient there now is that backward's
            # (a reduction deferred to its end: a unit used by two forwards, a shared parameter's part waiting for the
            # owner's): the next backward would take it for a no_sync() window's sum and reduce it with its own.
            h.param.grad = None
    h.end_backward()
