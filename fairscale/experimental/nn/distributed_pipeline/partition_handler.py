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
result raises it (the original exception, not upstream's ``TypeError`` from re-raising the class). So do failures
while handing outputs on: an output index or a declared ``num_outputs`` that does not fit the module's output, and
a feed that cannot be sent or unpickled where it arrives (its failure is delivered in its place). Feeds address
records by key rather than by RRef, so that a failed one leaves no RRef fork for ``rpc.shutdown()`` to wait for.
"""

import contextlib
import functools
import itertools
import pickle
import threading
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple, TypeVar, cast

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch import Tensor
from torch.futures import Future
from torch.utils.checkpoint import checkpoint

from fairscale.internal.containers import rebuild_sequence
from fairscale.nn.checkpoint._training_flags import TrainingFlags, replay_training_flags, training_flags_of
from fairscale.nn.pipe.checkpoint import RNGStates, restore_rng_states, save_rng_states

from .batch_norm_order import MicroBatchStatistics, plain_batch_norms, recomputing
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

    def __reduce__(self) -> Any:
        # An exception that does not survive pickling (unpicklable attributes, an __init__ taking other arguments
        # than its args) would fail the feed carrying it, and the pipeline would wait for the RPC timeout: send its
        # type and text instead.
        try:
            pickle.loads(pickle.dumps(self.exc))
            exc = self.exc
        except Exception:  # any pickling failure: the text is what the caller needs
            exc = RuntimeError(f"{type(self.exc).__name__}: {self.exc}")
        return (_Failure, (exc,))


def _rpc_error(exc: BaseException) -> Any:
    """The value an RPC function returns to make its caller raise ``exc`` (same type, remote traceback in the text).

    An ``async_execution`` future that ends in an error reaches the caller as a ``RuntimeError`` carrying only
    text, so futures here resolve to this value instead: it is what RPC itself returns for a plain function that
    raised, and ``to_here()``/``local_value()``/``rpc_sync()`` re-raise it.
    """
    from torch.distributed.rpc.internal import RemoteException

    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteException(f"On {rpc.get_worker_info()}:\n{exc!r}\n{trace}", type(exc))


@dataclass(frozen=True)
class _RecordKey:
    """Where a :class:`DistributedPipelineRecord` is: its owner's name and its key in the owner's ``_RECORDS``.

    Feeds address records by key, not by RRef: an RRef sent in a feed that then failed (a value that could not be
    pickled here or unpickled there) left its fork unconfirmed, and ``rpc.shutdown()`` waited for it (100 s in the
    agent's RRef clean-up), on top of the RPC timeout of the lost feed.
    """

    owner: str
    key: int


#: The records of this worker by key, held weakly: the record's RRef, which the driver holds until its forward
#: returns, keeps it alive. Every feed of a forward is delivered before its result exists, so a key that is gone
#: only names a forward that failed and was given up.
_RECORDS: "weakref.WeakValueDictionary[int, DistributedPipelineRecord]" = weakref.WeakValueDictionary()
_RECORD_KEYS = itertools.count()


def _feed_local(key: int, chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    # The driver registered the record with a synchronous RPC before sending any feed, so this does not wait. A
    # record that is gone belonged to a forward the driver gave up: nobody waits for this input any more.
    record = _RECORDS.get(key)
    if record is not None:
        record.feed(chunk, input_idx, value, anchor)


def _send_feed(target: _RecordKey, chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> Any:
    if target.owner == rpc.get_worker_info().name:
        _feed_local(target.key, chunk, input_idx, value, anchor)
        return None
    # A direct rpc_async from this thread: ``RRef.rpc_async()`` issues the call from a callback thread, which has no
    # distributed autograd context, so the send would not be recorded.
    return rpc.rpc_async(target.owner, _feed_local, args=(target.key, chunk, input_idx, value, anchor))


def _feed(target: _RecordKey, chunk: int, input_idx: int, value: Any, anchor: Optional[Tensor]) -> None:
    """Deliver ``value`` as input ``input_idx`` of micro-batch ``chunk`` of the record ``target``, or, when that
    fails, the failure, so that the pipeline's result raises it instead of the driver waiting for the RPC timeout.

    The future of a remote feed is not waited on (a feed handler returns nothing, and waiting would hold this
    thread); a callback delivers the failure when it ends in an error (e.g. the value could not be unpickled
    there). A failure that cannot be delivered either is raised here.
    """
    try:
        future = _send_feed(target, chunk, input_idx, value, anchor)
    except Exception as e:  # sending failed here (pickling, a tensor RPC cannot carry)
        if isinstance(value, _Failure):
            raise
        _send_feed(target, chunk, input_idx, _Failure(_feed_error(e, target, chunk, input_idx)), None)
        return
    if future is not None and not isinstance(value, _Failure):
        future.add_done_callback(functools.partial(_on_feed_done, target, chunk, input_idx))


def _feed_error(exc: Exception, target: _RecordKey, chunk: int, input_idx: int) -> Exception:
    return RuntimeError(
        f"DistributedPipeline could not send input {input_idx} of micro-batch {chunk} to its partition on "
        f"{target.owner}: {type(exc).__name__}: {exc}"
    )


def _on_feed_done(target: _RecordKey, chunk: int, input_idx: int, future: "Future[Any]") -> None:
    try:
        future.wait()
    except Exception as e:  # the feed failed on the way or on arrival: deliver the failure instead
        try:
            _send_feed(target, chunk, input_idx, _Failure(_feed_error(e, target, chunk, input_idx)), None)
        except Exception:  # noqa: B902 - nothing left to deliver it with; the driver's RPC timeout reports it
            traceback.print_exc()


_RecordConsumer = DataConsumer[_RecordKey]


def _tied_to_anchor(result: Any, inputs: List[Any], anchor: Optional[Tensor]) -> Any:
    """``result`` with the anchor added (an exact zero) to its first floating-point tensor, when no input requires
    grad: the anchor then carries a gradient back, and the message that brought it is back-propagated.

    Without it, a first partition on another worker than the driver, fed inputs that do not require grad (plain data),
    received the anchor in a message whose receive node no gradient ever reached, and ``dist_autograd.backward``
    waited for it for good.
    """
    if anchor is None or not anchor.requires_grad or not torch.is_grad_enabled():
        return result
    if any(isinstance(v, Tensor) and v.requires_grad for v in inputs):
        return result  # the inputs carry gradients back already

    def tie(t: Tensor) -> Tensor:
        return t + anchor.sum().to(device=t.device, dtype=t.dtype)

    if isinstance(result, Tensor):
        return tie(result) if result.is_floating_point() else result
    if isinstance(result, (tuple, list)):
        values = list(result)
        for i, v in enumerate(values):
            if isinstance(v, Tensor) and v.is_floating_point():
                values[i] = tie(v)
                return rebuild_sequence(result, values)
    return result


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
    """Calls ``module``: the first call (the forward) records the random states it starts from and the modules'
    ``training`` flags, a later one (the recomputation in backward) runs from them again; each call holds
    :data:`_RANDOMNESS_LOCK`.

    The flags: a ``pipe.eval()`` (a validation pass) between a forward and its backward made the recomputation run in
    eval mode, another function than the forward's (wrong gradients through a batch norm; with dropout the backward
    failed), as ``checkpoint_wrapper`` and ``Pipe`` did before they replayed them too.
    """

    def __init__(self, module: nn.Module, device: torch.device, batch_norms: Optional[List[Any]] = None) -> None:
        self.module = module
        self.device = device
        self.batch_norms = batch_norms or []
        self.states: Deque[RNGStates] = deque(maxlen=1)
        self.flags: TrainingFlags = ()

    def __call__(self, *inputs: Any) -> Any:
        with _RANDOMNESS_LOCK:
            if not self.states:
                save_rng_states(self.device, self.states)
                self.flags = training_flags_of(self.module)
                return self.module(*inputs)
            # The forward recorded the batch norms' statistics already (see batch_norm_order.py).
            with replay_training_flags(self.flags), restore_rng_states(self.device, self.states):
                with recomputing(self.batch_norms):
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
        grad_enabled: the caller's grad mode at the forward: the micro-batches run in it (RPC threads have grad on,
            so a forward under the driver's ``torch.no_grad()`` built graphs on every other worker; a fuzz, s. 45).
    """

    # Upstream's name for the type of ``consumers``.
    DataConsumer = _RecordConsumer

    def __init__(
        self,
        device: torch.device,
        rank: int,
        chunks: int,
        num_inputs: int,
        num_outputs: Optional[int],
        consumers: List[_RecordConsumer],
        module: nn.Module,
        checkpoint_stop: int,
        grad_enabled: bool = True,
    ) -> None:
        self.grad_enabled = grad_enabled
        self.device = device
        self.rank = rank
        self.chunks = chunks
        self.num_inputs = num_inputs
        self.num_outputs = num_outputs
        self.consumers = consumers
        self.module = module
        self.checkpoint_stop = checkpoint_stop
        self.batch_norms = plain_batch_norms(module)
        self.statistics = MicroBatchStatistics(self.batch_norms) if self.batch_norms else None
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
        result: Any = failure
        values: List[Any] = []
        if failure is None:
            # Everything up to the sends is forwarded as a failure, so that the pipeline's result reports it
            # instead of the driver waiting for the RPC timeout.
            try:
                with torch.set_grad_enabled(self.grad_enabled):
                    result = _tied_to_anchor(self._run(chunk, inputs), inputs, anchor)
                values = self._consumer_values(result)
            except Exception as e:
                result = failure = _Failure(e)
        for i, consumer in enumerate(self.consumers):
            value = failure if failure is not None else values[i]
            _feed(consumer.consumer, chunk, consumer.consumer_input_idx, value, anchor)
        with self._lock:
            self.outputs[chunk] = result
            self.done += 1
            finished = self.done == self.chunks
        if finished:
            if self.statistics is not None:
                with _RANDOMNESS_LOCK:
                    self.statistics.apply_in_order()
            # Runs the callbacks chained by run_pipeline() here, inline: they only assemble the result.
            self._all_done.set_result(list(self.outputs))

    def _consumer_values(self, result: Any) -> List[Any]:
        """What each consumer gets of ``result``: the whole of it, or its item ``output_idx`` when the partition
        declares ``num_outputs``."""
        if self.num_outputs is None:
            return [result] * len(self.consumers)
        if not isinstance(result, (tuple, list)):
            # Indexing a tensor handed rows of the micro-batch on as "outputs", silently.
            raise TypeError(
                f"the partition's last module was added with num_outputs={self.num_outputs}, but returned "
                f"{type(result).__name__}, not a tuple or list; add it without num_outputs"
            )
        if len(result) < self.num_outputs:
            raise ValueError(
                f"the partition's last module was added with num_outputs={self.num_outputs}, but returned "
                f"{len(result)} outputs"
            )
        return [result[c.output_idx] for c in self.consumers]

    def _run(self, chunk: int, inputs: List[Any]) -> Any:
        checkpointed = self.checkpoint_stop > 0 and self.module.training and torch.is_grad_enabled()
        # A batch norm's own flag decides (one left in train() inside a partition in eval(), or the reverse).
        ordered = self.statistics is not None and any(layer.training for layer in self.batch_norms)
        if not checkpointed and not ordered:
            return self.module(*inputs)  # nothing of this forward is replayed or ordered: it needs no lock
        # Under the lock: a replayed forward's draws (see _RANDOMNESS_LOCK), and the batch norms' tracking switch.
        recording = self.statistics.recording(chunk) if ordered and self.statistics is not None else None
        with _RANDOMNESS_LOCK, recording if recording is not None else contextlib.nullcontext():
            if checkpointed and chunk < self.checkpoint_stop:
                # Non-reentrant checkpointing recomputes inside the same backward, so the gradients land in the
                # distributed autograd context (upstream's checkpointed micro-batches wrote the local .grad instead).
                # The random states are saved and replayed by _ReplayRandomness under the process's lock, not by
                # torch (whose save and replay other threads' draws can fall between).
                call = _ReplayRandomness(self.module, self.device, self.batch_norms)
                return checkpoint(call, *inputs, use_reentrant=False, preserve_rng_state=False)
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

    def make_pipeline_record(
        self, consumers: List[_RecordConsumer], grad_enabled: bool = True
    ) -> DistributedPipelineRecord:
        """A record for one forward pass whose outputs go to ``consumers``, run in grad mode ``grad_enabled``."""
        return DistributedPipelineRecord(
            self.device,
            self.rank,
            self.chunks,
            self.num_inputs,
            self.num_outputs,
            consumers,
            self.module,
            self.checkpoint_stop,
            grad_enabled,
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


def _unique_parameter_rrefs(handlers: List[rpc.RRef[Any]]) -> List[List[rpc.RRef[Any]]]:
    """Runs on the owner of ``handlers``: per handler, RRefs of its module's parameters not already listed for an
    earlier one, so that a parameter shared by two partitions here is stepped once by a ``DistributedOptimizer``
    (listed twice, it was updated twice)."""
    seen: Set[int] = set()
    result: List[List[rpc.RRef[Any]]] = []
    for handler in handlers:
        rrefs = []
        for p in handler.local_value().module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                rrefs.append(rpc.RRef(p))
        result.append(rrefs)
    return result


def _set_training(handlers: List[rpc.RRef[Any]], mode: bool) -> None:
    """Runs on the owner of ``handlers``: puts their partitions' modules in training (or eval) mode."""
    for handler in handlers:
        handler.local_value().module.train(mode)


def _new_partition_handler(*args: Any) -> rpc.RRef[Any]:
    """Runs on the partition's worker: a :class:`PartitionHandler` that exists when the caller gets its RRef."""
    return rpc.RRef(PartitionHandler(*args))


def _new_record(
    handler: rpc.RRef[Any], consumers: List[_RecordConsumer], grad_enabled: bool
) -> Tuple[rpc.RRef[Any], _RecordKey]:
    """Runs on the handler's worker: a record that exists when the caller gets its RRef (which keeps it alive) and
    its key (which feeds address)."""
    record = handler.local_value().make_pipeline_record(consumers, grad_enabled)
    key = next(_RECORD_KEYS)
    _RECORDS[key] = record
    return rpc.RRef(record), _RecordKey(rpc.get_worker_info().name, key)


@_async_execution
def _result_rref(handler: rpc.RRef[Any], record: rpc.RRef[Any]) -> "Future[rpc.RRef[Any]]":
    """Runs on the last partition's worker: a future, resolved with the last micro-batch, of an RRef holding the
    model output (or the exception that ``to_here()`` will raise)."""
    return handler.local_value().run_pipeline(record).then(lambda fut: rpc.RRef(fut.value()))


def _split_inputs(inputs: Tuple[Tensor, ...], chunks: int) -> List[Tuple[Tensor, ...]]:
    """Micro-batches of every input along dim 0 (``chunks`` of each)."""
    pieces = [t.chunk(chunks) for t in inputs]
    return list(zip(*pieces))
