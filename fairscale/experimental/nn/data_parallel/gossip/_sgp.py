# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Stochastic gradient push (SGP) for SlowMo: parameters mixed with the in-peers by a background gossip thread.

The main thread hands a copy of the parameters to the gossip thread (:meth:`SgpGossip.transfer_params`), which
runs one :class:`~.gossiper.Gossiper` round per dtype and signals completion; :meth:`SgpGossip.query_gossip_queue`
then adds the received parameters (push-sum numerators) and push-sum weight. With the built-in graphs and uniform
mixing the mixing is "lazy": both are multiplied by the own weight ``lo`` on receipt, so every step replaces a
node's parameters by the plain average of its own and its current in-peers' parameters and the weight stays 1.
"""

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.internal.device import DeviceHandle
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError

from .gossiper import Gossiper, PushPull, PushSum
from .graph_manager import GraphManager
from .mixing_manager import MixingManager
from .utils.helpers import flatten_tensors, group_by_dtype, make_logger, unflatten_tensors

__all__ = ["SgpGossip", "deepcopy_error"]

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
        # What the gossip buffers (and the gossip thread's messages, one per dtype) are laid out for: see
        # check_parameters.
        self._layout = [(name, p.dtype, p.device) for name, p in module.named_parameters()]
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
        # What ended the gossip thread, raised in the main thread at its next wait for a round (an exception there
        # used to go to stderr only, and the main thread waited HEARTBEAT_TIMEOUT for "Gossip flag timeout").
        self.thread_error: Optional[BaseException] = None
        if self.is_node_master:
            # The thread holds this object only weakly between rounds, so a dropped model (its module and gossip
            # buffers) is freed; the finaliser then wakes the thread to end (it looped forever, holding them).
            stop = threading.Event()
            self.gossip_thread = threading.Thread(
                target=_gossip_loop, args=(weakref.ref(self), self.train_flag, stop), name="Gossip-Thread", daemon=True
            )
            weakref.finalize(self, _wake_to_stop, self.train_flag, stop)
            self.gossip_thread.start()
        else:
            self.gossip_flag.set()
        if not self.gossip_flag.wait(timeout=HEARTBEAT_TIMEOUT):
            raise RuntimeError("Gossip thread did not start")
        self.raise_thread_error()
        self.gossip_flag.clear()
        self.lazy_mixing = not self.asynch and self.mixing.is_regular()
        self.lazy_ps_factor = self.gossip_ps_factor.clone()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SgpGossip":
        # A copy would need a gossip thread of its own on the same peer groups, whose rounds would mix with this one's.
        raise deepcopy_error()

    def check_parameters(self) -> None:
        """Raise unless the module's parameters still have the dtypes and devices they had at construction.

        The gossip buffers, and the gossip thread's messages, were laid out for those: after ``model.double()`` each
        round rounded the peers' parameters to float32 (the ranks never agreed), with no error.
        """
        params = list(self.module.named_parameters())
        if len(params) != len(self._layout):
            raise FairscaleRuntimeError(
                f"SlowMoDistributedDataParallel: the module has {len(params)} parameters, but SGP's gossip buffers "
                f"were laid out for the {len(self._layout)} it had when it was wrapped; add every parameter before "
                "wrapping the module, or wrap it again"
            )
        for (name, p), (_, dtype, device) in zip(params, self._layout):
            if p.dtype != dtype or p.device != device:
                raise FairscaleRuntimeError(
                    f"SlowMoDistributedDataParallel: the parameter {name!r} is now {p.dtype} on {p.device}, but SGP "
                    f"gossips in the dtype and on the device the parameters had when the module was wrapped "
                    f"({dtype} on {device}): its buffers were laid out for them; convert the module (.to(), "
                    ".double(), .half()) before wrapping it, or convert it back"
                )

    # ---- push-sum numerator form

    def ps_numerator(self) -> None:
        """Multiply the parameters by the push-sum weight (no-op under lazy mixing)."""
        if not self.is_sgp_ps_numerator and not self.lazy_mixing:
            self.check_parameters()  # ps_weight is on the parameters' device of the wrapping
            with torch.no_grad():
                for p in self.module.parameters():
                    p.mul_(self.ps_weight.type(p.dtype))
            self.is_sgp_ps_numerator = True

    def unbias(self) -> None:
        """Divide the parameters by the push-sum weight (no-op under lazy mixing)."""
        if self.is_sgp_ps_numerator and not self.lazy_mixing:
            self.check_parameters()
            with torch.no_grad():
                for p in self.module.parameters():
                    p.div_(self.ps_weight.type(p.dtype))
            self.is_sgp_ps_numerator = False

    # ---- main thread

    def transfer_params(self, mix: bool = True) -> bool:
        """Hand the parameters to the gossip thread for one round; ``False`` when nothing was started."""
        if not self.is_node_master or not self.gossip_enable:
            return False
        self.raise_thread_error()  # a round handed to a thread that ended would never be done
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
        self.raise_thread_error()
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

    def raise_thread_error(self) -> None:
        """Raise, in the calling (main) thread, the exception that ended the gossip thread, if one did."""
        error = self.thread_error
        if error is not None:
            raise FairscaleRuntimeError(
                f"SlowMoDistributedDataParallel: the SGP gossip thread failed with {type(error).__name__}: {error}; "
                "SGP cannot go on with this model: fix the cause (see the exception chained to this one) and build "
                "a new SlowMoDistributedDataParallel"
            ) from error

    # ---- gossip thread (see _gossip_loop)

    def _fail(self, error: BaseException) -> None:
        self.thread_error = error
        self.gossip_flag.set()  # wakes a main thread waiting for the round, which raises the error

    def _make_gossipers(self) -> Dict[torch.dtype, Gossiper]:
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
        return gossipers

    def _round(self, gossipers: Dict[torch.dtype, Gossiper]) -> None:
        logger = make_logger(self.logical_rank, self.verbose)
        logger.debug("gossip round starting")
        try:
            with self._handle.stream(self.gossip_stream):
                self._one_round(gossipers)
        except RuntimeError as e:
            # A communication failure: the round is reported as failed (weight -1) and sent again unmixed.
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


def deepcopy_error() -> FairscaleTypeError:
    """The error for ``copy.deepcopy`` of a model that gossips with SGP (see ``SgpGossip.__deepcopy__``)."""
    return FairscaleTypeError(
        "SlowMoDistributedDataParallel with SGP cannot be deep-copied: the copy's gossip thread would use the same "
        "peer groups as this model's; deep-copy the wrapped module instead (copy.deepcopy(model.module)) and, to "
        "train the copy with SGP, wrap it in a new SlowMoDistributedDataParallel on every rank"
    )


def _wake_to_stop(train_flag: threading.Event, stop: threading.Event) -> None:
    # The SgpGossip finaliser: holds the thread's events, not the object.
    stop.set()
    train_flag.set()


def _gossip_loop(ref: "weakref.ReferenceType[SgpGossip]", train_flag: threading.Event, stop: threading.Event) -> None:
    """The gossip thread: one round per ``train_flag``, until its :class:`SgpGossip` is gone or a round raises.

    It holds the object (strongly) only during a round. Any exception other than a round's ``RuntimeError`` (handled
    in :meth:`SgpGossip._round`) ends the thread and is raised in the main thread at its next wait.
    """
    sgp = ref()
    if sgp is None:
        return
    try:
        gossipers = sgp._make_gossipers()
    except BaseException as e:  # noqa: B036  # handed to the main thread, which raises it
        sgp._fail(e)
        return
    sgp.gossip_flag.set()
    del sgp
    while True:
        train_flag.wait()
        if stop.is_set():
            return
        sgp = ref()
        if sgp is None:
            return
        try:
            sgp._round(gossipers)
        except BaseException as e:  # noqa: B036
            sgp._fail(e)
            return
        del sgp
