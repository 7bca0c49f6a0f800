# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Stochastic gradient push (SGP) for SlowMo: parameters mixed with the in-peers by a background gossip thread.

The main thread hands a copy of the parameters to the gossip thread (:meth:`SgpGossip.transfer_params`), which
runs one :class:`~.gossiper.Gossiper` round per dtype and signals completion; :meth:`SgpGossip.query_gossip_queue`
then adds the received parameters (push-sum numerators) and push-sum weight. With the built-in graphs and uniform
mixing the mixing is "lazy": both are multiplied by the own weight ``lo`` on receipt, so every step replaces a
node's parameters by the plain average of its own and its current in-peers' parameters and the weight stays 1.
"""

import threading
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.internal.device import DeviceHandle

from .gossiper import Gossiper, PushPull, PushSum
from .graph_manager import GraphManager
from .mixing_manager import MixingManager
from .utils.helpers import flatten_tensors, group_by_dtype, make_logger, unflatten_tensors

__all__ = ["SgpGossip"]

HEARTBEAT_TIMEOUT = 300  # seconds; mirrored in distributed.py


class SgpGossip:
    """The SGP state of one SlowMo wrapper and its gossip thread (node masters only run a thread)."""

    def __init__(
        self,
        module: nn.Module,
        graph: GraphManager,
        mixing: MixingManager,
        push_sum: bool,
        synch_freq: int,
        use_streams: bool,
        comm_device: torch.device,
        process_rank: int,
        logical_rank: int,
        logical_world_size: int,
        is_node_master: bool,
        verbose: bool,
        logger: Any,
    ) -> None:
        self.module = module
        self.graph = graph
        self.mixing = mixing
        self.push_sum = push_sum
        self.asynch = synch_freq > 0
        self.comm_device = comm_device
        self.process_rank = process_rank
        self.logical_rank = logical_rank
        self.logical_world_size = logical_world_size
        self.is_node_master = is_node_master
        self.verbose = verbose
        self.logger = logger
        first = next(module.parameters())
        self.ps_weight = torch.ones(1, dtype=first.dtype, device=first.device)
        self.is_sgp_ps_numerator = False
        self.gossip_enable = True
        self.gossiping = False
        self.params_mixed = True
        self.gossip_ps_factor = torch.zeros(1, dtype=first.dtype, device=first.device)
        self.gossip_ps_weight = self.ps_weight.clone()
        pin = DeviceHandle.for_device("cpu").pin_memory
        self.gossip_params: List[Tensor] = []
        for p in module.parameters():
            clone = p.detach().clone().to(comm_device)
            self.gossip_params.append(pin(clone) if comm_device.type == "cpu" else clone)
        self.gossip_device_buffer = self.gossip_params
        self.gossip_lock = threading.Lock()
        self.gossip_flag = threading.Event()
        self.train_flag = threading.Event()
        handle = DeviceHandle.for_device(comm_device)
        self._handle = handle
        self.gossip_stream = handle.new_stream() if (handle.is_accelerator and use_streams) else handle.current_stream()
        self.gossip_thread: Optional[threading.Thread] = None
        if self.is_node_master:
            self.gossip_thread = threading.Thread(target=self._gossip_target, name="Gossip-Thread", daemon=True)
            self.gossip_thread.start()
        else:
            self.gossip_flag.set()
        if not self.gossip_flag.wait(timeout=HEARTBEAT_TIMEOUT):
            raise RuntimeError("Gossip thread did not start")
        self.gossip_flag.clear()
        self.lazy_mixing = not self.asynch and self.mixing.is_regular()
        self.lazy_ps_factor = self.gossip_ps_factor.clone()

    # ---- push-sum numerator form

    def ps_numerator(self) -> None:
        """Multiply the parameters by the push-sum weight (no-op under lazy mixing)."""
        if not self.is_sgp_ps_numerator and not self.lazy_mixing:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.mul_(self.ps_weight.type(p.dtype))
            self.is_sgp_ps_numerator = True

    def unbias(self) -> None:
        """Divide the parameters by the push-sum weight (no-op under lazy mixing)."""
        if self.is_sgp_ps_numerator and not self.lazy_mixing:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.div_(self.ps_weight.type(p.dtype))
            self.is_sgp_ps_numerator = False

    # ---- main thread

    def transfer_params(self, mix: bool = True) -> bool:
        """Hand the parameters to the gossip thread for one round; ``False`` when nothing was started."""
        if not self.is_node_master or not self.gossip_enable:
            return False
        if self.gossiping:
            self.logger.warning("params not mixed")
            return False
        self.ps_numerator()
        with torch.no_grad():
            if mix and not self.lazy_mixing:
                factor = self.gossip_ps_factor
                self.ps_weight.mul_(factor)
                for p in self.module.parameters():
                    p.mul_(factor.type(p.dtype))
            self.gossip_ps_weight.copy_(self.ps_weight)
            with self.gossip_lock:
                for p, g in zip(self.module.parameters(), self.gossip_params):
                    g.copy_(p.detach())
        self._handle.synchronize()
        self.gossiping = True
        self.params_mixed = False
        self.train_flag.set()
        return True

    def query_gossip_queue(self, non_blocking: bool = False) -> bool:
        """Absorb a finished gossip round (waiting for it unless ``non_blocking``); ``True`` if one was absorbed."""
        if not self.gossip_enable:
            return False
        if not self.gossiping:
            if self.is_node_master:
                self.logger.warning("not gossiping right now")
            return False
        if not non_blocking and not self.gossip_flag.wait(timeout=HEARTBEAT_TIMEOUT):
            raise RuntimeError("Gossip flag timeout")
        if not self.gossip_flag.is_set():
            return False
        self.gossip_flag.clear()
        self.gossiping = False
        if float(self.gossip_ps_weight[0]) == -1:
            # The round failed (see the thread's log): send the unmixed parameters again next time.
            self.params_mixed = True
            self.transfer_params(mix=False)
            return False
        self.ps_numerator()
        with torch.no_grad():
            self.ps_weight.add_(self.gossip_ps_weight.to(self.ps_weight.device))
            if self.lazy_mixing:
                self.ps_weight.mul_(self.lazy_ps_factor)
            with self.gossip_lock:
                for p, r in zip(self.module.parameters(), self.gossip_device_buffer):
                    p.add_(r.to(p.device))
                    if self.lazy_mixing:
                        p.mul_(self.lazy_ps_factor.type(p.dtype))
        self.params_mixed = True
        return True

    # ---- gossip thread

    def _gossip_target(self) -> None:
        logger = make_logger(self.logical_rank, self.verbose)
        gossipers: Dict[torch.dtype, Gossiper] = {}
        gossiper_cls: Callable[..., Gossiper] = PushSum if self.push_sum else PushPull
        for dtype, group in group_by_dtype(self.gossip_params).items():
            gossipers[dtype] = gossiper_cls(
                flatten_tensors(group),
                device=self.comm_device,
                graph=self.graph,
                mixing=self.mixing,
                rank=self.process_rank,
                world_size=self.logical_world_size,
                logger=logger,
            )
        first = next(iter(gossipers.values()))
        self.gossip_ps_factor.copy_(first.mixing_weights["lo"].to(self.gossip_ps_factor.device))
        self.gossip_flag.set()
        while True:
            self.train_flag.wait()
            logger.debug("gossip round starting")
            try:
                with self._handle.stream(self.gossip_stream):
                    self._one_round(gossipers)
            except RuntimeError as e:
                logger.warning(f"received runtime error {e}")
                for gossiper in gossipers.values():
                    gossiper.clean_msg_buffers_()
                self.gossip_ps_weight.fill_(-1)
            self.gossip_stream.synchronize()
            self.train_flag.clear()
            self.gossip_flag.set()

    def _one_round(self, gossipers: Dict[torch.dtype, Gossiper]) -> None:
        ps_weight = self.gossip_ps_weight.clone()
        for dtype, group in group_by_dtype(self.gossip_params).items():
            gossiper = gossipers[dtype]
            out_msg = flatten_tensors(group)
            with self.gossip_lock:
                in_msg, received_ps = gossiper.mix(out_msg, ps_weight.to(out_msg.dtype))
                self.gossip_ps_factor.copy_(gossiper.mixing_weights["lo"].to(self.gossip_ps_factor.device))
                for r, g in zip(unflatten_tensors(in_msg, group), group):
                    g.copy_(r)
            self.gossip_ps_weight.copy_(received_ps.to(self.gossip_ps_weight.dtype))
