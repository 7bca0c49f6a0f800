# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The records of :class:`~.layer_memory_tracker.LayerwiseMemoryTracker`, and reading them back from JSON.

A file given to ``LayerwiseMemoryTracker.load`` is checked as it is read: strings or ``null`` where numbers belong
loaded silently and failed later in ``summary`` with a bare ``TypeError``, ``"is_forward": "no"`` counted as a
forward, and a non-JSON or deeply nested file raised ``JSONDecodeError`` / ``RecursionError`` without the file's
name (a security review, session 50).
"""

import json
import numbers
from typing import Any, Dict, List, NamedTuple

__all__ = ["TraceForwardEvent", "TraceBackwardEvent", "LayerMemoryTrace", "load_traces"]


class TraceForwardEvent(NamedTuple):
    """Forward of a leaf module: memory allocated during it, and bytes of its new outputs."""

    memory_diff: int
    memory_activations: int

    def to_dict(self) -> Dict[str, Any]:
        return {"memory_diff": self.memory_diff, "memory_activations": self.memory_activations}

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "TraceForwardEvent":
        return cls(memory_diff=serialized["memory_diff"], memory_activations=serialized["memory_activations"])


class TraceBackwardEvent(NamedTuple):
    """Backward of a traced module: bytes of the input gradients it produced."""

    memory_activations: int

    def to_dict(self) -> Dict[str, Any]:
        return {"memory_activations": self.memory_activations}

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "TraceBackwardEvent":
        return cls(memory_activations=serialized["memory_activations"])


class LayerMemoryTrace(NamedTuple):
    """One record of the tracker (a forward or a backward of one module)."""

    module_name: str
    module_params: int
    allocated: int
    reserved: int
    is_forward: bool
    all_gathered: int
    cumul_all_gathered: int
    event: Any  # TraceForwardEvent or TraceBackwardEvent

    def to_dict(self) -> Dict[str, Any]:
        return {
            "module_name": self.module_name,
            "module_params": self.module_params,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "is_forward": self.is_forward,
            "all_gathered": self.all_gathered,
            "cumul_all_gathered": self.cumul_all_gathered,
            "event": self.event.to_dict(),
        }

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "LayerMemoryTrace":
        event_cls = TraceForwardEvent if serialized["is_forward"] else TraceBackwardEvent
        return cls(
            module_name=serialized["module_name"],
            module_params=serialized["module_params"],
            allocated=serialized["allocated"],
            reserved=serialized["reserved"],
            is_forward=serialized["is_forward"],
            all_gathered=serialized["all_gathered"],
            cumul_all_gathered=serialized["cumul_all_gathered"],
            event=event_cls.from_dict(serialized["event"]),
        )


_INT_FIELDS = ("module_params", "allocated", "reserved", "all_gathered", "cumul_all_gathered")


def load_traces(path: str) -> List[LayerMemoryTrace]:
    """The traces of a file :meth:`~.layer_memory_tracker.LayerwiseMemoryTracker.save_traces` wrote.

    Raises:
        ValueError: the file is not JSON, or not traces of that form (the message names the file and the entry).
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not traces written by save_traces (not JSON: {type(error).__name__})") from None
    traces = data.get("traces") if isinstance(data, dict) else None
    if not isinstance(traces, list):
        raise ValueError(f"{path}: not traces written by save_traces (no 'traces' list)")
    out = []
    for index, entry in enumerate(traces):
        problem = _entry_problem(entry)
        if problem is not None:
            raise ValueError(f"{path}: not traces written by save_traces (trace {index}: {problem})")
        out.append(LayerMemoryTrace.from_dict(entry))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _entry_problem(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not an object"
    if not isinstance(entry.get("module_name"), str):
        return "'module_name' is not a string"
    if not isinstance(entry.get("is_forward"), bool):
        return "'is_forward' is not true or false"
    for key in _INT_FIELDS:
        if not _is_int(entry.get(key)):
            return f"{key!r} is not an integer"
    event = entry.get("event")
    keys = ("memory_diff", "memory_activations") if entry["is_forward"] else ("memory_activations",)
    if not isinstance(event, dict) or not all(_is_int(event.get(k)) for k in keys):
        return f"'event' is not an object with integer {' and '.join(repr(k) for k in keys)}"
    return None
