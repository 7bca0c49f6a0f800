# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The opt-in collective counter: which collectives ran, how large, in which phase.

Counting is off unless a :func:`count_collectives` context is open; then the collectives layer
(:mod:`fairscale.internal.collectives`, which re-exports these names) records every logical call
once through :func:`record_collective`, however many torch calls a fallback needed.
:func:`collective_phase` tags the calls made inside it (``"forward"``, ``"backward"`` ...).
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["CollectiveRecord", "CollectiveCounter", "count_collectives", "collective_phase", "record_collective"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One logical collective call, as seen by :func:`count_collectives`.

    Attributes:
        kind (str): ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"broadcast"``,
            ``"all_gather_object"``, ``"broadcast_object"`` or ``"barrier"``.
        group_size (int): number of ranks in the process group.
        ranks (Tuple[int, ...]): global ranks of the group, sorted.
        dtype (Optional[torch.dtype]): the caller's dtype (even if a fallback used another on
            the wire); ``None`` for object collectives and barriers.
        numel (int): elements of the full buffer: all-gather output, reduce-scatter input,
            all-reduce or broadcast tensor; 0 for object collectives and barriers.
        bytes (int): ``numel * element_size``.
        shard_bytes (int): the per-rank piece, ``bytes // group_size`` for all-gather and
            reduce-scatter, ``bytes`` otherwise.
        phase (Optional[str]): the :func:`collective_phase` active at call time.
    """

    kind: str
    group_size: int
    ranks: Tuple[int, ...]
    dtype: Optional[torch.dtype]
    numel: int
    bytes: int
    shard_bytes: int
    phase: Optional[str]


_UNTAGGED = "none"
_new_record = object.__new__


class CollectiveCounter:
    """Records of the collectives called while it is active (see :func:`count_collectives`).

    Filters of :meth:`count` and :meth:`total_bytes` are ANDed; ``None`` matches anything, and
    ``phase="none"`` matches calls made outside any :func:`collective_phase`.
    """

    def __init__(self) -> None:
        self.records: List[CollectiveRecord] = []

    def _select(self, kind: Optional[str], phase: Optional[str], group_size: Optional[int]) -> List[CollectiveRecord]:
        return [
            r
            for r in list(self.records)
            if (kind is None or r.kind == kind)
            and (phase is None or (r.phase or _UNTAGGED) == phase)
            and (group_size is None or r.group_size == group_size)
        ]

    def count(self, kind: Optional[str] = None, phase: Optional[str] = None, group_size: Optional[int] = None) -> int:
        """Number of recorded calls matching the filters."""
        return len(self._select(kind, phase, group_size))

    def total_bytes(
        self, kind: Optional[str] = None, phase: Optional[str] = None, group_size: Optional[int] = None
    ) -> int:
        """Sum of ``bytes`` (full buffer sizes) of the recorded calls matching the filters."""
        return sum(r.bytes for r in self._select(kind, phase, group_size))

    def summary(self) -> Dict[str, Dict[str, int]]:
        """JSON-able totals per ``"<kind>/<phase or none>/gs=<group size>"``: ``{"count", "bytes"}``."""
        out: Dict[str, Dict[str, int]] = {}
        for r in list(self.records):
            entry = out.setdefault(f"{r.kind}/{r.phase or _UNTAGGED}/gs={r.group_size}", {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += r.bytes
        return out

    def clear(self) -> None:
        """Forget all records (the counter stays active)."""
        self.records.clear()

    def __repr__(self) -> str:
        return f"CollectiveCounter({self.summary()})"


# The active counters are process-wide rather than thread-local: on CUDA the autograd engine runs backward hooks
# (and so the gradient reduce-scatters) on its own device threads, which must still be counted. The phase tag is
# per thread (each caller tags the collectives it issues itself).
_counter_lock = threading.Lock()
_active_counters: List[CollectiveCounter] = []


class _PhaseState(threading.local):
    """The phase tag of the calling thread: CUDA autograd runs backward work on per-device threads, concurrently with
    the thread that called backward(), so a process-wide tag could be read by the wrong collective."""

    phase: Optional[str] = None


_phase_state = _PhaseState()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count every collective call made through this module while the context is open.

    Counting is off unless a counter is active. Counters nest: each active counter records
    every call.

    Example::

        with count_collectives() as counter:
            model(batch).sum().backward()
        assert counter.count("reduce_scatter", phase="backward") == 3
    """
    counter = CollectiveCounter()
    with _counter_lock:
        _active_counters.append(counter)
    try:
        yield counter
    finally:
        with _counter_lock:
            for i, active in enumerate(_active_counters):
                if active is counter:
                    del _active_counters[i]
                    break


class collective_phase:  # noqa: N801 (used like the function it replaced: ``with collective_phase("forward"):``)
    """Tag the collectives called inside with ``phase`` (e.g. ``"forward"``); innermost wins.

    A class rather than a generator-based context manager: FSDP enters one around every gather and reduction, and
    this costs a third of the generator's Python calls.
    """

    __slots__ = ("_phase", "_previous")

    def __init__(self, phase: Optional[str]) -> None:
        self._phase = phase
        self._previous: Optional[str] = None

    def __enter__(self) -> None:
        state = _phase_state
        self._previous = state.phase
        state.phase = self._phase

    def __exit__(self, *exc: object) -> None:
        _phase_state.phase = self._previous


def record_collective(
    kind: str, group_size: int, ranks: Tuple[int, ...], dtype: Optional[torch.dtype], numel: int, element_size: int
) -> None:
    """Record one logical collective call with every active counter (a no-op when none is active).

    Args:
        kind: the :attr:`CollectiveRecord.kind`.
        group_size: number of ranks in the group.
        ranks: global ranks of the group, sorted.
        dtype: the caller's dtype; ``None`` for object collectives and barriers.
        numel: elements of the full buffer (see :class:`CollectiveRecord`).
        element_size: bytes per element.
    """
    if not _active_counters:  # the common case: counting is off
        return
    nbytes = numel * element_size
    shard = nbytes // group_size if kind in ("all_gather", "reduce_scatter") else nbytes
    # The frozen dataclass's own __init__ sets each field through object.__setattr__ (a third of a collective's
    # cost with a counter open); filling the instance dict gives the same record (fields, equality, hash, repr).
    record = _new_record(CollectiveRecord)
    record.__dict__.update(
        kind=kind,
        group_size=group_size,
        ranks=ranks,
        dtype=dtype,
        numel=numel,
        bytes=nbytes,
        shard_bytes=shard,
        phase=_phase_state.phase,
    )
    with _counter_lock:
        for counter in _active_counters:
            counter.records.append(record)
