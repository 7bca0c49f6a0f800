# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Memory probes for the layer memory tracker: "how many bytes are allocated right now" on any device.

* On an accelerator the caching allocator keeps statistics: a mark reads them at once (after a device sync).
* The CPU allocator keeps none, so the CPU probe runs the autograd profiler with memory profiling while the
  tracker monitors, and a mark is a zero-length ``record_function`` marker. The bytes allocated at a marker are
  resolved later from the profiler's memory events (the sum of every allocation and free that started before
  it), which needs the profiler stopped: :meth:`CpuProfilerProbe.resolve` stops it, reads the events and starts
  a new session. CPU values are therefore relative: bytes allocated (net of frees) since monitoring started.
"""

import bisect
import itertools
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.autograd import profiler

from fairscale.internal.device import DeviceHandle, empty_cache, memory_reserved

__all__ = ["MemoryMark", "MemoryProbe", "AcceleratorProbe", "CpuProfilerProbe", "probe_for"]

_MARKER_PREFIX = "fairscale.layer_memory_tracker#"

# A CPU probe's open profiler session is ended by a finalizer: when the probe is freed without stop() (a tracker and
# its model dropped while monitoring), the global profiler kept running (every later op slower, its events piling
# up, later trackers reading 0) and tearing it down during interpreter finalization crashed the process (SIGSEGV,
# after the script had finished); weakref.finalize also runs at exit, while the interpreter is whole (upstream's
# examples never call stop()).


def _end_profile(prof: Any) -> None:
    try:
        if profiler._is_profiler_enabled:
            prof.__exit__(None, None, None)
    except Exception:  # pragma: no cover - at exit or in a collection nothing is left to report to
        pass


class MemoryMark:
    """A point in time whose ``allocated``/``reserved`` bytes are known now or after :meth:`MemoryProbe.resolve`."""

    __slots__ = ("allocated", "reserved", "marker")

    def __init__(self, allocated: Optional[int], reserved: Optional[int], marker: Optional[str] = None) -> None:
        self.allocated = allocated
        self.reserved = reserved
        self.marker = marker

    @property
    def resolved(self) -> bool:
        return self.allocated is not None


class MemoryProbe:
    """Interface of the probes (see the module docstring)."""

    def start(self) -> None:
        """Begin measuring (called by ``monitor``)."""

    def stop(self) -> None:
        """Stop measuring; marks taken so far stay resolvable."""

    def sync(self) -> None:
        """Wait for queued device work, so that the next mark sees its memory."""

    def mark(self) -> MemoryMark:
        raise NotImplementedError

    def resolve(self, marks: List[MemoryMark]) -> None:
        """Fill in ``allocated``/``reserved`` of unresolved marks."""


class AcceleratorProbe(MemoryProbe):
    """Reads the accelerator allocator's statistics at each mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._handle = DeviceHandle.for_device(device)

    def start(self) -> None:
        empty_cache(self.device)

    def sync(self) -> None:
        self._handle.synchronize()

    def mark(self) -> MemoryMark:
        return MemoryMark(self._handle.memory_allocated(), memory_reserved(self.device))


class CpuProfilerProbe(MemoryProbe):
    """Measures CPU memory with the profiler's memory events (resolved lazily, see the module docstring)."""

    def __init__(self) -> None:
        self._profile: Optional[Any] = None
        self._counter = itertools.count()
        # Bytes allocated at every marker of finished profiler sessions, and the running total at their end.
        self._resolved: Dict[str, int] = {}
        self._offset = 0
        self._warned_lost = False
        self._session_end: "Optional[weakref.finalize[Any, Any]]" = None  # ends the open session if the probe is freed

    def start(self) -> None:
        if self._profile is not None:
            return
        if profiler._is_profiler_enabled:
            # Profilers do not nest: measure nothing rather than break the user's profiling session.
            warnings.warn("LayerwiseMemoryTracker: a profiler is already running, CPU memory will read as 0")
            return
        self._profile = profiler.profile(profile_memory=True, use_kineto=True)
        self._profile.__enter__()
        self._session_end = weakref.finalize(self, _end_profile, self._profile)

    def end_session_quietly(self) -> None:
        """End the profiler session without reading its events (at interpreter exit)."""
        prof, self._profile = self._profile, None
        self._forget_session_end()
        if prof is not None and profiler._is_profiler_enabled:
            prof.__exit__(None, None, None)

    def stop(self) -> None:
        self._finish_session()

    def mark(self) -> MemoryMark:
        name = f"{_MARKER_PREFIX}{next(self._counter)}"
        if self._session_lost():
            # Another profiler ended this session (see _session_lost): measure again from here on.
            self._finish_session()
            self.start()
        if self._profile is None:
            return MemoryMark(0, 0, name)
        with profiler.record_function(name):
            pass
        return MemoryMark(None, None, name)

    def resolve(self, marks: List[MemoryMark]) -> None:
        pending = [m for m in marks if not m.resolved]
        if not pending:
            return
        restart = self._profile is not None
        self._finish_session()
        if restart:
            self.start()
        for m in pending:
            value = self._resolved.get(m.marker or "", 0)
            m.allocated, m.reserved = value, value

    def _session_lost(self) -> bool:
        """Whether another profiler ended this probe's session.

        Profilers do not nest: a ``torch.profiler.profile()`` entered while this probe measures takes over the one
        profiling session, and its exit ends it, with every event this probe had collected: nothing is left to read.
        """
        return self._profile is not None and not profiler._is_profiler_enabled

    def _forget_session_end(self) -> None:
        """The session ends here: its finalizer must not end a later one."""
        if self._session_end is not None:
            self._session_end.detach()
            self._session_end = None

    def _finish_session(self) -> None:
        self._forget_session_end()
        if self._profile is None:
            return
        if self._session_lost():
            self._profile = None
            if not self._warned_lost:
                self._warned_lost = True
                warnings.warn(
                    "LayerwiseMemoryTracker: another profiler (torch.profiler.profile) ran while the tracker measured "
                    "CPU memory and ended its profiling session: the CPU memory values (allocated, reserved, "
                    "memory_diff) of the traces recorded before that profiler ended read 0, and later values count "
                    "from there. Do not profile while a tracker monitors a CPU model (or stop() it first)."
                )
            return
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        starts: List[float] = []
        deltas: List[int] = []
        markers: List[Any] = []
        for event in sorted(prof.function_events, key=lambda e: e.time_range.start):
            if event.name.startswith(_MARKER_PREFIX):
                markers.append(event)
            elif event.self_cpu_memory_usage:
                starts.append(event.time_range.start)
                deltas.append(int(event.self_cpu_memory_usage))
        cumulative = list(itertools.accumulate(deltas))
        for event in markers:
            i = bisect.bisect_left(starts, event.time_range.start)
            self._resolved[event.name] = self._offset + (cumulative[i - 1] if i > 0 else 0)
        self._offset += cumulative[-1] if cumulative else 0


def probe_for(device: torch.device) -> MemoryProbe:
    """The probe for ``device``: allocator statistics on accelerators, the profiler on the CPU."""
    if DeviceHandle.for_device(device).is_accelerator:
        return AcceleratorProbe(device)
    return CpuProfilerProbe()
