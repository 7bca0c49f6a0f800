# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The worker side of :class:`DistributedPipeline`: one handler per partition, one record per forward.

A :class:`DistributedPipelineRecord` collects the inputs of each micro-batch (fed locally or over RPC). The call
that delivers the last missing input of micro-batch ``k`` computes the partition on it and feeds the outputs to the
consumers. Computing in the delivering call matters: that thread runs inside the caller's distributed autograd
context (RPC messages carrying grad-requiring tensors set it, and there is no Python API to set it in another
thread), so the sends to the next partition are recorded and gradients flow back across workers. Every feed from
the driver carries an empty grad-requiring anchor tensor so that this also holds for the first partition when the
model input does not require grad.

Threading design: no RPC handler ever waits.

Every incoming RPC runs on a thread of the receiving worker's RPC agent, a fixed pool (TensorPipe:
``num_worker_threads``, 16 by default). A handler that waits -- for the reply of another RPC, or for a value that
another message will deliver -- keeps its thread while it waits. Once every thread of a worker waits like that, the
messages that would end the waits are never served, and the pipeline deadlocks. The first design did exactly that:
``run_pipeline`` sat in a handler for the whole forward waiting for all micro-batches, feeds and remote method calls
sat in ``RRef.local_value()`` until a record or handler that another queued message was creating existed, and the
loss waited for the pipeline's output; on a loaded machine about 3 runs in 10 ran out of threads. So:

* The driver (the thread calling :meth:`DistributedPipeline.forward`, which is not an RPC handler and may wait)
  creates the partition modules, the handlers and each forward's records with synchronous RPCs, each of which
  only builds an object and returns. Any RRef a handler is later given therefore already holds its value, and
  ``local_value()`` in a handler returns at once.
* A feed stores its input and returns. The feed that completes micro-batch ``k`` also computes it (the partition's
  own forward: work that ends, not a wait) and hands the outputs on with ``rpc_async``, whose reply nobody waits
  for; a local consumer is fed by a plain call.
* Waiting for the results is a future, not a thread: :meth:`PartitionHandler.run_pipeline` is an
  ``@rpc.functions.async_execution`` function returning a future that the feed completing the last micro-batch
  resolves; the RPC agent replies when it resolves, and no thread is held meanwhile. The loss
  (:mod:`.loss`) chains on futures the same way.

Hence every handler finishes after a bounded amount of its own work, whatever the other workers do, and a pipeline
runs even with one RPC thread per worker. Nothing here times out on its own: a pipeline that stops (a worker died)
surfaces as the driver's RPC timeout.

Failures do not hang: a partition that fails forwards the exception to its consumers, and the last partition's
result raises it (the original exception, not upstream's ``TypeError`` from re-raising the class).
"""

import threading
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, TypeVar, cast

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch import Tensor
from torch.futures import Future
from torch.utils.checkpoint import checkpoint

from fairscale.nn.pipe.checkpoint import RNGStates, restore_rng_states, save_rng_states

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


_F = TypeVar("_F", bound=Callable[..., Any])


def _async_execution(fn: _F) -> _F:
    """``rpc.functions.async_execution`` keeping ``fn``'s type (torch's decorator is untyped).

    Over RPC, a function so marked returns a future and the agent replies when it resolves, so its thread is free
    meanwhile; called directly, it returns the future.
    """
    return cast(_F, rpc.functions.async_execution(fn))


class _Failure:
    """An exception travelling down the pipeline in place of a micro-batch's values."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _rpc_error(exc: BaseException) -> Any:
    """The value an RPC function returns to make its caller raise ``exc`` (same type, remote traceback in the text).

    An ``async_execution`` future that ends in an error reaches the caller as a ``RuntimeError`` carrying only
    text, so futures here resolve to this value instead: it is what RPC itself returns for a plain function that
    raised, and ``to_here()``/``local_value()``/``rpc_sync()`` re-raise it.
    """
    from torch.distributed.rpc.internal import RemoteException

    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteException(f"On {rpc.get_worker_info()}:\n{exc!r}\n{trace}", type(exc))


