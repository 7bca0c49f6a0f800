# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recovery from a backward that raised: the root's next forward resets the tree before the next step.

A backward that raises (an error in a hook or a layer, or a second ``loss.backward()`` through a freed graph) never
runs FSDP's final callback: instances stay in a backward state, full parameters stay gathered and partial reductions
stay pending. The root's next forward detects this and puts every instance back to idle. Partial reductions of the
failed backward are dropped (its gradients are incomplete anyway); what earlier *completed* backwards left, in
``p.grad`` or in the reduced-shard accumulator, is given back, as ``nn.Module`` would keep it.
"""

import warnings
from typing import TYPE_CHECKING

from . import grad_accum
from .handle import FlatHandle
from .state import TrainingState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import FSDPRuntime


def undo_partial_backward(h: FlatHandle) -> None:
    """Drop the partial reductions of a backward that raised; give back what completed backwards left.

    ``saved_grad_shard`` goes back to its value when that backward started, and a reduced shard it took out of
    ``p.grad`` is put back there.
    """
    if h.grad_before_backward is None:
        return  # this handle's instance took no part in the failed backward: nothing of it to drop
    saved, parked = h.grad_before_backward
    h.saved_grad_shard = saved
    if parked is not None:
        # Whatever p.grad holds now was written by the failed backward (p.grad held the reduced shard when it began).
        h.param.grad = parked
        h.remember_assigned_grad(parked)
    h.grad_before_backward = h.keep_intact = None


def recover_from_aborted_backward(root: "FSDPRuntime") -> None:
    """Reset ``root``'s tree after a backward that raised (a no-op when the last backward finished)."""
    tree = root._tree
    if tree is None:
        return
    instances = root._fsdp_instances()
    stuck = [m for m in instances if m.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)]
    if not (tree.final_callback_queued or stuck):
        return
    warnings.warn("FullyShardedDataParallel: the previous backward did not finish (it raised); resetting.")
    tree.bucketer.discard()
    for m in instances:
        for h in m._handles:
            if not h.materialized:
                continue
            h.free_full()
            h.drop_zero2_slice()
            h.use_shard()
            undo_partial_backward(h)
            if h.grad_accum_flat is not None:
                grad_accum.take_buffer_for_reduction(h)
        m._pre_backward_hook_has_run = False
        m.training_state = TrainingState.IDLE
    tree.final_callback_queued = False
    tree.any_post_backward = False
