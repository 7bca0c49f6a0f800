# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``DistributedPipeline``: GPipe-style pipelining of a :class:`PipelineModulesGraph` over ``torch.distributed.rpc``.

Usage (inside ``torch.distributed.autograd.context()`` for training)::

    graph = PipelineModulesGraph()
    l1 = RemoteModule("worker0/cpu", nn.Linear, (4, 4))
    l2 = RemoteModule("worker1/cpu", nn.ReLU, ())
    graph.add_sequence([l1, l2], [0])
    pipe = DistributedPipeline(graph, chunks=4)
    out = pipe(x).to_here()

Threads: ``forward`` (the driver) waits, RPC handlers never do; see
``fairscale.experimental.nn.distributed_pipeline.partition_handler`` for why that rules out running out of RPC
threads.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch import Tensor

from .data import DataConsumer
from .graph import Node, PipelineModulesGraph
from .partition_handler import (
    _feed,
    _new_partition_handler,
    _new_record,
    _result_rref,
    _set_training,
    _split_inputs,
    _unique_parameter_rrefs,
)

# Upstream's module also exposes these names; re-exported for old imports.
from fairscale.internal import torch_version as torch_version  # noqa: F401
from .partition_handler import DistributedPipelineRecord as DistributedPipelineRecord  # noqa: F401
from .partition_handler import PartitionHandler as PartitionHandler  # noqa: F401

__all__ = ["DistributedPipeline", "check_pytorch_version", "MOVING_DENIED"]

MOVING_DENIED = TypeError(
    "denied to move parameters and buffers, because DistributedPipeline should manage device placement"
)


