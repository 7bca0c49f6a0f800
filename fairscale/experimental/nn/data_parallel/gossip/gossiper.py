# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gossipers: one round of message exchange along the current edges of a gossip graph.

:class:`PushSum` sends asynchronously to its out-peers and receives from its in-peers (directed graphs);
:class:`PushPull` exchanges blocking, active nodes sending first (bipartite graphs). Each edge is a two-process
group and a message is a ``broadcast`` from the edge's source on that group.
"""

import logging
from enum import Enum
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal.collectives import broadcast
from fairscale.internal.device import DeviceHandle
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

from .graph_manager import Edge, GraphManager
from .mixing_manager import MixingManager, UniformMixing

__all__ = ["Gossiper", "PushSum", "PushPull", "dist_backend"]


class dist_backend(str, Enum):
    UNDEFINED = "undefined"
    TCP = "tcp"
    MPI = "mpi"
    GLOO = "gloo"
    NCCL = "nccl"


class Gossiper:
    """Base class of the gossipers.

    Args:
        msg (Tensor): a message shaped like the ones to exchange (flat parameters); sets dtype and size.
        graph (GraphManager): the topology.
        device (Optional[torch.device]): where messages live (default: ``msg.device``).
        mixing (Optional[MixingManager]): the mixing weights (default: :class:`UniformMixing`).
        logger (Optional[logging.Logger]): debug logger.
        rank, world_size (Optional[int]): this process's rank and the logical world size.
    """

    def __init__(
        self,
        msg: Tensor,
        graph: GraphManager,
        device: Optional[torch.device] = None,
        mixing: Optional[MixingManager] = None,
        logger: Optional[logging.Logger] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        name = type(self).__name__
        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise FairscaleRuntimeError(
                    f"{name}: rank and world_size were not both given and torch.distributed is not initialised; "
                    "pass rank= and world_size=, or call torch.distributed.init_process_group first"
                )
            # Upstream's check, kept: the default backends are expected to pass rank and world size explicitly.
            backend = str(dist.get_backend())
            if backend in (dist_backend.GLOO.value, dist_backend.NCCL.value):
                raise FairscaleRuntimeError(
                    f"{name}: rank and world_size are not taken from the default process group with the "
                    f"{backend!r} backend; pass rank= (this process's rank) and world_size= (the logical world size)"
                )
            rank = dist.get_rank()
            world_size = dist.get_world_size()
        self.rank = rank
        self.world_size = world_size
        if not isinstance(graph, GraphManager):
            raise FairscaleTypeError(
                f"{name}: graph must be a GraphManager, got {type(graph).__name__}; pass a topology such as "
                "NPeerDynamicDirectedExponentialGraph"
            )
        self._graph_manager = graph
        # Under PyTorch's collective checker (TORCH_DISTRIBUTED_DEBUG=DETAIL) every collective, an async one too,
        # first waits on a barrier of its group's other member, so the ranks' exchanges must follow one order.
        self._checked = any(edge.checked for book in graph.phone_book for edge in book)
        self._edges_in_agreed_order: Optional[List[Tuple[Edge, bool]]] = None
        self.peers_per_itr_device = torch.tensor([self._graph_manager.peers_per_itr], device=device, dtype=msg.dtype)
        self.passive = self._graph_manager.is_passive()
        self.refresh_peers_(rotate=False)
        if mixing is None:
            mixing = UniformMixing(self._graph_manager, device)
        if not isinstance(mixing, MixingManager):
            raise FairscaleTypeError(
                f"{name}: mixing must be a MixingManager, got {type(mixing).__name__}; pass e.g. "
                "UniformMixing(graph, device), or None for that default"
            )
        self._mixing_manager = mixing
        self.refresh_mixing_weights_()
        self.regular = self._mixing_manager.is_regular()
        self.device = device if device is not None else msg.device
        self.out_msg_buffer: List[Tuple[Any, Tensor]] = []
        self.in_msg_buffer = msg.clone()
        if not self.regular:
            self.in_msg_buffer = torch.cat([self.in_msg_buffer, torch.ones_like(self.in_msg_buffer[:1])])
        if self.device.type == "cpu":
            try:
                self.in_msg_buffer = DeviceHandle.for_device("cpu").pin_memory(self.in_msg_buffer)
            except Exception as e:
                if logger is None:
                    raise
                logger.error(e)
        self.placeholder = self.in_msg_buffer.clone()
        self._ps_weight = torch.ones(1, dtype=msg.dtype, device=self.device)
        self.logger = logger

    @property
    def ps_weight(self) -> Tensor:
        return self._ps_weight

    @ps_weight.setter
    def ps_weight(self, v: Any) -> None:
        self._ps_weight.data[0] = v

    @property
    def peers_per_itr(self) -> int:
        return self._graph_manager.peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, v: int) -> None:
        self._graph_manager.peers_per_itr = v

    def refresh_peers_(self, rotate: Optional[bool] = None) -> None:
        """Move to the next step's edges (``rotate`` defaults to whether the graph is dynamic)."""
        if rotate is None:
            rotate = self._graph_manager.is_dynamic_graph()
        if rotate and not self._graph_manager.is_dynamic_graph():
            raise FairscaleValueError(
                f"{type(self).__name__}.refresh_peers_: cannot rotate the static graph "
                f"{type(self._graph_manager).__name__}; pass rotate=False (or None), or use a dynamic graph"
            )
        self.out_edges, self.in_edges = self._graph_manager.get_edges(rotate)
        if self._checked:
            # Taken now, with the edges: the graph is shared by the gossipers of all dtypes, and moves on with each.
            self._edges_in_agreed_order = self._graph_manager.get_edges_in_agreed_order()

    def refresh_mixing_weights_(self, residual_adjusted: bool = False) -> None:
        self.mixing_weights = self._mixing_manager.get_mixing_weights(residual_adjusted)

    def mix_out_msg_(self, out_msg: Tensor, ps_weight: Tensor) -> Iterator[Tensor]:
        """Yield the message for each out edge (uniform mixing scales ``out_msg`` in place and yields it)."""
        self.refresh_mixing_weights_(residual_adjusted=True)
        self.ps_weight = ps_weight
        if not self.regular:
            out_msg = torch.cat([out_msg, self.ps_weight.type(out_msg.dtype)])
        if self._mixing_manager.is_uniform():
            weight = self.mixing_weights["uniform"]
            out_msg *= weight.type(out_msg.dtype)
            for _ in self.out_edges:
                yield out_msg
        else:
            for out_edge in self.out_edges:
                weight = self.mixing_weights[out_edge.dest]
                yield out_msg.mul(weight.type(out_msg.dtype))

    def clean_msg_buffers_(self) -> None:
        """Wait for the pending sends and release their messages' storage."""
        msgs = []
        while self.out_msg_buffer:
            req, msg = self.out_msg_buffer.pop()
            req.wait()
            msgs.append(msg)
        while msgs:
            msg = msgs.pop()
            with torch.no_grad():
                msg.set_()  # type: ignore[call-overload]  # release the storage (no-argument overload)

    def parse_in_msg_buffer(self) -> Tuple[Tensor, Tensor]:
        """``(message, ps_weight)`` received in this round."""
        if self.regular:
            return self.in_msg_buffer, self.ps_weight * self.peers_per_itr_device
        return self.in_msg_buffer[:-1], self.in_msg_buffer[-1:]

    def mix(self, out_msg: Tensor, ps_weight: Tensor) -> Tuple[Tensor, Tensor]:
        """One gossip round; returns the received ``(message, ps_weight)``."""
        raise NotImplementedError

    def _check_out_msg(self, out_msg: Tensor) -> None:
        # A ValueError, not a RuntimeError: SgpGossip's gossip thread treats RuntimeErrors in a round as
        # communication failures and carries on, while a misplaced message is the caller's bug (as upstream's assert).
        if out_msg.device.type != self.device.type:
            raise FairscaleValueError(
                f"{type(self).__name__}.mix: the message is on {out_msg.device.type} but the gossiper's device is "
                f"{self.device.type}; move the message there (or build the gossiper with device={out_msg.device.type!r})"
            )

    def _receive(self, in_edges: List[Edge]) -> None:
        if len(in_edges) == 1:
            broadcast(self.in_msg_buffer, src=in_edges[0].src, group=in_edges[0].process_group)
            return
        self.in_msg_buffer.zero_()
        for in_edge in in_edges:
            broadcast(self.placeholder, src=in_edge.src, group=in_edge.process_group)
            self.in_msg_buffer.add_(self.placeholder)


