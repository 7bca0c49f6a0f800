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
"""

import warnings
import weakref
from typing import Any, List, Optional

from fairscale.internal import collectives

from .state import HandleState

__all__ = ["ExecutionOrder"]


class ExecutionOrder:
    """The order of units in one kind of pass (``"forward"`` or ``"backward"``), recorded from the previous one.

    Args:
        kind: ``"forward"`` or ``"backward"``, for messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._recorded: List["weakref.ref[Any]"] = []
        self._current: List["weakref.ref[Any]"] = []
        self._on_track = True
        self._warned = False
        self._used = False  # some unit prefetches along this order (else a change is not worth a warning)

    def restart(self) -> None:
        """Forget a partly run pass (a new pass starts)."""
        self._current = []
        self._on_track = True

    def visit(self, unit: Any, prefetching: bool) -> Optional[Any]:
        """``unit`` starts its part of the pass; returns the unit to prefetch (the recorded next one), if any.

        Args:
            unit: the FSDP instance.
            prefetching: whether ``unit`` will prefetch the returned unit (its flag for this kind of pass).
        """
        self._used = self._used or prefetching
        k = len(self._current)
        self._current.append(weakref.ref(unit))
        if not self._on_track:
            return None
        if k >= len(self._recorded) or self._recorded[k]() is not unit:
            self._on_track = False
            return None
        return self._recorded[k + 1]() if k + 1 < len(self._recorded) else None

    def finish(self) -> None:
        """The pass ended: its order becomes the recorded one (with a warning, once, when it changed)."""
        if not self._current:
            return
        before = [r() for r in self._recorded]
        if self._used and before and before != [r() for r in self._current] and not self._warned:
            self._warned = True
            warnings.warn(
                f"FullyShardedDataParallel: the {self.kind} order of the FSDP units changed since the previous "
                f"{self.kind}; {self.kind} prefetch follows the new order from the next pass on (results are not "
                "affected). Models whose unit order changes every step gain nothing from prefetch.",
                stacklevel=2,
            )
        self._recorded = self._current
        self.restart()


def on_forward(fsdp: Any) -> None:
    """A unit's forward gathered its own parameters (not a recomputation): record it, maybe prefetch the next."""
    tree = fsdp._tree
    if tree is None or not tree.forward_running:
        return
    target = tree.forward_order.visit(fsdp, fsdp.forward_prefetch)
    if fsdp.forward_prefetch:
        prefetch(target, tree, "forward")


def on_pre_backward(fsdp: Any) -> None:
    """A unit reached its pre-backward point (first time in this backward): record it, maybe prefetch the next."""
    tree = fsdp._tree
    if tree is None:
        return
    target = tree.backward_order.visit(fsdp, fsdp.backward_prefetch)
    if fsdp.backward_prefetch:
        prefetch(target, tree, "backward")


def prefetch(target: Any, tree: Any, phase: str) -> None:
    """Issue the all-gathers of ``target``'s handles that are not gathered yet, without waiting for them.

    A handle in ``ZERO2_SLICE`` gathers from its slice over the zero2 group, any other from its shard over the
    sharding group: exactly what the unit's own gather would do.
    """
    if target is None or target._tree is not tree:
        return
    todo = [h for h in target._handles if h.materialized and h.state != HandleState.FULL and h.pending_gather is None]
    if not todo:
        return
    current = tree.device.current_stream()
    tree.all_gather_stream.wait_stream(current)
    with collectives.collective_phase(phase), tree.device.stream(tree.all_gather_stream):
        for h in todo:
            target._gather_one(h, async_op=True)
