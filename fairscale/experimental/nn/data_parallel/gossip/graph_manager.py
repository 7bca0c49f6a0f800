# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gossip topologies: who sends to whom at each step of stochastic gradient push.

Ranks here are *logical* ranks (one per node). Every process builds the phone book of every rank, because each
edge is a two-process group and ``dist.new_group`` must be called by all processes in the same order.
"""

import math
import numbers
from abc import ABC, abstractmethod
from typing import Any, List, Optional, Tuple, cast

import torch
import torch.distributed as dist

from fairscale.internal.collectives import all_reduce, checked_by_torch
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

from .utils.helpers import _comm_device

__all__ = [
    "Edge",
    "GraphManager",
    "DynamicDirectedExponentialGraph",
    "NPeerDynamicDirectedExponentialGraph",
    "DynamicBipartiteExponentialGraph",
    "DynamicDirectedLinearGraph",
    "DynamicBipartiteLinearGraph",
    "RingGraph",
]


class Edge:
    """A directed edge ``src -> dest`` (process ranks) with its two-process group, warmed up by its node masters.

    ``checked`` says whether torch wrapped the group in its collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
    """

    def __init__(self, local_master_rank: int, dest: int, src: int, local_rank: int) -> None:
        self.src = src
        self.dest = dest
        self.process_group: Any = cast(Any, dist.new_group([src, dest]))  # newer stubs add a non-member sentinel
        # Whether torch wrapped the group in its collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, decided at
        # creation): PushSum then needs another order of its sends and receives.
        self.checked = checked_by_torch(self.process_group)
        if local_master_rank in (src, dest) and local_rank == 0:
            device = _comm_device()
            for dtype in (torch.float32, torch.float16):
                all_reduce(torch.ones(1, dtype=dtype, device=device), group=self.process_group)

    def __repr__(self) -> str:
        return f"Edge({self.src} -> {self.dest})"


def _check_integers(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise FairscaleTypeError(
                f"{owner}: {name} must be an integer, got {value!r} ({type(value).__name__}); pass a whole number"
            )


class GraphManager(ABC):
    """Base class of the topologies.

    Args:
        rank (int): this process's logical rank.
        world_size (int): number of logical ranks.
        nprocs_per_node (int): processes per node (edges connect node masters).
        local_rank (int): this process's rank inside its node.
        peers_per_itr (int): out-peers per step.
    """

    def __init__(
        self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0, peers_per_itr: int = 1
    ) -> None:
        # Integers only: a float passed the range checks below (through int()) and failed later in range(), a
        # string raised a bare ValueError from int().
        _check_integers(
            type(self).__name__,
            rank=rank,
            world_size=world_size,
            nprocs_per_node=nprocs_per_node,
            local_rank=local_rank,
            peers_per_itr=peers_per_itr,
        )
        if nprocs_per_node < 1:
            raise FairscaleValueError(
                f"{type(self).__name__}: nprocs_per_node must be at least 1, got {nprocs_per_node}; pass the number "
                "of processes per node"
            )
        if int(peers_per_itr) < 1:
            raise FairscaleValueError(
                f"{type(self).__name__}: peers_per_itr must be at least 1, got {peers_per_itr}; pass the number of "
                "out-peers per step (1 or more)"
            )
        if int(world_size) < 2:
            # Upstream failed in the graph's construction ("math domain error", an IndexError).
            raise FairscaleValueError(
                f"{type(self).__name__}: a gossip graph needs at least 2 nodes, got world_size {world_size}; pass "
                "the number of nodes (logical ranks)"
            )
        if not 0 <= int(rank) < int(world_size):
            # Upstream failed later with a bare IndexError (or, for a negative rank, used another rank's peers).
            raise FairscaleValueError(
                f"{type(self).__name__}: rank must be in [0, {int(world_size) - 1}] for world_size {world_size}, got "
                f"{rank}; pass this process's logical rank (its node's index)"
            )
        self.rank = rank
        self.world_size = world_size
        self.phone_book: List[List[Edge]] = [[] for _ in range(self.world_size)]
        self.nprocs_per_node = nprocs_per_node
        self.local_rank = local_rank
        # Planned first, as logical ranks, and checked before any edge exists: every process must create the edges'
        # groups in the same order, so a rejected graph must not have created some of them already.
        plan = self._plan(peers_per_itr)
        if not self._plan_is_valid(plan, peers_per_itr):
            raise FairscaleValueError(self._bad_peers_per_itr_message(peers_per_itr))
        self._peers_per_itr = peers_per_itr
        self._group_indices = list(range(peers_per_itr))
        for r, peers in enumerate(plan):
            for peer in peers:
                self.phone_book[r].append(
                    Edge(
                        local_master_rank=(self.rank * self.nprocs_per_node),
                        dest=(peer * self.nprocs_per_node),
                        src=(r * self.nprocs_per_node),
                        local_rank=self.local_rank,
                    )
                )

    def _plan(self, peers_per_itr: int) -> List[List[int]]:
        """Each rank's out-peers (logical ranks, in phone-book order) for ``peers_per_itr``, without making edges."""
        self._peers_per_itr = peers_per_itr  # read by the graphs whose shape depends on it
        self._planned: List[List[int]] = [[] for _ in range(self.world_size)]
        self._make_graph()
        return self._planned

    def _plan_is_valid(self, plan: List[List[int]], peers_per_itr: int) -> bool:
        """Whether every rank has ``peers_per_itr`` phone-book entries and no edge to itself.

        A step reads slots ``0 .. peers_per_itr - 1`` of every rank's phone book (an IndexError past its end), and an
        edge to oneself is a two-process group of one process (torch rejects its duplicate entries).
        """
        return all(len(peers) >= peers_per_itr and r not in peers for r, peers in enumerate(plan))

    def _bad_peers_per_itr_message(self, peers_per_itr: int) -> str:
        # The error path only: the allowed values are found by planning each candidate. Past world_size - 1, only a
        # phone book that does not grow with peers_per_itr can still have enough entries (one that grows with it,
        # NPeerDynamicDirectedExponentialGraph's, then has an edge to oneself).
        most = max(int(self.world_size) - 1, max(len(peers) for peers in self._plan(1)))
        allowed = [p for p in range(1, most + 1) if self._plan_is_valid(self._plan(p), p)]
        name = type(self).__name__
        if not allowed:
            return (
                f"{name}: this topology has no valid peers for world_size {self.world_size} (some rank would have "
                f"no peer or an edge to itself), got peers_per_itr {peers_per_itr}; use another world size or graph"
            )
        if allowed == list(range(1, allowed[-1] + 1)):
            allowed_text = f"between 1 and {allowed[-1]}"
        else:
            allowed_text = f"one of {allowed}"
        return (
            f"{name}: peers_per_itr must be {allowed_text} for world_size {self.world_size}, got {peers_per_itr}; "
            "pass fewer out-peers per step"
        )

    @property
    def peers_per_itr(self) -> int:
        return self._peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, v: int) -> None:
        _check_integers(type(self).__name__, peers_per_itr=v)
        most = min(len(book) for book in self.phone_book)
        if not 1 <= int(v) <= most:
            # A step reads slots 0 .. v - 1 of every rank's phone book: past its end, a bare IndexError later.
            raise FairscaleValueError(
                f"{type(self).__name__}: peers_per_itr must be between 1 and {most} (the phone book's length), got {v}"
            )
        self._peers_per_itr = v
        self._group_indices = list(range(v))

    @abstractmethod
    def _make_graph(self) -> None:
        """Plan every rank's out-peers with :meth:`_add_peers`."""

    def _add_peers(self, rank: int, peers: List[int]) -> None:
        # Only planned here (the edges are made once the plan passed its checks). Upstream compared the int with
        # Edge objects, so repeated peers are kept; they decide the schedule.
        self._planned[rank].extend(peers)

    @abstractmethod
    def is_regular_graph(self) -> bool:
        """Whether every rank has the same number of in- and out-peers."""

    @abstractmethod
    def is_bipartite_graph(self) -> bool:
        """Whether ranks split into active and passive sets."""

    @abstractmethod
    def is_passive(self, rank: Optional[int] = None) -> bool:
        """Whether ``rank`` (default: this rank) is passive in a bipartite graph."""

    @abstractmethod
    def is_dynamic_graph(self) -> bool:
        """Whether the peers change from step to step."""

    def get_peers(self, rotate: bool = False) -> Tuple[List[int], List[int]]:
        """``(out_peers, in_peers)``: out-peers as process ranks, in-peers as logical ranks (upstream's mix)."""
        if rotate:
            self._rotate_group_indices()
        out_peers = [self.phone_book[self.rank][gi].dest for gi in self._group_indices]
        in_peers = []
        for gi in self._group_indices:
            for r in range(self.world_size):
                if self.phone_book[r][gi].dest == self.rank * self.nprocs_per_node:
                    in_peers.append(r)
        return out_peers, in_peers

    def get_edges(self, rotate: bool = False) -> Tuple[List[Edge], List[Edge]]:
        """``(out_edges, in_edges)`` of the current step."""
        if rotate:
            self._rotate_group_indices()
        out_edges = [self.phone_book[self.rank][gi] for gi in self._group_indices]
        in_edges = []
        for gi in self._group_indices:
            for r in range(self.world_size):
                edge = self.phone_book[r][gi]
                if edge.dest == self.rank * self.nprocs_per_node:
                    in_edges.append(edge)
        return out_edges, in_edges

    def get_edges_in_agreed_order(self) -> List[Tuple[Edge, bool]]:
        """This rank's edges of the current step (no rotation) as ``(edge, is_out_edge)``, in an order all ranks share.

        The order is by out-peer slot, then by the edge's source rank: within the out-edges and within the in-edges
        it is the order of :meth:`get_edges`. An exchange that waits for the peer at every edge, taken in this order
        by every rank, cannot deadlock: the smallest edge not yet done always has both of its ranks waiting at it.
        """
        me = self.rank * self.nprocs_per_node
        ordered: List[Tuple[Edge, bool]] = []
        for gi in self._group_indices:
            for r in range(self.world_size):
                edge = self.phone_book[r][gi]
                if r == self.rank:
                    ordered.append((edge, True))
                elif edge.dest == me:
                    ordered.append((edge, False))
        return ordered

    def _rotate_group_indices(self) -> None:
        book_len = len(self.phone_book[self.rank])
        self._group_indices = [int((gi + self._peers_per_itr) % book_len) for gi in self._group_indices]

    def _rotate_forward(self, r: int, p: int) -> int:
        return (r + p) % self.world_size

    def _rotate_backward(self, r: int, p: int) -> int:
        return (r - p) % self.world_size