class PushSum(Gossiper):
    """Push-sum gossip: asynchronous sends to the out-peers, blocking receives from the in-peers."""

    def mix(self, out_msg: Tensor, ps_weight: Tensor) -> Tuple[Tensor, Tensor]:
        self._check_out_msg(out_msg)
        if self.logger is not None:
            self.logger.debug("in/out -peers %s/%s", self.in_edges, self.out_edges)
        for out_edge in self.out_edges:
            # Checked before any message moves: in the agreed order a peer may already wait to receive from here.
            if self.rank != out_edge.src:
                # ValueError for the same reason as in _check_out_msg: rank and graph disagree, a caller's bug.
                raise FairscaleValueError(
                    f"PushSum.mix: rank {self.rank} is not the source of its out edge {out_edge}; pass the process "
                    "rank the graph was built for as rank= (the graph's logical rank times nprocs_per_node)"
                )
        mixed_out_msgs = self.mix_out_msg_(out_msg, ps_weight)
        if self._edges_in_agreed_order is None:
            for out_edge in self.out_edges:
                self._send(out_edge, next(mixed_out_msgs))
            self._receive(self.in_edges)
        else:
            self._exchange_in_agreed_order(self._edges_in_agreed_order, mixed_out_msgs)
        self.refresh_peers_()
        self.clean_msg_buffers_()
        return self.parse_in_msg_buffer()

    def _send(self, out_edge: Edge, msg: Tensor) -> None:
        req = broadcast(msg, src=out_edge.src, group=out_edge.process_group, async_op=True)
        self.out_msg_buffer.append((req, msg))

    def _exchange_in_agreed_order(self, edges: List[Tuple[Edge, bool]], mixed_out_msgs: Iterator[Tensor]) -> None:
        """The sends and receives of one round in the order all ranks share (under the collective checker).

        All sends first, then the receives, is faster, but the checker's barrier turns each async send into a wait
        for the peer: with every rank sending first, on a ring, each waits for a peer that waits for the next one.
        In the shared order some rank receives first and each wait ends. The messages, and the order in which the
        in-messages are summed (that of ``in_edges``), are those of the other path, so the results are identical.
        """
        single = len(self.in_edges) == 1
        if not single:
            self.in_msg_buffer.zero_()
        for edge, is_out_edge in edges:
            if is_out_edge:
                self._send(edge, next(mixed_out_msgs))
            elif single:
                broadcast(self.in_msg_buffer, src=edge.src, group=edge.process_group)
            else:
                broadcast(self.placeholder, src=edge.src, group=edge.process_group)
                self.in_msg_buffer.add_(self.placeholder)


class PushPull(Gossiper):
    """Push-pull gossip: blocking exchanges; active nodes send then receive, passive nodes the reverse."""

    def mix(self, out_msg: Tensor, ps_weight: Tensor) -> Tuple[Tensor, Tensor]:
        self._check_out_msg(out_msg)
        if self.logger is not None:
            self.logger.debug("in/out -peers %s/%s", self.in_edges, self.out_edges)
        mixed_out_msgs = self.mix_out_msg_(out_msg, ps_weight)
        single = len(self.in_edges) == 1
        if not single:
            self.in_msg_buffer.zero_()
        for out_edge, in_edge in zip(self.out_edges, self.in_edges):
            msg = next(mixed_out_msgs)
            target = self.in_msg_buffer if single else self.placeholder
            if not self.passive:
                broadcast(msg, src=out_edge.src, group=out_edge.process_group)
                broadcast(target, src=in_edge.src, group=in_edge.process_group)
            else:
                broadcast(target, src=in_edge.src, group=in_edge.process_group)
                broadcast(msg, src=out_edge.src, group=out_edge.process_group)
            if not single:
                self.in_msg_buffer.add_(self.placeholder)
        self.refresh_peers_()
        self.clean_msg_buffers_()
        return self.parse_in_msg_buffer()
