# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The order in which the units of one FSDP tree ran in the previous pass (what prefetch follows, see prefetch.py)."""

import warnings
import weakref
from typing import Any, List, Optional

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