def check_pytorch_version() -> None:
    """Raise if torch is older than 1.8 (RPC pipelines need ``RemoteModule``)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (1, 8):
        raise Exception("DistributedPipeline requires PyTorch version 1.8 or higher")


def _needs_anchor() -> bool:
    import torch.distributed.autograd as dist_autograd

    try:
        getattr(dist_autograd, "_current_context")()
    except RuntimeError:  # no distributed autograd context in this thread
        return False
    return True


class DistributedPipeline(nn.Module):
    """Run a :class:`PipelineModulesGraph` as a pipeline of ``chunks`` micro-batches over RPC workers.

    Args:
        graph (PipelineModulesGraph): the model.
        chunks (int): number of micro-batches (default: 1).
        checkpoint (str): ``"always"``, ``"except_last"`` (default) or ``"never"``: which micro-batches recompute
            their activations in backward.

    Raises:
        ValueError: ``chunks`` is not positive, ``checkpoint`` is not one of the three values, the graph's last
            module declares several outputs (the model output is one tensor), or a layer other than the last feeds
            no other layer (the last layer's output is the pipeline's output).
    """

    @dataclass
    class Partition:
        nodes: List[Node]
        handler: rpc.RRef[Any]

        def __hash__(self) -> int:
            return id(self)

    # Upstream's name for the type of ``input_consumers``.
    DataConsumer = DataConsumer[Partition]

    def __init__(self, graph: PipelineModulesGraph, chunks: int = 1, checkpoint: str = "except_last") -> None:
        super().__init__()
        check_pytorch_version()
        chunks = int(chunks)
        checkpoint = str(checkpoint)
        if chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        if checkpoint not in ["always", "except_last", "never"]:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        self.chunks = chunks
        self.checkpoint_stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
        self.partitions: List[DistributedPipeline.Partition] = []
        partitions = graph.partition_graph()
        if not partitions:  # its forward failed with a bare IndexError
            raise ValueError(
                "the graph has no modules: add layers to the PipelineModulesGraph before building the pipeline"
            )
        if partitions[-1][0][-1].num_outputs is not None:
            raise ValueError(
                "the last module of the graph declares num_outputs, but the model output must be a single tensor"
            )
        for nodes, module_rref in partitions:
            first, last = nodes[0], nodes[-1]
            # A synchronous RPC, so the handler exists before any RPC handler dereferences its RRef (a handler
            # waiting in local_value() for an object still being built would hold an RPC thread).
            handler = rpc.rpc_sync(
                first.module.on,
                _new_partition_handler,
                args=(
                    module_rref,
                    first.module.device,
                    len(first.inputs),
                    last.num_outputs,
                    len(self.partitions),
                    self.chunks,
                    self.checkpoint_stop,
                ),
            )
            self.partitions.append(self.Partition(nodes, handler))
        self.input_consumers: List[DataConsumer[DistributedPipeline.Partition]] = [
            DataConsumer(self._partition_of(c.consumer), c.consumer_input_idx, c.output_idx)
            for c in graph.model_input_consumers
        ]
        self.graph = graph

    def _partition_of(self, node: Node) -> "DistributedPipeline.Partition":
        return next(p for p in self.partitions if p.nodes[0] is node)

    # Parameters live on the workers; the pipeline decides where.
    def cuda(self, device: Optional[Any] = None) -> "DistributedPipeline":
        raise MOVING_DENIED

    def cpu(self) -> "DistributedPipeline":
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> "DistributedPipeline":
        if "device" in kwargs or "tensor" in kwargs:
            raise MOVING_DENIED
        if args and isinstance(args[0], (torch.device, int, str, Tensor)):
            raise MOVING_DENIED
        return super().to(*args, **kwargs)  # dtype only

    def _handlers_by_worker(self) -> Dict[str, List[int]]:
        """Indexes of the partitions, grouped by the name of the worker holding them."""
        by_worker: Dict[str, List[int]] = {}
        for i, partition in enumerate(self.partitions):
            by_worker.setdefault(partition.handler.owner().name, []).append(i)
        return by_worker

    def parameter_rrefs(self) -> List[rpc.RRef[Any]]:
        """RRefs of every parameter of every partition, in partition order, each parameter once (for
        ``DistributedOptimizer``: a module shared by two partitions, through
        ``RemoteModule.init_from_module_rref``, is stepped once with its summed gradient)."""
        per_partition: List[List[rpc.RRef[Any]]] = [[] for _ in self.partitions]
        for worker, indexes in self._handlers_by_worker().items():
            handlers = [self.partitions[i].handler for i in indexes]
            for i, rrefs in zip(indexes, rpc.rpc_sync(worker, _unique_parameter_rrefs, args=(handlers,))):
                per_partition[i] = rrefs
        return [rref for rrefs in per_partition for rref in rrefs]

    def train(self, mode: bool = True) -> "DistributedPipeline":
        """Set this module's and every partition's remote modules' training mode (``eval()`` is ``train(False)``).

        The partitions' modules live on the workers, so ``nn.Module.train`` alone left them as they were: dropout
        stayed active and checkpointing ran after ``pipe.eval()``.
        """
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
        super().train(mode)
        for worker, indexes in self._handlers_by_worker().items():
            rpc.rpc_sync(worker, _set_training, args=([self.partitions[i].handler for i in indexes], mode))
        return self

    def forward(self, *inputs: Tensor) -> rpc.RRef[Any]:
        """Run the pipeline on ``inputs`` (split along dim 0).

        Returns once the output is computed (this thread waits for it; the RPC threads of the workers do not), so
        the returned RRef is ready: ``to_here()`` fetches it and ``DistributedLoss`` uses it where it lives.

        Args:
            inputs: tensors with at least ``chunks`` rows, split into ``chunks`` micro-batches along dim 0.

        Returns:
            The RRef of the model output, owned by the last partition's worker. If a partition failed,
            ``to_here()`` raises its exception.

        Raises:
            TypeError: an input is not a tensor.
            ValueError: fewer inputs than the graph reads; an input with no batch dimension (0-d), fewer rows than
                ``chunks``, another number of rows than the first input, or not splitting into ``chunks``
                micro-batches.
        """
        needed = 1 + max((c.output_idx for c in self.input_consumers), default=-1)
        if len(inputs) < needed:  # the feed loop indexed past them (bare IndexError)
            raise ValueError(
                f"the graph reads {needed} model inputs, but the pipeline was called with {len(inputs)}: pass every "
                "input the graph's first modules take"
            )
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor):
                raise TypeError(f"expected Tensor, but got {type(x).__name__} as input {i}")
            if x.dim() == 0:
                raise ValueError(f"input {i} is a 0-d tensor: inputs are split into micro-batches along dim 0")
            # Inputs of other batch sizes were split separately and their micro-batches broadcast together: a wrong
            # output where the model alone raises.
            if x.shape[0] != inputs[0].shape[0]:
                raise ValueError(
                    f"input {i} has {x.shape[0]} rows and input 0 has {inputs[0].shape[0]}: every input is split "
                    "into the same micro-batches along dim 0, so they must have the same batch size"
                )
            if x.shape[0] < self.chunks:
                # Upstream fed fewer micro-batches than every partition waits for and never returned.
                raise ValueError(
                    f"input {i} has {x.shape[0]} rows, fewer than chunks={self.chunks}; use a batch of at least "
                    f"{self.chunks} rows or fewer chunks"
                )
        micro_batches = _split_inputs(inputs, self.chunks)
        if len(micro_batches) != self.chunks:
            raise ValueError(
                f"the batch splits into {len(micro_batches)} micro-batches, not chunks={self.chunks}; use a batch "
                "size that is a multiple of chunks"
            )
        # Each partition's record: its RRef (which keeps it alive until this forward returns) and its key (which
        # the feeds address).
        records: Dict[DistributedPipeline.Partition, Tuple[rpc.RRef[Any], Any]] = {}
        for partition in reversed(self.partitions):
            consumers = []
            for consumer in partition.nodes[-1].output_consumers:
                target = self._partition_of(consumer.consumer)
                if target not in records:
                    raise RuntimeError("fairscale internal error: a partition feeds a partition before it")
                consumers.append(DataConsumer(records[target][1], consumer.consumer_input_idx, consumer.output_idx))
            # Synchronous, like the handlers: every record exists before the first feed can reach it.
            records[partition] = rpc.rpc_sync(
                partition.handler.owner(), _new_record, args=(partition.handler, consumers, torch.is_grad_enabled())
            )
        last = self.partitions[-1]
        # Returns at once on the last worker (an async_execution function): the reply leaves when the last
        # micro-batch is done, and this thread, not an RPC thread, waits for it.
        result = rpc.rpc_async(last.handler.owner(), _result_rref, args=(last.handler, records[last][0]))
        anchor = torch.zeros(0, requires_grad=True) if _needs_anchor() else None
        for chunk, batch in enumerate(micro_batches):
            for input_consumer in self.input_consumers:
                key = records[input_consumer.consumer][1]
                _feed(key, chunk, input_consumer.consumer_input_idx, batch[input_consumer.output_idx], anchor)
        return result.wait()
