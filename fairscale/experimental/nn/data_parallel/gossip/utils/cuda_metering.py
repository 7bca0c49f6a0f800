# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Named timers for profiling SlowMo: device events on an accelerator, the wall clock on the CPU."""

import collections
import statistics
import time
from typing import Any, ClassVar, Deque, Dict, Optional

from fairscale.internal.device import current_accelerator_device, new_timing_event

__all__ = [
    "CudaEventRecorder",
    "DummyCudaEventRecorder",
    "EventRecorder",
    "create_event_recorder",
    "create_and_record_event",
    "MAX_LEN_DEQUEUE",
]

MAX_LEN_DEQUEUE = 10**4


def _deque() -> Deque["CudaEventRecorder"]:
    return collections.deque(maxlen=MAX_LEN_DEQUEUE)


def create_and_record_event() -> Optional[Any]:
    """A recorded timing event on the current accelerator, or ``None`` without one."""
    device = current_accelerator_device()
    if device is None:
        return None
    event = new_timing_event(device)
    if event is not None:
        event.record()
    return event


class EventRecorder:
    """Interface of the recorders."""

    def stop(self) -> None:
        raise NotImplementedError

    def find_time_elapsed(self) -> float:
        raise NotImplementedError


class CudaEventRecorder(EventRecorder):
    """Times the span from construction to :meth:`stop` (ms); registers itself under ``event_name``."""

    event_recorders: ClassVar[Dict[str, Deque["CudaEventRecorder"]]] = collections.defaultdict(_deque)
    all_event_recorders: ClassVar[Dict[str, Deque["CudaEventRecorder"]]] = collections.defaultdict(_deque)

    def __init__(self, event_name: str) -> None:
        self.event_name = event_name
        self.start_event = create_and_record_event()
        self.start_time = time.perf_counter()
        self.end_event: Optional[Any] = None
        self.end_time: Optional[float] = None
        CudaEventRecorder.event_recorders[event_name].append(self)
        CudaEventRecorder.all_event_recorders[event_name].append(self)

    def stop(self) -> None:
        self.end_event = create_and_record_event()
        self.end_time = time.perf_counter()

    def find_time_elapsed(self) -> float:
        if self.end_time is None:
            raise Exception(f"stopEvent was not called for event with name {self.event_name}")
        if self.start_event is not None and self.end_event is not None:
            self.end_event.synchronize()
            return float(self.start_event.elapsed_time(self.end_event))
        return (self.end_time - self.start_time) * 1000.0

    @classmethod
    def reset(cls) -> None:
        cls.event_recorders = collections.defaultdict(_deque)

    @classmethod
    def get_common_timings(cls, event_recorders: Dict[str, Deque["CudaEventRecorder"]], description: str) -> str:
        lines = [f"{description}:"]
        for name, recorders in event_recorders.items():
            times = [r.find_time_elapsed() for r in recorders]
            if not times:
                continue
            lines.append(
                f"{name}: Time taken: avg: {statistics.mean(times)}, std: {statistics.pstdev(times)}, "
                f"count: {len(times)}"
            )
        return "\n".join(lines)

    @classmethod
    def get_timings(cls) -> str:
        return cls.get_common_timings(cls.event_recorders, "Timings since last reset")

    @classmethod
    def get_all_timings(cls) -> str:
        return cls.get_common_timings(cls.all_event_recorders, "All timings")


class DummyCudaEventRecorder(EventRecorder):
    """A recorder that records nothing (used unless ``profile_mode`` is on)."""

    def stop(self) -> None:
        pass

    def find_time_elapsed(self) -> float:
        return 0.0


def create_event_recorder(event_name: str, dummy: bool = False) -> EventRecorder:
    """A :class:`CudaEventRecorder`, or a :class:`DummyCudaEventRecorder` when ``dummy``."""
    if dummy:
        return DummyCudaEventRecorder()
    return CudaEventRecorder(event_name)
