# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""An opt-in simulated network link for the collectives layer (benchmarks and tests; never on by default).

On one machine the "link" between ranks is memory, so communication is nearly free and overlapping it with compute
shows nothing. With a simulated link set, every collective of :mod:`fairscale.internal.collectives` completes no
earlier than ``latency + bytes / bandwidth`` after it was issued, where ``bytes`` is the size the collective counter
records (all-gather output, reduce-scatter input, the all-reduced or broadcast tensor). Collectives on one group
share its link: one issued while the previous is still "on the wire" starts when that one ends, as on a real link.

The delay costs no CPU: an asynchronous collective's :class:`~fairscale.internal.collectives.WorkHandle` reports
itself incomplete until its completion time and, when waited on, sleeps until then; a synchronous collective sleeps
in the call. A link can be set for every group (``group=None``) and overridden for one group (e.g. a zero2 group
inside a node, faster than the inter-node full group).
"""

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

__all__ = ["LinkModel", "set_simulated_link", "clear_simulated_link", "simulated_link", "link_for"]

_ALL_GROUPS = object()


@dataclass
class LinkModel:
    """One simulated link.

    Attributes:
        bandwidth_gbps (float): bytes per second / 1e9 (GB/s, not Gb/s).
        latency_us (float): fixed cost of every collective, in microseconds.
        busy_until (float): ``time.monotonic()`` when the last collective issued on this link completes.
    """

    bandwidth_gbps: float
    latency_us: float = 0.0
    busy_until: float = 0.0

    def transfer_time(self, nbytes: int) -> float:
        """Seconds one collective of ``nbytes`` occupies the link."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9)


_links: Dict[Any, LinkModel] = {}
_lock = threading.Lock()


def set_simulated_link(bandwidth_gbps: float, latency_us: float = 0.0, group: Any = None) -> None:
    """Delay every later collective on ``group`` (``None``: every group without its own link) as on a slow link.

    Args:
        bandwidth_gbps (float): link bandwidth in GB/s (> 0).
        latency_us (float): per-collective latency in microseconds (>= 0).
        group (Any): the process group object the link applies to; ``None`` for all groups. Pass
            ``torch.distributed.group.WORLD`` for the default group specifically.

    Raises:
        ValueError: a non-positive bandwidth or a negative latency.
    """
    if not bandwidth_gbps > 0:
        raise ValueError(f"set_simulated_link: bandwidth_gbps must be > 0, got {bandwidth_gbps}")
    if latency_us < 0:
        raise ValueError(f"set_simulated_link: latency_us must be >= 0, got {latency_us}")
    with _lock:
        _links[_ALL_GROUPS if group is None else group] = LinkModel(float(bandwidth_gbps), float(latency_us))


def clear_simulated_link(group: Any = None) -> None:
    """Remove the link of ``group`` (``None``: remove every simulated link, back to the default: no delay)."""
    with _lock:
        if group is None:
            _links.clear()
        else:
            _links.pop(group, None)


@contextlib.contextmanager
def simulated_link(bandwidth_gbps: float, latency_us: float = 0.0, group: Any = None) -> Iterator[None]:
    """:func:`set_simulated_link` for the duration of a ``with`` block (the link is removed at the end)."""
    set_simulated_link(bandwidth_gbps, latency_us, group)
    try:
        yield
    finally:
        clear_simulated_link(group if group is not None else None)


def link_for(group: Any) -> Optional[LinkModel]:
    """The link that applies to ``group`` (its own, else the all-groups one), or ``None`` (no simulation)."""
    if not _links:
        return None
    return _links.get(group) or _links.get(_ALL_GROUPS)


def ready_time(group: Any, group_size: int, nbytes: int) -> Optional[float]:
    """Reserve the link for a collective issued now; its ``time.monotonic()`` completion time, or ``None``.

    Called by the collectives layer at issue time. A 1-rank group communicates nothing and is never delayed.
    """
    if not _links or group_size <= 1:
        return None
    with _lock:
        link = link_for(group)
        if link is None:
            return None
        start = max(time.monotonic(), link.busy_until)
        link.busy_until = start + link.transfer_time(nbytes)
        return link.busy_until


def sleep_until(deadline: Optional[float]) -> None:
    """Sleep (no CPU) until ``deadline`` (``time.monotonic()``); at once when it is ``None`` or past."""
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
