# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The simulated link of ``--link-gbps`` / ``--link-latency-us``, the same for every peer.

fairscale's collectives go through :mod:`fairscale.internal.collectives`, whose opt-in simulated link
(:mod:`fairscale.internal.simulated_link`) delays them. PyTorch FSDP2/FSDP1 and DDP call c10d themselves, so
:class:`LinkDelayMode` (a dispatch mode that sees every ``c10d.*`` op, like the probe run's collective spy) delays
theirs with the same model: a collective issued at ``t`` on a group whose link is free at ``b`` completes at
``max(t, b) + latency + bytes / bandwidth`` (bytes as the collective counter counts them). The op itself runs at
once; the :class:`~torch.distributed.Work` handed back is replaced by one built from a future that a sleeping helper
thread completes after both the real collective and the deadline (no CPU is burnt, so compute overlaps the wait as
it would on a real link).

The mode runs during the timed steps of every peer when a link is set, fairscale's included (where it only passes
ops through), so the Python dispatch overhead it adds to every op is the same for all. Without a link nothing here
is active.
"""

import contextlib
import dataclasses
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fairscale.internal import simulated_link
from fairscale.internal.simulated_link import LinkModel

from .probes import _kind, _process_group, _tensor_bytes, group_ranks


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Ranks laid out on nodes, and the bandwidth of a group inside one node and of one that spans nodes.

    Node of a global rank: ``rank // ranks_per_node``. A group is intra-node iff all its ranks are on one node: the
    group's ranks decide, not its size (the shard and the replicate group of 2 nodes x 2 ranks both have 2 ranks).

    Attributes:
        ranks_per_node: ranks of one node.
        intra_gbps: GB/s of a group inside one node.
        inter_gbps: GB/s of a group that spans nodes.
    """

    ranks_per_node: int
    intra_gbps: float
    inter_gbps: float

    def is_intra(self, ranks: Sequence[int]) -> bool:
        """Whether every one of ``ranks`` (global ranks) is on the same node."""
        return len({r // self.ranks_per_node for r in ranks}) <= 1

    def gbps(self, ranks: Sequence[int]) -> float:
        """The bandwidth of a group of these global ranks."""
        return self.intra_gbps if self.is_intra(ranks) else self.inter_gbps


_Work = torch._C._distributed_c10d.Work


def _delayed_work(real: Any, deadline: float, tensors: Any) -> Any:
    """A Work that completes when ``real`` has and ``deadline`` (``time.monotonic()``) has passed.

    Its future's value is the real work's (DDP's reducer reads the all-reduced tensors from it), or ``tensors`` (the
    op's outputs) for gloo works that have no future.
    """
    fut: torch.futures.Future[Any] = torch.futures.Future()
    try:
        real_fut = real.get_future()
    except RuntimeError:  # "Work::getFuture not implemented" (some gloo collectives)
        real_fut = None

    def finish() -> None:
        try:
            if real_fut is None:
                real.wait()
            else:
                real_fut.wait()
            simulated_link.sleep_until(deadline)
            fut.set_result(tensors if real_fut is None else real_fut.value())
        except Exception as exc:  # hand the failure to whoever waits
            fut.set_exception(exc)

    threading.Thread(target=finish, daemon=True, name="bench-link").start()
    # A private c10d binding that torch's stubs do not declare (newer torch's do: hence unused-ignore).
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined, unused-ignore]


class LinkDelayMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """Delays the completion of every c10d collective dispatched while active (see the module docstring).

    Args:
        bandwidth_gbps: GB/s of the link of every group (``None``: pass every op through untouched).
        latency_us: per-collective latency in microseconds.
        group_gbps: ``{group size: GB/s}`` overrides (the zero2 group inside a node, faster than the full group).
        layout: when given, each group's bandwidth comes from its global ranks (intra- or inter-node) instead of
            ``bandwidth_gbps`` and ``group_gbps``, and each group has a link of its own.
    """

    def __init__(
        self,
        bandwidth_gbps: Optional[float],
        latency_us: float = 0.0,
        group_gbps: Optional[Dict[int, float]] = None,
        layout: Optional[NodeLayout] = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.bandwidth_gbps, self.latency_us = bandwidth_gbps, latency_us
        self.group_gbps = dict(group_gbps or {})
        self.layout = layout
        self.links: Dict[Any, LinkModel] = {}
        self.delayed = 0

    def _link(self, args: Tuple[Any, ...]) -> Optional[LinkModel]:
        """The link of the op's group, made on first use; ``None`` when the op is not delayed."""
        group = _process_group(args)
        if self.bandwidth_gbps is None or group is None or group.size() == 1:
            return None
        if self.layout is not None:
            # Keyed by the group's ranks: two groups of one size (shard and replicate) are two links.
            ranks = group_ranks(group)
            link = self.links.get(ranks)
            if link is None:
                link = self.links[ranks] = LinkModel(self.layout.gbps(ranks), self.latency_us)
            return link
        size = int(group.size())
        link = self.links.get(size)
        if link is None:
            link = self.links[size] = LinkModel(self.group_gbps.get(size, self.bandwidth_gbps), self.latency_us)
        return link

    def _deadline(self, args: Tuple[Any, ...], nbytes: int) -> Optional[float]:
        link = self._link(args)
        if link is None:
            return None
        start = max(time.monotonic(), link.busy_until)
        link.busy_until = start + link.transfer_time(nbytes)
        return link.busy_until

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not str(func).startswith("c10d.") or self.bandwidth_gbps is None:
            return out
        kind = _kind(str(func))
        payload = args[1] if kind == "reduce_scatter" and len(args) > 1 else (args[0] if args else None)
        deadline = self._deadline(args, _tensor_bytes(payload))
        if deadline is None:
            return out
        self.delayed += 1
        tensors = [o for o in (out if isinstance(out, tuple) else (out,)) if not isinstance(o, torch.ScriptObject)]
        return _replace_work(out, deadline, tensors)


def _replace_work(out: Any, deadline: float, tensors: Any) -> Any:
    if isinstance(out, torch.ScriptObject):
        return _delayed_work(_Work.unbox(out), deadline, tensors).boxed()
    if isinstance(out, _Work):
        return _delayed_work(out, deadline, tensors)
    if isinstance(out, tuple):
        return tuple(_replace_work(o, deadline, tensors) for o in out)
    return out


@contextlib.contextmanager
def link_for_peer(
    peer: str,
    bandwidth_gbps: Optional[float],
    latency_us: float,
    group_gbps: Optional[Dict[int, float]] = None,
    layout: Optional[NodeLayout] = None,
) -> Iterator[None]:
    """The simulated link around one peer's timed step: fairscale's own for ``"fairscale"``, the mode for the rest.

    ``group_gbps`` maps a group size to its own bandwidth (the zero2 group; for fairscale the group registered with
    :func:`register_group`, for the others any c10d group of that size). With ``layout`` (the hybrid scenario) the
    bandwidth of every group follows from its ranks instead (for fairscale: the groups registered with
    :func:`register_layout_group`, any other group being taken as inter-node); ``bandwidth_gbps`` then only says
    whether to delay at all (``None``: the mode passes every op through, as the floor run's).
    """
    if bandwidth_gbps is None:
        if layout is None:
            yield
            return
        # The floor of a layout run: no delay, but the same dispatch mode as the delayed runs (its per-op overhead).
        with LinkDelayMode(None):
            yield
        return
    mode = LinkDelayMode(None if peer == "fairscale" else bandwidth_gbps, latency_us, group_gbps, layout)
    if peer == "fairscale":
        if layout is None:
            set_fairscale_link(bandwidth_gbps, latency_us, group_gbps)
        else:
            set_fairscale_layout_link(layout, latency_us)
    try:
        with mode:
            yield
    finally:
        if peer == "fairscale":
            simulated_link.clear_simulated_link()


_FAIRSCALE_GROUPS: Dict[int, Any] = {}


def register_group(size: int, group: Any) -> None:
    """Remember this rank's zero2 group of ``size`` ranks so that a per-group-size bandwidth can apply to it."""
    _FAIRSCALE_GROUPS[size] = group


def set_fairscale_link(bandwidth_gbps: float, latency_us: float, group_gbps: Optional[Dict[int, float]]) -> None:
    """Set fairscale's simulated link for every group, and the faster link of registered smaller groups."""
    simulated_link.set_simulated_link(bandwidth_gbps, latency_us)
    for size, gbps in (group_gbps or {}).items():
        if size in _FAIRSCALE_GROUPS:
            simulated_link.set_simulated_link(gbps, latency_us, group=_FAIRSCALE_GROUPS[size])


_LAYOUT_GROUPS: List[Any] = []


def register_layout_group(group: Any) -> None:
    """Remember a group of this rank (a hybrid shard or replicate group) for :func:`set_fairscale_layout_link`."""
    if not any(g is group for g in _LAYOUT_GROUPS):
        _LAYOUT_GROUPS.append(group)


def set_fairscale_layout_link(layout: NodeLayout, latency_us: float) -> None:
    """fairscale's simulated link by node layout: every registered group gets the bandwidth its ranks imply.

    fairscale's link is looked up by group object, so a group must be registered to get its own; any other group
    (the default group of full sharding: it spans the nodes) gets the inter-node link.
    """
    simulated_link.set_simulated_link(layout.inter_gbps, latency_us)
    for group in _LAYOUT_GROUPS:
        simulated_link.set_simulated_link(layout.gbps(group_ranks(group)), latency_us, group=group)
