# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recovery from a backward that raised: the root's next forward resets the tree before the next step.

A backward that raises (an error in a hook or a layer, or a second ``loss.backward()`` through a freed graph) never
runs FSDP's final callback: instances stay in a backward state, full parameters stay gathered and partial reductions
stay pending. The root's next forward detects this and puts every instance back to idle. Partial reductions of the
failed backward are dropped (its gradients are incomplete anyway); what earlier *completed* backwards left, in
``p.grad``, in the reduced-shard accumulator or in an ``optimize_backward_concat`` window buffer, is given back, as
``nn.Module`` would keep it.

The calls a training loop makes next without a forward (``state_dict()`` to save a checkpoint after a failed step,
``summon_full_params()``, ``clip_grad_norm_()``, ``no_sync()``, ``copy.deepcopy``) recover the same way first
(:func:`recover_between_steps`): they were refused before, with messages about being "inside forward or backward".
"""

import warnings

import torch

from .state import TrainingState
from .unit import FSDPUnit


def recover_from_aborted_backward(root: FSDPUnit) -> None:
    """Reset ``root``'s tree after a backward that raised (a no-op when the last backward finished)."""
    tree = root.tree
    if tree is None:
        return
    units = root.tree_units()
    if not (tree.final_callback_queued or any(u.pre_backward_ran for u in units)):
        return
    warnings.warn("FullyShardedDataParallel: the previous backward did not finish (it raised); resetting.")
    tree.bucketer.discard()
    tree.release_held()
    for u in units:
        u.release_all()
        for h in u.iter_materialized():
            h.undo_partial_backward()
            # An optimize_backward_concat window buffer is kept, like the unreduced p.grad of the flag-off path: it
            # holds the completed microbatches of the window (and whatever units of the failed one finished first,
            # as p.grad does), and the window goes on.
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
