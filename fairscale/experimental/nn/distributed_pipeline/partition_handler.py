# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The worker side of :class:`DistributedPipeline`: one handler per partition, one record per forward.

A :class:`DistributedPipelineRecord` collects the inputs of each micro-batch (fed locally or over RPC). The call
that delivers the last missing input of micro-batch ``k`` computes the partition on it and feeds the outputs to the
consumers. Computing in the delivering call matters: that thread runs inside the caller's distributed autograd
context (RPC messages carrying grad-requiring tensors set it), so the sends to the next partition are recorded and
gradients flow back across workers. Every feed from the driver carries an empty grad-requiring anchor tensor so
that this also holds for the first partition when the model input does not require grad.

Failures do not hang: a partition that fails forwards the exception to its consumers, and the last partition's
result raises it (the original exception, not upstream's ``TypeError`` from re-raising the class).
"""

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .data import DataConsumer

# Upstream's module also exposes the pipe helpers it imported for its polling worker; re-exported for old imports.
from fairscale.nn.pipe.checkpoint import Checkpointing as Checkpointing  # noqa: F401
from fairscale.nn.pipe.dependency import fork as fork, join as join  # noqa: F401
from fairscale.nn.pipe.microbatch import Batch as Batch  # noqa: F401
from fairscale.nn.pipe.stream import as_cuda as as_cuda, current_stream as current_stream  # noqa: F401
from fairscale.nn.pipe.stream import is_cuda as is_cuda, use_device as use_device  # noqa: F401
from fairscale.nn.pipe.stream import use_stream as use_stream  # noqa: F401
from fairscale.nn.pipe.worker import Task as Task, create_workers as create_workers  # noqa: F401

__all__ = ["PartitionHandler", "DistributedPipelineRecord"]

# Seconds the last partition waits for its micro-batches before reporting a stuck pipeline.
RESULT_TIMEOUT_S = 300.0


class _Failure:
    """An exception travelling down the pipeline in place of a micro-batch's values."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _feed_local(record: rpc.RRef[Any], chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    record.local_value().feed(chunk, input_idx, value, anchor)


def _feed_rref(record: rpc.RRef[Any], chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    if record.owner().name == rpc.get_worker_info().name:
        _feed_local(record, chunk, input_idx, value, anchor)
    else:
        # A direct rpc_async from this thread: ``RRef.rpc_async()`` issues the call from a callback thread, which
        # has no distributed autograd context, so the send would not be recorded.
        rpc.rpc_async(record.owner(), _feed_local, args=(record, chunk, input_idx, value, anchor))


_RRefConsumer = DataConsumer[rpc.RRef[Any]]


class DistributedPipelineRecord:
    """The state of one forward pass on one partition.

    Args:
        device: the partition's device (CPU inputs are moved there).
        rank: the partition's index.
        chunks: number of micro-batches.
        num_inputs: inputs of the partition's first module.
        num_outputs: outputs of the last module (``None``: a single output).
        consumers: where each output goes.
        module: the partition's module.
        checkpoint_stop: micro-batches ``k < checkpoint_stop`` are checkpointed in training.
        is_last: whether this partition's outputs are the model output.
    """

    # Upstream's name for the type of ``consumers``.
    DataConsumer = _RRefConsumer

    def __init__(
        self,
        device: torch.device,
        rank: int,
        chunks: int,
        num_inputs: int,
        num_outputs: Optional[int],
        consumers: List[_RRefConsumer],
        module: nn.Module,
        checkpoint_stop: int,
    ) -> None:
        self.device = device
        self.rank = rank
        self.chunks = chunks
        self.num_inputs = num_inputs
        self.num_outputs = num_outputs
        self.consumers = consumers
        self.module = module
        self.checkpoint_stop = checkpoint_stop
        self.batches: List[List[Any]] = [[None] * num_inputs for _ in range(chunks)]
        self.fed: List[List[bool]] = [[False] * num_inputs for _ in range(chunks)]
        self.outputs: List[Any] = [None] * chunks
        self.done = 0
        self._cond = threading.Condition()

    def __getstate__(self) -> Dict[str, Any]:
        # Records never travel; RRefs to them do.
        return {}

    def feed(self, chunk: int, input_idx: int, input: Any, anchor: Optional[Tensor] = None) -> None:
        """Deliver input ``input_idx`` of micro-batch ``chunk``; computes the micro-batch once complete."""
        value = input
        with self._cond:
            assert not self.fed[chunk][input_idx], f"input {input_idx} of micro-batch {chunk} was fed twice"
            if isinstance(value, Tensor) and value.device != self.device:
                value = value.to(self.device)
            self.batches[chunk][input_idx] = value
            self.fed[chunk][input_idx] = True
            complete = all(self.fed[chunk])
        if complete:
            self._compute(chunk, anchor)

    def _compute(self, chunk: int, anchor: Optional[Tensor]) -> None:
        inputs = self.batches[chunk]
        failure = next((v for v in inputs if isinstance(v, _Failure)), None)
        result: Any
        if failure is not None:
            result = failure
        else:
            try:
                result = self._run(chunk, inputs)
            except Exception as e:  # forwarded, so that the pipeline's result reports it instead of hanging
                result = _Failure(e)
        for consumer in self.consumers:
            value = result
            if not isinstance(result, _Failure) and self.num_outputs is not None:
                value = result[consumer.output_idx]
            _feed_rref(consumer.consumer, chunk, consumer.consumer_input_idx, value, anchor)
        with self._cond:
            self.outputs[chunk] = result
            self.done += 1
            self._cond.notify_all()

    def _run(self, chunk: int, inputs: List[Any]) -> Any:
        if chunk < self.checkpoint_stop and self.module.training and torch.is_grad_enabled():
            # Non-reentrant checkpointing recomputes inside the same backward, so the gradients land in the
            # distributed autograd context (upstream's checkpointed micro-batches wrote the local .grad instead).
            return checkpoint(self.module, *inputs, use_reentrant=False)
        return self.module(*inputs)

    def wait_outputs(self) -> List[Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done == self.chunks, timeout=RESULT_TIMEOUT_S):
                raise RuntimeError(
                    f"partition {self.rank}: only {self.done} of {self.chunks} micro-batches arrived within "
                    f"{RESULT_TIMEOUT_S:.0f} s"
                )
            return list(self.outputs)


class PartitionHandler:
    """Created on the owner of a partition's module; makes records and runs them.

    Args:
        module_rref: RRef of the partition's module (local to this worker).
        device: the partition's device.
        num_inputs: inputs of the first module.
        num_outputs: outputs of the last module (``None``: one).
        rank: the partition's index.
        chunks: number of micro-batches.
        checkpoint_stop: micro-batches below it are checkpointed in training.
    """

    def __init__(
        self,
        module_rref: rpc.RRef[Any],
        device: str,
        num_inputs: int,
        num_outputs: Optional[int],
        rank: int,
        chunks: int,
        checkpoint_stop: int,
    ) -> None:
        self.module = module_rref.local_value()
        self.device = torch.device(device)
        self.num_inputs = num_inputs
        self.num_outputs = num_outputs
        self.rank = rank
        self.chunks = chunks
        self.checkpoint_stop = checkpoint_stop

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def local_parameter_rrefs(self) -> List[rpc.RRef[Any]]:
        """One RRef per parameter of the partition's module."""
        return [rpc.RRef(p) for p in self.module.parameters()]

    def make_pipeline_record(self, consumers: List[DataConsumer[rpc.RRef[Any]]]) -> DistributedPipelineRecord:
        """A record for one forward pass whose outputs go to ``consumers``."""
        return DistributedPipelineRecord(
            self.device,
            self.rank,
            self.chunks,
            self.num_inputs,
            self.num_outputs,
            consumers,
            self.module,
            self.checkpoint_stop,
        )

    def run_pipeline(self, pipeline_record_rref: rpc.RRef[Any]) -> Optional[Tensor]:
        """Wait for every micro-batch of the record; for the last partition return the concatenated output."""
        record: DistributedPipelineRecord = pipeline_record_rref.local_value()
        outputs = record.wait_outputs()
        failure = next((o for o in outputs if isinstance(o, _Failure)), None)
        if failure is not None:
            raise failure.exc
        if record.consumers:
            return None
        assert self.num_outputs is None, "the last partition of a DistributedPipeline must have a single output"
        return torch.cat(outputs)


def _split_inputs(inputs: Tuple[Tensor, ...], chunks: int) -> List[Tuple[Tensor, ...]]:
    """Micro-batches of every input along dim 0 (``chunks`` of each)."""
    pieces = [t.chunk(chunks) for t in inputs]
    return list(zip(*pieces))
