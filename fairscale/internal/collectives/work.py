# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Handles of asynchronous collectives and the completion steps they run (copy-backs, the simulated link)."""

import time
from typing import Any, Callable, Optional

from torch import Tensor

from .. import simulated_link as _link


class WorkHandle:
    """Handle of an asynchronous collective; call :meth:`wait` before reading the result.

    It wraps torch's work object plus an optional completion step (e.g. copying out of a
    temporary buffer a fallback used), which runs exactly once, in :meth:`wait`. A handle
    without work is already complete (what synchronous fallbacks and world size 1 return).
    """

    __slots__ = ("_work", "_on_complete", "_done", "_ready_at")

    def __init__(self, work: Any = None, on_complete: Optional[Callable[[], None]] = None) -> None:
        self._work = work
        self._on_complete = on_complete
        self._done = work is None and on_complete is None
        self._ready_at: Optional[float] = None  # simulated link: not complete before this time.monotonic()

    def _complete_no_earlier_than(self, ready_at: Optional[float]) -> None:
        if ready_at is not None:
            self._ready_at = ready_at
            self._done = False

    def wait(self) -> None:
        """Block until the collective is done (on accelerators: order the current stream after it)."""
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        _link.sleep_until(self._ready_at)
        self._done = True
        if self._on_complete is not None:
            self._on_complete()

    def is_completed(self) -> bool:
        """Whether the result can be read; finishes the completion step when the work is done."""
        if self._done:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        if self._ready_at is not None and time.monotonic() < self._ready_at:
            return False
        self.wait()
        return True


def _copy_back(dst: Tensor, src: Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src)

    return copy


def _finish(handle: WorkHandle, async_op: bool, ready_at: Optional[float] = None) -> Optional[WorkHandle]:
    handle._complete_no_earlier_than(ready_at)
    if async_op:
        return handle
    handle.wait()
    return None
