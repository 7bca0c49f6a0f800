# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Bytes of the C heap in use by this process (glibc), and a thread that samples their peak.

On CPU, tensors live in the C heap. glibc's ``mallinfo2`` reports the bytes in use in the main arena plus every
``mmap``-ed block; large tensors (all the ones that matter here) are ``mmap``-ed or come from the main arena,
whichever thread allocates or frees them. That makes it a better CPU peak than the profiler's allocator events,
which see only the profiled thread: gloo frees some buffers (and allocates its scratch buffers) on its own worker
threads. Small allocations of other threads' arenas are not counted, and the sample interval bounds how short a
peak can be and still be seen.
"""

import ctypes
import ctypes.util
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["HEAP_METHOD_PREFIX", "heap_in_use", "HeapSampler"]

#: How the main job's JSON names this method (``memory_method`` starts with it).
HEAP_METHOD_PREFIX = "glibc heap in use"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _load_mallinfo2() -> Optional[Callable[[], Any]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def heap_in_use() -> Optional[int]:
    """Bytes in use (main arena + ``mmap``-ed blocks), or ``None`` without glibc's ``mallinfo2``."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class HeapSampler:
    """Context manager: samples :func:`heap_in_use` on a thread every ``interval_s`` and keeps the maximum.

    The default interval (0.1 ms) catches the concat temporary of a small unit's gradient, which 0.5 ms missed on
    some ranks; a sampled peak can still only be missed, never invented.

    Attributes:
        peak (int): the highest sample (at least the values at entry and exit).
    """

    def __init__(self, interval_s: float = 0.0001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-sampler", daemon=True)

    def _sample(self) -> None:
        value = heap_in_use()
        if value is not None and value > self.peak:
            self.peak = value

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> "HeapSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