def _feed_local(record: rpc.RRef[Any], chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    # The driver created the record with a synchronous RPC before sending any feed, so this does not wait.
    record.local_value().feed(chunk, input_idx, value, anchor)


def _feed_rref(record: rpc.RRef[Any], chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    if record.owner().name == rpc.get_worker_info().name:
        _feed_local(record, chunk, input_idx, value, anchor)
    else:
        # A direct rpc_async from this thread: ``RRef.rpc_async()`` issues the call from a callback thread, which
        # has no distributed autograd context, so the send would not be recorded. Its future is not waited on:
        # a feed handler returns nothing, and waiting would hold this thread.
        rpc.rpc_async(record.owner(), _feed_local, args=(record, chunk, input_idx, value, anchor))


_RRefConsumer = DataConsumer[rpc.RRef[Any]]


#: Held while a partition draws from this process's random generators. Micro-batches are computed on the RPC threads
#: that deliver their inputs, so several run at once, and a checkpointed one's recomputation must replay exactly the
#: draws of its forward: with the generators shared, another micro-batch's dropout between the saving of the states
#: and this one's draws (or between their restoring and the replay) gave the recomputation another mask, and the
#: gradients were silently those of another forward. It is taken by the forwards of pipelines that checkpoint (all
#: their micro-batches: an unreplayed one's draws must not fall between another's save and its draws either), and
#: held for compute only (never across a wait for another message), so the pipeline's "no handler waits" design
#: holds; a partition whose forward itself waits for an RPC needs checkpoint="never".
_RANDOMNESS_LOCK = threading.RLock()


class _ReplayRandomness:
    """Calls ``module``: the first call (the forward) records the random states it starts from, a later one (the
    recomputation in backward) runs from them again; each call holds :data:`_RANDOMNESS_LOCK`."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.states: Deque[RNGStates] = deque(maxlen=1)

    def __call__(self, *inputs: Any) -> Any:
        with _RANDOMNESS_LOCK:
            if not self.states:
                save_rng_states(self.device, self.states)
                return self.module(*inputs)
            with restore_rng_states(self.device, self.states):
                return self.module(*inputs)


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
        # Feeds of different micro-batches arrive on different RPC threads.
        self._lock = threading.Lock()
        self._all_done: "Future[List[Any]]" = Future()

    def __getstate__(self) -> Dict[str, Any]:
        # Records never travel; RRefs to them do.
        return {}

    def feed(self, chunk: int, input_idx: int, input: Any, anchor: Optional[Tensor] = None) -> None:
        """Deliver input ``input_idx`` of micro-batch ``chunk``; computes the micro-batch once complete."""
        value = input
        with self._lock:
            if self.fed[chunk][input_idx]:
                raise RuntimeError(f"fairscale internal error: input {input_idx} of micro-batch {chunk} was fed twice")
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
        with self._lock:
            self.outputs[chunk] = result
            self.done += 1
            finished = self.done == self.chunks
        if finished:
            # Runs the callbacks chained by run_pipeline() here, inline: they only assemble the result.
            self._all_done.set_result(list(self.outputs))

    def _run(self, chunk: int, inputs: List[Any]) -> Any:
        if not (self.checkpoint_stop > 0 and self.module.training and torch.is_grad_enabled()):
            return self.module(*inputs)  # nothing of this forward is replayed: its draws need no lock
        if chunk < self.checkpoint_stop:
            # Non-reentrant checkpointing recomputes inside the same backward, so the gradients land in the
            # distributed autograd context (upstream's checkpointed micro-batches wrote the local .grad instead).
            # The random states are saved and replayed by _ReplayRandomness under the process's lock, not by torch
            # (whose save and replay other threads' draws can fall between).
            call = _ReplayRandomness(self.module, self.device)
            return checkpoint(call, *inputs, use_reentrant=False, preserve_rng_state=False)
        with _RANDOMNESS_LOCK:
            return self.module(*inputs)

    def outputs_future(self) -> "Future[List[Any]]":
        """A future of every micro-batch's result (a ``_Failure`` for a failed one), done with the last one."""
        return self._all_done


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

    @_async_execution
    def run_pipeline(self, pipeline_record_rref: rpc.RRef[Any]) -> "Future[Any]":
        """The result of the record's forward: the concatenated output for the last partition, else ``None``.

        An ``async_execution`` function: it returns at once with a future that the last micro-batch resolves, so
        no RPC thread waits for the pipeline. Called over RPC (``handler.rpc_sync().run_pipeline(record)``) the
        caller gets the value, or the partition's exception raised as itself; called directly, the future.

        Args:
            pipeline_record_rref: RRef of a record made by :meth:`make_pipeline_record` on this worker.

        Returns:
            A future of the result.
        """
        record: DistributedPipelineRecord = pipeline_record_rref.local_value()
        return record.outputs_future().then(lambda fut: self._result(record, fut.value()))

    def _result(self, record: DistributedPipelineRecord, outputs: List[Any]) -> Any:
        failure = next((o for o in outputs if isinstance(o, _Failure)), None)
        if failure is not None:
            return _rpc_error(failure.exc)
        if record.consumers:
            return None
        if self.num_outputs is not None:
            return _rpc_error(ValueError("the last partition of a DistributedPipeline must have a single output"))
        try:
            return torch.cat(outputs)
        except Exception as e:  # e.g. outputs that are not tensors; reported to the caller, not lost in a callback
            return _rpc_error(e)


def _new_partition_handler(*args: Any) -> rpc.RRef[Any]:
    """Runs on the partition's worker: a :class:`PartitionHandler` that exists when the caller gets its RRef."""
    return rpc.RRef(PartitionHandler(*args))


def _new_record(handler: rpc.RRef[Any], consumers: List[_RRefConsumer]) -> rpc.RRef[Any]:
    """Runs on the handler's worker: a record that exists when the caller gets its RRef."""
    return rpc.RRef(handler.local_value().make_pipeline_record(consumers))


@_async_execution
def _result_rref(handler: rpc.RRef[Any], record: rpc.RRef[Any]) -> "Future[rpc.RRef[Any]]":
    """Runs on the last partition's worker: a future, resolved with the last micro-batch, of an RRef holding the
    model output (or the exception that ``to_here()`` will raise)."""
    return handler.local_value().run_pipeline(record).then(lambda fut: rpc.RRef(fut.value()))


def _split_inputs(inputs: Tuple[Tensor, ...], chunks: int) -> List[Tuple[Tensor, ...]]:
    """Micro-batches of every input along dim 0 (``chunks`` of each)."""
    pieces = [t.chunk(chunks) for t in inputs]
    return list(zip(*pieces))
