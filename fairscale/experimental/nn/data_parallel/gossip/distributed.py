# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo distributed data parallel: LocalSGD or SGP as base algorithm, plus an optional slow-momentum step.

SlowMo (https://arxiv.org/abs/1910.00643) lets each node take local optimizer steps and only periodically
synchronises: LocalSGD averages the parameters over the nodes every ``localsgd_frequency`` updates, SGP gossips
them with one peer per update, and every ``slowmo_frequency`` updates a slow-momentum step is applied to the
exactly averaged parameters. Inside a node (``nprocs_per_node > 1``) gradients are averaged after every backward,
as DDP does, and only node masters take part in the inter-node algorithm.

Usage::

    model = SlowMoDistributedDataParallel(model, nprocs_per_node=8)
    for batch in data:
        loss = criterion(model(batch))
        loss.backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
"""

import logging
import os
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from fairscale.internal.agreement import comparable_number
from fairscale.internal.dry_load import dry_run_load
from fairscale.internal.collectives import group_ranks
from fairscale.internal.device import DeviceHandle, current_accelerator_device
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.group_copy import deepcopy_sharing_group

from ._backward_callback import BackwardCallback, has_opaque_parts, unhooked_output_error
from ._fp32_masters import fp16_fp32_pairs, subtract_before_communication
from ._groups import build_groups
from ._node_collectives import (
    average_gradients_in_node,
    average_params_among_masters,
    broadcast_from,
    check_dense_gradients,
)
from ._settings import (
    check_algorithm_settings,
    check_construction_agrees,
    check_dense_embeddings,
    check_real_numbers,
    check_sizes,
    graph_mismatch,
    meta_sgp_error,
)
from ._sgp import SgpGossip, deepcopy_error
from ._sgp_state_dict import add_sgp_entries, check_sgp_assign, set_sgp_values, take_sgp_entries
from ._slow_momentum import SlowMomentum
from .graph_manager import GraphManager, NPeerDynamicDirectedExponentialGraph
from .mixing_manager import MixingManager, UniformMixing
from .utils.cuda_metering import create_event_recorder
from .utils.helpers import MultiProcessAdapter

# Upstream's module also exposes these names (it imports them for its own use); re-exported for old imports.
from .gossiper import Gossiper as Gossiper, PushPull as PushPull, PushSum as PushSum  # noqa: F401
from .graph_manager import NPeerDynamicDirectedExponentialGraph as NPDDEGraph  # noqa: F401  # upstream's short name
from .utils.cuda_metering import EventRecorder as EventRecorder  # noqa: F401
from .utils.helpers import communicate as communicate  # noqa: F401
from .utils.helpers import create_process_group as create_process_group  # noqa: F401
from .utils.helpers import flatten_tensors as flatten_tensors  # noqa: F401
from .utils.helpers import group_by_dtype as group_by_dtype  # noqa: F401
from .utils.helpers import make_logger as make_logger  # noqa: F401
from .utils.helpers import unflatten_tensors as unflatten_tensors  # noqa: F401

__all__ = ["SlowMoDistributedDataParallel", "SlowMoBaseAlgorithm", "HEARTBEAT_TIMEOUT", "BROADCAST_BUCKET_SIZE"]

HEARTBEAT_TIMEOUT = 300  # seconds
BROADCAST_BUCKET_SIZE = 10 * 1024 * 1024


class SlowMoBaseAlgorithm(str, Enum):
    LOCALSGD = "localsgd"
    SGP = "sgp"


class SlowMoDistributedDataParallel(nn.Module):
    """Wrap ``module`` for SlowMo training (see the module docstring); call :meth:`perform_slowmo` after each step.

    Args:
        module (nn.Module): the model (fp32 or fp16 parameters, on the rank's device).
        nprocs_per_node (int): processes per node.
        broadcast_buffers (bool): broadcast the module's buffers from rank 0 before every forward.
        slowmo_base_algorithm (SlowMoBaseAlgorithm): ``LOCALSGD`` (default) or ``SGP``.
        slowmo_momentum (float): slow momentum ``β`` (0 and ``slowmo_lr == 1`` disable the slow-momentum step).
        slowmo_memory_efficient (bool): shard the slow-momentum buffers over ``slowmo_num_shards`` ranks.
        slowmo_frequency (int): updates between slow-momentum steps.
        slowmo_lr (float): slow learning rate ``α``.
        slowmo_num_shards (int): ranks holding slow-momentum shards in memory-efficient mode.
        localsgd_frequency (int): updates between LocalSGD averages.
        graph (Optional[GraphManager]): SGP topology (default: ``NPeerDynamicDirectedExponentialGraph``).
        mixing (Optional[MixingManager]): SGP mixing (default: ``UniformMixing``).
        push_sum (bool): SGP with :class:`PushSum` (default) or :class:`PushPull`.
        overlap (bool): must be ``False`` (overlapping SGP is disabled, as upstream).
        synch_freq (int): SGP asynchrony (``> 0`` disables lazy mixing).
        use_streams (bool): run SGP communication on its own accelerator stream.
        slowmo_sgp_average_params (bool): with SGP, average exactly on slow-momentum updates.
        verbose (bool): debug logging.
        profile_mode (bool): time the phases with :class:`CudaEventRecorder`.
        process_rank, process_world_size (Optional[int]): default to the global rank and world size.
        global_group, master_group, local_node_group: groups to use instead of creating them.
        comm_device (Optional[torch.device]): where communication buffers live (default: CPU for gloo, else the
            current accelerator).
    """

    def __init__(
        self,
        module: nn.Module,
        nprocs_per_node: int,
        broadcast_buffers: bool = True,
        slowmo_base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD,
        slowmo_momentum: float = 0.5,
        slowmo_memory_efficient: bool = True,
        slowmo_frequency: int = 48,
        slowmo_lr: float = 1.0,
        slowmo_num_shards: int = 32,
        localsgd_frequency: int = 3,
        graph: Optional[GraphManager] = None,
        mixing: Optional[MixingManager] = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        use_streams: bool = True,
        slowmo_sgp_average_params: bool = False,
        verbose: bool = False,
        profile_mode: bool = False,
        process_rank: Optional[int] = None,
        process_world_size: Optional[int] = None,
        global_group: Optional[Any] = None,
        master_group: Optional[Any] = None,
        local_node_group: Optional[Any] = None,
        comm_device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        # A blocking NCCL wait turns the gossip thread's pending receives into errors.
        blocking_wait = os.environ.get("NCCL_BLOCKING_WAIT", "0")
        if blocking_wait != "0":
            raise FairscaleRuntimeError(
                f"SlowMoDistributedDataParallel: NCCL_BLOCKING_WAIT is {blocking_wait!r}, but a blocking NCCL wait "
                "turns the gossip thread's pending receives into errors; unset it or set it to 0"
            )
        if process_world_size is None or process_rank is None:
            if not dist.is_initialized():
                raise FairscaleRuntimeError(
                    "SlowMoDistributedDataParallel: process_rank and process_world_size were not both given and "
                    "torch.distributed is not initialised; call torch.distributed.init_process_group first, or pass "
                    "process_rank and process_world_size"
                )
            process_rank = dist.get_rank()
            process_world_size = dist.get_world_size()
        self.process_rank = process_rank
        self.process_world_size = process_world_size
        sgp_graph_error = None
        if slowmo_base_algorithm == SlowMoBaseAlgorithm.SGP and (graph is not None or mixing is not None):
            sgp_graph_error = graph_mismatch(graph, mixing, process_rank, process_world_size, nprocs_per_node)
        if sgp_graph_error is None:  # refused by the agreement check below on every rank, before any group exists
            sgp_graph_error = meta_sgp_error(module, slowmo_base_algorithm, nprocs_per_node, process_world_size)
        if dist.is_initialized():
            # What decides the groups and collectives, and the tensors they carry, must be the same on every rank:
            # otherwise group creation waits forever or the first collective has other sizes (gloo aborts the
            # process). One small all-gather, before any group is created.
            # The slow momentum's values and the SGP options too: ranks with other values diverged silently (lr,
            # momentum) or waited in different collectives (one rank averaging parameters through the master group
            # while another gossips; overlap or push_sum on one rank only).
            settings = [
                ("world size", process_world_size),
                ("nprocs_per_node", nprocs_per_node),
                ("base algorithm", str(slowmo_base_algorithm)),
                ("slowmo_lr", comparable_number(slowmo_lr)),
                ("slowmo_momentum", comparable_number(slowmo_momentum)),
                ("memory efficient", slowmo_memory_efficient),
                ("slowmo_frequency", slowmo_frequency),
                ("slowmo_num_shards", slowmo_num_shards),
                ("localsgd_frequency", localsgd_frequency),
                ("broadcast_buffers", broadcast_buffers),
                ("synch_freq", synch_freq),
                ("slowmo_sgp_average_params", bool(slowmo_sgp_average_params)),
                ("overlap", bool(overlap)),
                ("push_sum", bool(push_sum)),
                ("graph class", type(graph).__name__ if graph is not None else None),
                ("mixing class", type(mixing).__name__ if mixing is not None else None),
            ]
            check_construction_agrees(module, settings, process_rank, process_world_size, global_group, sgp_graph_error)
        if sgp_graph_error is not None:  # (without torch.distributed: this process alone)
            raise sgp_graph_error
        # After the agreement check: a value refused on one rank only is a disagreement, raised on every rank there.
        self.nprocs_per_node = check_sizes(nprocs_per_node, process_world_size)
        self.process_world_size = process_world_size = int(process_world_size)
        check_real_numbers(slowmo_lr=slowmo_lr, slowmo_momentum=slowmo_momentum)
        check_algorithm_settings(
            slowmo_base_algorithm,
            slowmo_lr != 1 or slowmo_momentum != 0,
            slowmo_memory_efficient,
            slowmo_frequency,
            localsgd_frequency,
            slowmo_num_shards,
        )
        if self.nprocs_per_node > 1:
            check_dense_embeddings(module)
        self.logger = self._make_logger(verbose)
        self._init_groups(global_group, master_group, local_node_group)

        self.module = module
        self.broadcast_buffers = broadcast_buffers
        first_param_dtype = next(self.module.parameters()).dtype  # a parameter-less module raises StopIteration
        self.dtype = first_param_dtype
        if comm_device is None:
            accelerator = current_accelerator_device()
            use_cpu = dist.get_backend() == "gloo" or accelerator is None
            comm_device = accelerator if accelerator is not None and not use_cpu else torch.device("cpu")
        self._comm_device = torch.device(comm_device)
        self._cpu_comm = self._comm_device.type == "cpu"
        self.dist_config: Dict[str, Any] = {
            "verbose": verbose,
            "comm_device": self._comm_device,
            "logical_rank": self.logical_rank,
            "process_rank": self.process_rank,
            "logical_world_size": self.logical_world_size,
            "cpu_comm": self._cpu_comm,
        }
        self.profile_mode = profile_mode
        self.num_updates = 0
        self.portion_start: Optional[int] = None
        self.ef1: Optional[List[Tensor]] = None

        self._init_algorithm(
            slowmo_base_algorithm,
            slowmo_momentum,
            slowmo_memory_efficient,
            slowmo_frequency,
            slowmo_lr,
            slowmo_num_shards,
            localsgd_frequency,
            overlap,
            slowmo_sgp_average_params,
        )
        self._sgp: Optional[SgpGossip] = None
        self._sgp_entries_taken = False  # during this model's own load_state_dict
        if self.sgp:
            self._sgp_init(graph, mixing, push_sum, overlap, synch_freq, use_streams, verbose)
        self._backward_callback = BackwardCallback()
        self.register_forward_pre_hook(self._forward_pre_hook)
        self.logger.debug("Initialization of SlowMoDistributedDataParallel complete")

    # ---- construction helpers

    def _make_logger(self, verbose: bool) -> Union[logging.Logger, logging.LoggerAdapter]:  # type: ignore[type-arg]
        logger = logging.getLogger(__name__)
        if verbose:
            logger.setLevel(logging.DEBUG)
        if logger.isEnabledFor(logging.DEBUG):
            return MultiProcessAdapter(logger, {"process_num": self.process_rank})
        return logger

    def _init_algorithm(
        self,
        slowmo_base_algorithm: SlowMoBaseAlgorithm,
        slowmo_momentum: float,
        slowmo_memory_efficient: bool,
        slowmo_frequency: int,
        slowmo_lr: float,
        slowmo_num_shards: int,
        localsgd_frequency: int,
        overlap: bool,
        slowmo_sgp_average_params: bool,
    ) -> None:
        self.slowmo = slowmo_lr != 1 or slowmo_momentum != 0
        self.slowmo_lr = slowmo_lr if self.slowmo else 1
        self.slowmo_momentum = slowmo_momentum if self.slowmo else 0
        self.slowmo_frequency = slowmo_frequency
        self.slowmo_sgp_average_params = slowmo_sgp_average_params
        self.localsgd = slowmo_base_algorithm == SlowMoBaseAlgorithm.LOCALSGD
        self.sgp = slowmo_base_algorithm == SlowMoBaseAlgorithm.SGP
        self.localsgd_frequency = localsgd_frequency
        self.overlap = overlap
        if self.master_group is None or self.logical_world_size == 1:
            # One node (upstream disabled these only for one node of several processes; one process built a
            # gossip graph of one node, which failed with "math domain error").
            self.localsgd = self.sgp = False
            self.logger.warning("Disabling LocalSGD and SGP since a local allreduce will suffice")
        if self.slowmo and not self.localsgd and not self.sgp:
            self.logger.warning("SlowMo is being used without LocalSGD and SGP")
        self.slowmo_memory_efficient = slowmo_memory_efficient
        self.slowmo_num_shards = min(self.process_world_size, slowmo_num_shards) if self.slowmo_memory_efficient else 1
        self.is_current_node_a_slowmo_shard = (
            self.process_rank < self.slowmo_num_shards if self.slowmo_memory_efficient else True
        )
        self._slow_momentum = SlowMomentum(
            self.slowmo,
            float(self.slowmo_momentum),
            float(self.slowmo_lr),
            self.slowmo_memory_efficient,
            self.slowmo_num_shards,
            self.process_rank,
            self.process_world_size,
        )

    def _init_groups(self, global_group: Any, master_group: Any, local_node_group: Any) -> None:
        groups = build_groups(
            self.process_rank,
            self.process_world_size,
            self.nprocs_per_node,
            global_group,
            master_group,
            local_node_group,
        )
        self.local_rank, self.logical_rank = groups.local_rank, groups.logical_rank
        self.logical_world_size = groups.logical_world_size
        self.global_group = self.process_group = groups.global_group
        self.local_node_group, self.master_group = groups.local_node_group, groups.master_group

    def _sgp_init(
        self,
        graph: Optional[GraphManager],
        mixing: Optional[MixingManager],
        push_sum: bool,
        overlap: bool,
        synch_freq: int,
        use_streams: bool,
        verbose: bool,
    ) -> None:
        if graph is None:
            graph = NPeerDynamicDirectedExponentialGraph(
                self.logical_rank, self.logical_world_size, self.nprocs_per_node, self.local_rank
            )
        if mixing is None:
            mixing = UniformMixing(graph, self._comm_device)
        self.dist_config.update({"graph": graph, "mixing": mixing, "push_sum": push_sum})
        if overlap:
            raise FairscaleValueError(
                "SlowMoDistributedDataParallel: overlapping SGP communication is not supported; pass overlap=False"
            )
        if not push_sum and not graph.is_bipartite_graph():
            # PushPull sends before it receives on every active rank: on a graph where every rank is active (the
            # default exponential graph) all ranks block in their first send.
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel: push_sum=False (PushPull) needs a bipartite graph, got "
                f"{type(graph).__name__}; pass graph=DynamicBipartiteExponentialGraph(...) or "
                "DynamicBipartiteLinearGraph(...), or push_sum=True"
            )
        self._sgp = SgpGossip(
            self.module,
            graph,
            mixing,
            push_sum,
            synch_freq,
            use_streams,
            self._comm_device,
            self.process_rank,
            self.logical_rank,
            self.logical_world_size,
            self.local_rank == 0,
            verbose,
            self.logger,
        )

    # ---- SGP state exposed with upstream's names

    @property
    def ps_weight(self) -> Tensor:
        if self._sgp is None:
            raise FairscaleRuntimeError(
                "SlowMoDistributedDataParallel.ps_weight only exists with the SGP base algorithm, and this model "
                "does not gossip; build it with slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP on more than one node"
            )
        return self._sgp.ps_weight

    @property
    def is_sgp_ps_numerator(self) -> bool:
        return self._sgp.is_sgp_ps_numerator if self._sgp is not None else False

    @property
    def gossip_enable(self) -> bool:
        return self._sgp.gossip_enable if self._sgp is not None else False

    @property
    def global_momentum_buffers_initialized(self) -> bool:
        return self._slow_momentum.initialized

    @property
    def old_params(self) -> Optional[Tensor]:
        return self._slow_momentum.old_params

    @property
    def global_momentum_buffer(self) -> Optional[Tensor]:
        return self._slow_momentum.global_momentum_buffer

    # ---- nn.Module API

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # A backward that raised (an OOM the training loop catches and skips) leaves nothing behind: the callback is
        # queued once per backward (graph task), so the next backward queues its own, in training and eval alike.
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            hooked = self._backward_callback.attach(output, self._after_backward)
            if hooked == 0 and self.training and self._needs_backward_callback() and has_opaque_parts(output):
                # Tensors inside objects the walk cannot open (upstream's module backward hook raised a TypeError
                # for such outputs): left unhooked, each rank kept its own gradients and the ranks' weights drifted
                # apart, silently. An output the walk sees whole with no tensor needing grad (predictions, argmax)
                # cannot carry a backward: returned, as upstream.
                raise unhooked_output_error(output)
        return output

    def _needs_backward_callback(self) -> bool:
        """Whether the end of a backward has work to do, for a parameter that requires grad."""
        work = self.local_node_group is not None or (self._sgp is not None and not self._sgp.lazy_mixing)
        return work and any(p.requires_grad for p in self.module.parameters())

    def train(self, mode: bool = True) -> "SlowMoDistributedDataParallel":
        super().train(mode)
        if self._sgp is not None:
            # Upstream re-enables gossip here whatever ``mode`` is.
            self._sgp.gossip_enable = True
        return self

    def eval(self) -> "SlowMoDistributedDataParallel":
        super().eval()
        if self._sgp is not None:
            self._sgp.gossip_enable = False
            self._sgp.query_gossip_queue()
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SlowMoDistributedDataParallel":
        """A copy (an EMA or teacher model) that shares this model's process groups, as torch DDP's copies do (a
        process group cannot be copied: torch's pickling ``TypeError``); refused with SGP on several nodes."""
        if self._sgp is not None:
            raise deepcopy_error()  # before the copy meets the SGP graph's groups (torch's pickling error)
        memo.update({id(g): g for g in (self.local_node_group, self.master_group) if g is not None})  # shared too
        return deepcopy_sharing_group(self, memo, self.global_group)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        state: Dict[str, Any] = super().state_dict(*args, **kwargs)
        if self._sgp is not None:
            # Under the prefix torch gives (this model as a submodule).
            add_sgp_entries(self._sgp, state, kwargs.get("prefix", args[1] if len(args) > 1 else ""))
        return state

    @property
    def module_buffers(self) -> List[Tensor]:
        """The module's buffers, broadcast before each forward: read when used, so that buffers a load with
        ``assign=True`` (or ``.to()``) put in place of the old ones are the ones broadcast."""
        return list(self.module.buffers())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a dict saved by :meth:`state_dict`; with ``strict=False`` absent entries (SGP ones too) are reported
        in the result's ``missing_keys`` instead of raised (upstream loaded strictly whatever ``strict`` said).
        ``assign=True`` puts the dict's tensors in place of the parameters and buffers, as ``nn.Module`` does (e.g.
        to give weights to a model built on the ``meta`` device); with SGP each must keep its dtype and device."""
        state = dict(state_dict)  # the caller's dict is left alone, and a failed load changes nothing
        sgp_missing: List[str] = []
        sgp_values = None
        if self._sgp is not None:
            sgp_values = take_sgp_entries(self._sgp, state, "", None if strict else sgp_missing)
        self._sgp_entries_taken = True  # the SGP entries are out of ``state``: _load_from_state_dict must not look
        try:
            # nn.Module's load copies what fits before it raises for what does not: tried on shape-only tensors.
            dry_run_load(self, lambda: nn.Module.load_state_dict(self, state, strict=strict, assign=assign))
            result = super().load_state_dict(state, strict=strict, assign=assign)
        finally:
            self._sgp_entries_taken = False
        if self._sgp is not None:
            set_sgp_values(self._sgp, sgp_values)
        result.missing_keys.extend(sgp_missing)
        return result

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        # Loaded as a submodule (a parent's load_state_dict): torch's working copy holds the SGP entries under the
        # prefix; absent ones are reported as missing keys, for the parent's load to raise when strict.
        sgp_values = None
        if self._sgp is not None and local_metadata.get("assign_to_params_buffers"):
            # Before anything of this model is loaded (its children load after this call).
            check_sgp_assign(self.named_parameters(), state_dict, prefix)
        if self._sgp is not None and not self._sgp_entries_taken:
            sgp_values = take_sgp_entries(self._sgp, state_dict, prefix, missing_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Not during a parent's dry run (its parameters are meta stand-ins then): ps_weight is no buffer, so that run
        # would set it for real even when the load then fails.
        if self._sgp is not None and not any(p.is_meta for p in self.module.parameters()):
            set_sgp_values(self._sgp, sgp_values)

    # ---- hooks

    def _forward_pre_hook(self, module: nn.Module, inputs: Any) -> None:
        if self.broadcast_buffers and self.module_buffers:
            broadcast_from(self.module_buffers, group_ranks(self.process_group)[0], self.process_group)
        if self._sgp is not None:
            self._sgp.unbias()

    def _after_backward(self) -> None:
        # Queued by the backward callback at the end of each backward through the output.
        if self.local_node_group is not None:
            check_dense_gradients(self.module.named_parameters())
            average_gradients_in_node(self.module.parameters(), self.nprocs_per_node, self.local_node_group)
        if self._sgp is not None:
            self._sgp.ps_numerator()

    # ---- the per-update algorithm

    def _init_global_momentum_buffers(self, optimizer: torch.optim.Optimizer, average: bool = False) -> None:
        """Allocate the slow-momentum buffers from the optimizer's current parameters (lazily on first use)."""
        self._slow_momentum.init_buffers(optimizer, average)
        self.portion_start = self._slow_momentum.portion_start

    def perform_slowmo(self, optimizer: torch.optim.Optimizer, fp32_params: Optional[Any] = None) -> None:
        """Run the base algorithm's communication and, when due, the slow-momentum step.

        Call after ``optimizer.step()`` (ideally after ``optimizer.zero_grad(set_to_none=True)``).

        Args:
            optimizer: the optimizer whose parameters SlowMo updates.
            fp32_params: fp32 master copies of fp16 parameters (fairseq style: a one-entry dict, a list aligned
                with ``self.parameters()``, or one flat tensor), so communication errors are fed back.
        """
        if self._sgp is not None:
            # On every rank (those that do not gossip wait for their node master's broadcast), before anything: another
            # dtype or device since the wrapping would be gossiped in the old one.
            self._sgp.check_parameters()
        if not self.global_momentum_buffers_initialized:
            # After a first local step LocalSGD's replicas differ: each rank's own start (upstream's) drifted them
            # apart for good with memory_efficient=False; their average is common (a fuzz of SlowMo, session 45).
            self._init_global_momentum_buffers(optimizer, average=self.localsgd)
        # Before any communication: parameters added since the buffers were laid out would be corrupted by the step.
        self._slow_momentum.check_layout(optimizer)
        n = self.num_updates
        should_slowmo = self.slowmo and (n + 1) % self.slowmo_frequency == 0
        should_localsgd = self.localsgd and (n + 1) % self.localsgd_frequency == 0
        skip_avg = self.slowmo_memory_efficient and should_slowmo
        should_sgp = self.sgp and not self.overlap and not skip_avg
        should_allreduce = (self.sgp and should_slowmo and self.slowmo_sgp_average_params) or (
            should_localsgd and not skip_avg
        )
        pairs = fp16_fp32_pairs(list(self.parameters()), optimizer, fp32_params)
        if n == 0 and fp32_params is None and not hasattr(optimizer, "_amp_stash"):
            if any(p.dtype == torch.float16 for p in self.parameters()):
                self.logger.warning(
                    "WARNING: please set fp32_params in perform_slowmo() in order to avoid accuracy loss"
                )
        communicating = bool(pairs) and (should_sgp or should_allreduce)
        if communicating:
            subtract_before_communication(pairs, self.logical_world_size if should_allreduce else None)
        if should_sgp and not should_allreduce:
            self._timed("sgp", self._sgp_round)
        if should_allreduce:
            self._timed("localsgd", self._allreduce_params)
        if (should_sgp or should_allreduce) and self.local_node_group is not None:
            self._timed("intra_node_broadcast", self._broadcast_in_node)
        if communicating:
            with torch.no_grad():
                for fp16, fp32 in pairs:
                    fp32.add_(fp16.float())
        if should_slowmo:
            self._timed("slowmo", lambda: self._slow_momentum.step(optimizer))
        if pairs and (should_sgp or should_allreduce or should_slowmo):
            with torch.no_grad():
                for fp16, fp32 in pairs:
                    fp16.copy_(fp32)
        self.num_updates += 1

    def _timed(self, name: str, fn: Any) -> None:
        recorder = create_event_recorder(f"perform_slowmo.{name}", dummy=not self.profile_mode)
        fn()
        recorder.stop()

    def _sync_comm_device(self) -> None:
        DeviceHandle.for_device(self._comm_device).synchronize()

    def _sgp_round(self) -> None:
        assert self._sgp is not None
        if self._sgp.transfer_params():
            self._sgp.query_gossip_queue()
        self._sync_comm_device()

    def _allreduce_params(self) -> None:
        # The ranks other than the node masters get the result from their master (_broadcast_in_node).
        average_params_among_masters(list(self.module.parameters()), self.logical_world_size, self.master_group)
        self._sync_comm_device()

    def _broadcast_in_node(self) -> None:
        master = self.logical_rank * self.nprocs_per_node
        broadcast_from(list(self.module.parameters()), master, self.local_node_group)
        self._sync_comm_device()