class _Directed(GraphManager):
    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return False

    def is_passive(self, rank: Optional[int] = None) -> bool:
        return False

    def is_dynamic_graph(self) -> bool:
        return True


class _Bipartite(GraphManager):
    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return True

    def is_passive(self, rank: Optional[int] = None) -> bool:
        rank = self.rank if rank is None else rank
        return rank % 2 == 0

    def is_dynamic_graph(self) -> bool:
        return True

    def _add_if_bipartite(self, rank: int, f_peer: int, b_peer: int) -> None:
        if not self.is_passive(rank) and (self.is_passive(f_peer) and self.is_passive(b_peer)):
            self._add_peers(rank, [f_peer, b_peer])
        elif self.is_passive(rank) and not (self.is_passive(f_peer) or self.is_passive(b_peer)):
            self._add_peers(rank, [f_peer, b_peer])


class DynamicDirectedExponentialGraph(_Directed):
    """Peers at distance ``±2^i``, one per step in turn."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(0, int(math.log(self.world_size - 1, 2)) + 1):
                f_peer = self._rotate_forward(rank, 2**i)
                b_peer = self._rotate_backward(rank, 2**i)
                self._add_peers(rank, [f_peer, b_peer])


class NPeerDynamicDirectedExponentialGraph(_Directed):
    """Out-peers at distance ``j * (peers_per_itr + 1)^i`` (SlowMo's default topology)."""

    def _make_graph(self) -> None:
        base = self._peers_per_itr + 1
        for rank in range(self.world_size):
            for i in range(0, int(math.log(self.world_size - 1, base)) + 1):
                for j in range(1, self._peers_per_itr + 1):
                    self._add_peers(rank, [self._rotate_forward(rank, j * base**i)])


class DynamicBipartiteExponentialGraph(_Bipartite):
    """Exponential distances ``±1, ±(1 + 2^i)`` between the even (passive) and odd (active) ranks."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(0, int(math.log(self.world_size - 1, 2)) + 1):
                distance = 1 if i == 0 else 1 + 2**i
                self._add_if_bipartite(
                    rank, self._rotate_forward(rank, distance), self._rotate_backward(rank, distance)
                )


class DynamicDirectedLinearGraph(_Directed):
    """Peers at every odd distance ``±i``."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size):
                if i % 2 == 0:
                    continue
                self._add_peers(rank, [self._rotate_forward(rank, i), self._rotate_backward(rank, i)])


class DynamicBipartiteLinearGraph(_Bipartite):
    """Peers at every distance ``±i`` between the passive and active ranks."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size):
                self._add_if_bipartite(rank, self._rotate_forward(rank, i), self._rotate_backward(rank, i))


class RingGraph(_Directed):
    """The two ring neighbours (static)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            self._add_peers(rank, [self._rotate_forward(rank, 1), self._rotate_backward(rank, 1)])

    def is_dynamic_graph(self) -> bool:
        return False
