# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""All-gather prefetch: the next unit's parameters are on the wire while the current unit computes.

Without prefetch every unit waits for its own all-gather right before it computes, so communication time adds to
compute time. With it, when unit *i* starts (its forward, or its pre-backward point), the all-gather of the unit
that runs next is issued asynchronously; that unit waits for it only when it reads its parameters
(:meth:`FlatHandle.finish_gather`), by which time it has usually arrived.

Which unit runs next comes from the previous pass: each tree records the order in which its units ran their
forward (the root's forward, recomputations excluded) and reached their pre-backward point (one backward). A pass
prefetches only while it follows the recorded order; when the order changes a warning is issued, nothing is
prefetched for the rest of that pass, and the new order is recorded (never a wrong result: at worst a gather that
would have happened anyway happens early, or one that was not needed is freed unused).

At most one unit is gathered ahead, so prefetch costs at most one extra unit's full parameters of memory. The
gathered values are those the unit would gather itself: numerics are bitwise identical with prefetch on and off.
On CPU/gloo the asynchronous work runs on gloo's threads; on accelerators it runs on the tree's all-gather stream
and the compute stream waits for it (NCCL work handles order the waiting stream after the collective).

``forward_prefetch=None`` (the default) is *auto*: a unit prefetches in the forward when its compute device is the
CPU, its ``backward_prefetch`` is on and autograd records the forward (a training forward). Why only then:

* On accelerators the forward overlaps without it: a unit's gather is queued on the all-gather stream and the CPU
  goes on to queue the unit's compute and reach the next unit's gather while the device still computes, so the
  next unit's parameters are already allocated and on the wire. On CPU a gloo gather blocks the thread that
  computes, so without prefetch every forward gather waits for the slowest rank, once per unit (measured: most of
  the gap between the benchmark's plain step and DDP's on CPU, see docs/benchmarks.rst).
* It does not raise the peak of a training step: when unit *i* computes its forward with unit *i+1* gathered
  ahead, the backward that follows holds at least as much when it reaches unit *i+1* with unit *i* prefetched
  (both units' full parameters, the activations of every unit up to *i+1*, and the incoming gradient). With
  ``backward_prefetch=False`` that argument does not hold, so auto stays off.
* A forward without autograd (evaluation) has no backward to compare with: the extra unit would be its peak.
"""

from typing import Optional

import torch

from fairscale.internal import collectives

from .state import HandleState, TrainingState
from .tree import TreeState
from .unit import FSDPUnit


def on_forward(unit: FSDPUnit) -> None:
    """A unit's forward gathered its own parameters (not a recomputation): record it, maybe prefetch the next."""
    tree = unit.tree
    if tree is None:
        return
    tree.prefetched_ahead.pop(unit, None)  # its gathers are this forward's now
    if not tree.forward_running:
        return
    enabled = forward_prefetch_enabled(unit, tree)
    target = tree.forward_order.visit(unit, enabled)
    if enabled:
        prefetch(target, tree, "forward")


def forward_prefetch_enabled(unit: FSDPUnit, tree: TreeState) -> bool:
    """Whether ``unit``'s forward prefetches now: its ``forward_prefetch``, or the auto rule when that is ``None``
    (module docstring)."""
    setting = unit.config.forward_prefetch
    if setting is not None:
        return setting
    return unit.config.backward_prefetch and not tree.device.is_accelerator and torch.is_grad_enabled()


def on_pre_backward(unit: FSDPUnit) -> None:
    """A unit reached its pre-backward point (first time in this backward): record it, maybe prefetch the next."""
    tree = unit.tree
    if tree is None:
        return
    enabled = unit.config.backward_prefetch
    target = tree.backward_order.visit(unit, enabled)
    if enabled:
        prefetch(target, tree, "backward")


def prefetch(target: Optional[FSDPUnit], tree: TreeState, phase: str) -> None:
    """Issue the all-gathers of ``target``'s handles that are not gathered yet, without waiting for them.

    A handle in ``ZERO2_SLICE`` gathers from its slice over the zero2 group, any other from its shard over the
    sharding group: exactly what the unit's own gather would do.
    """
    if target is None or target.tree is not tree:
        return
    if phase == "forward":
        # What the target's own forward does first: a zero2 slice or gathered copy kept for a forward whose backward
        # never ran is stale after an optimizer step (a fuzz of several forwards before their backwards, session 46).
        target.drop_stale_full_params()
    todo = [
        h
        for h in target.handles
        if h.fp32_shard is not None and h.state is not HandleState.FULL and h.pending_gather is None  # materialized
    ]
    if not todo:
        return
    if phase == "forward":
        tree.prefetched_ahead[target] = todo
    if not tree.device.is_accelerator:  # CPU: inert streams, nothing to order (see unit.rebuild_full_params)
        with collectives.collective_phase(phase):
            for h in todo:
                target.gather_one(h, async_op=True)
        return
    current = tree.device.current_stream()
    tree.all_gather_stream.wait_stream(current)
    with collectives.collective_phase(phase), tree.device.stream(tree.all_gather_stream):
        for h in todo:
            target.gather_one(h, async_op=True)


def end_of_forward(tree: TreeState, evaluation: bool) -> None:
    """The root's forward returned: free what a forward prefetch gathered for a unit that this forward never ran (an
    early exit, a draft model's first layers) when no backward follows (an evaluation forward). It stayed gathered
    until that unit's next forward (a fuzz of inference patterns, session 46); a training forward's end of backward
    frees it."""
    if not tree.prefetched_ahead:
        return
    left = list(tree.prefetched_ahead.items())
    tree.prefetched_ahead.clear()
    if not evaluation:
        return
    for unit, handles in left:
        if unit.training_state == TrainingState.IDLE:
            for h in handles:
                if h.state is HandleState.FULL:
                    h.free_full()
