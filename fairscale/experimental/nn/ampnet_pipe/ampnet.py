# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The AMPnet event loop of :class:`~fairscale.experimental.nn.ampnet_pipe.pipe.AMPnetPipe`.

AMPnet (asynchronous model-parallel training, arXiv 1705.09786) keeps every stage busy across mini-batches: a stage
runs the forward of a new micro-batch while the gradients of an earlier one are still on their way back, and
steps its optimizer as soon as enough gradients went through it, so later micro-batches see updated (and earlier
gradients stale) weights. Every item of the data loader is one micro-batch; ``i`` below is its index in the epoch.

Activations travel on :data:`~fairscale.nn.pipe.types.EVENT_LOOP_ACTIVATIONS_QUEUE` (stage ``s`` to ``s + 1``)
and gradients on :data:`~fairscale.nn.pipe.types.EVENT_LOOP_GRADIENTS_QUEUE` (``s + 1`` to ``s``), so a stage
can wait for either kind without seeing the other. A stage that fails sends an ``Abort`` message to the
neighbours still waiting for it, on the queue each one reads from it; they pass it on and stop.
"""

import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.func import functional_call

from fairscale.nn.pipe.async_schedule import (
    AsyncMessageBody,
    AsyncMessageType,
    AsyncRecvOperator,
    Location,
    ModuleWrapper,
    PipelineAbortedError,
    _group_ranks,
)
from fairscale.nn.pipe.checkpoint import Checkpointing
from fairscale.nn.pipe.messages import Transport
from fairscale.nn.pipe.microbatch import Batch
from fairscale.nn.pipe.types import (
    EVENT_LOOP_ACTIVATIONS_QUEUE,
    EVENT_LOOP_GRADIENTS_QUEUE,
    InputDevice,
    PipeMessage,
    TensorOrTensors,
)
from fairscale.nn.pipe.worker import Task

# Upstream's module also exposes this helper (it imported it); re-exported for old imports.
from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_ranks as get_pipeline_parallel_ranks  # noqa

__all__ = ["AsyncAMPnetEventLoop", "create_task_without_skip_trackers"]


def create_task_without_skip_trackers(
    checkpoint_stop: int, i: int, j: int, batch: Batch, partition: Callable[[TensorOrTensors], Any]
) -> Task:
    """A task running ``partition`` on ``batch`` (micro-batch ``i`` of the epoch, stage ``j``).

    Checkpointed (activations recomputed in backward) when ``i < checkpoint_stop``. As upstream, ``i`` counts over
    the whole epoch, so ``checkpoint="except_last"`` with ``chunks=c`` checkpoints the first ``c - 1``
    micro-batches of the epoch only.
    """

    def function(input: TensorOrTensors) -> TensorOrTensors:
        with record_function(f"chunk{i}-part{j}"):
            output = partition(input)
        if not isinstance(output, (Tensor, tuple)):
            raise TypeError(f"Only Tensor or Tuple of Tensor output is supported, stage {j} returned {type(output)}")
        return output

    if i < checkpoint_stop:
        chk = Checkpointing(function, batch)
        return Task(None, compute=chk.checkpoint, finalize=chk.recompute)

    def compute() -> Batch:
        return batch.call(function)

    return Task(None, compute=compute, finalize=None)


def _next_item(batches: Iterator[Any], index: int, length: int) -> Any:
    """Item ``index`` of a loader whose ``len()`` is ``length``.

    Every stage runs ``len(loader)`` micro-batches, so a loader running out earlier (an ``IterableDataset``'s
    ``__len__`` is an estimate) raises here; ``interleave`` then aborts the other stages, which waited for the
    missing micro-batches before (or, on the head, for an abort answer from a tail that had returned).
    """
    try:
        return next(batches)
    except StopIteration:
        raise ValueError(
            f"lm_dataloader yielded {index} items, but its len() is {length}: every stage runs len(loader) "
            "micro-batches, so the loader must yield exactly len() items"
        ) from None


def _warn_if_more(batches: Iterator[Any], length: int) -> None:
    """Warn when the loader has items past its ``len()``: they were not trained on (one more item is fetched)."""
    if next(batches, _END) is not _END:
        warnings.warn(
            f"lm_dataloader yields more than its len() of {length} items; interleave trained on the first {length} "
            "only (every stage runs len(loader) micro-batches)",
            UserWarning,
        )


_END = object()


class _ParameterAlias(torch.autograd.Function):
    """The values of a parameter under a version counter of their own; gradients pass through unchanged.

    A stage steps its optimizer while the graphs of earlier micro-batches still wait for their gradients. Layers
    save their weights for backward, and an in-place optimizer step would make that backward fail ("modified by
    an inplace operation"). Through an alias the backward reads the current (stepped) values instead: AMPnet's
    stale-gradient semantics, and what an optimizer updating ``param.data`` gives.
    """

    @staticmethod
    def forward(ctx: Any, param: Tensor) -> Tensor:
        return param.data

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _call_with_parameter_aliases(module: nn.Module, input: TensorOrTensors) -> Any:
    aliases = {name: _ParameterAlias.apply(p) for name, p in module.named_parameters()}
    return functional_call(module, aliases, (input,))


class AsyncAMPnetEventLoop:
    """Head, trunk and tail loops of AMPnet training for one stage and one epoch.

    Args:
        partitions (List[ModuleWrapper]): this stage's partition (one per stage).
        group: the pipeline process group; stage ``s`` is its rank ``s``.
        transport (Transport): how messages travel.
        min_update_interval (int): step the optimizer every this many micro-batches through the stage.
        weight_prediction (bool): let the optimizer predict future weights around each forward and backward
            (``optimizer.update_weight_using_future_predictions``) and step every ``chunks`` micro-batches.
        checkpoint_stop (int): micro-batches of the epoch below this index are checkpointed.
        input_device: where received activations are placed.
        chunks (int): the pipe's ``chunks`` (the step interval under weight prediction).
    """

    def __init__(
        self,
        partitions: List[ModuleWrapper],
        group: Any,
        transport: Transport,
        min_update_interval: int,
        weight_prediction: bool,
        checkpoint_stop: int,
        input_device: InputDevice,
        chunks: int,
    ) -> None:
        if min_update_interval < 1:
            raise ValueError(f"min_update_interval must be a positive integer, not {min_update_interval}")
        self.partitions = partitions
        self.group = group
        self.transport = transport
        self.min_update_interval = min_update_interval
        self.weight_prediction = weight_prediction
        self.checkpoint_stop = checkpoint_stop
        self.input_device = input_device
        self.chunks = chunks
        self.ranks: List[int] = _group_ranks(group)
        self.rank: int = group.rank()
        self.num_stages: int = len(self.ranks)
        # Outputs of micro-batches whose gradients have not come back yet, by micro-batch index.
        self.activations: Dict[int, Batch] = {}
        # Message counts, so that a failing stage aborts only the neighbours still waiting for it.
        self.num_microbatch = 0
        self.activations_sent = 0
        self.gradients_sent = 0

    # ------------------------------------------------------------------------------------------ building blocks

    def perform_optimizer_step(self, optimizer: Any, num_gradients: int) -> bool:
        """Whether to step after ``num_gradients`` micro-batches went backward through this stage.

        Mirrors upstream: under weight prediction the ``optimizer is not None`` test is bypassed.
        """
        return (
            optimizer is not None and not self.weight_prediction and num_gradients % self.min_update_interval == 0
        ) or (self.weight_prediction and num_gradients % self.chunks == 0)

    def _maybe_step(self, optimizer: Any, count: int, logger: Any) -> None:
        if self.perform_optimizer_step(optimizer, count):
            optimizer.step()
            optimizer.zero_grad()
            logger.check_and_save_weights(count)

    def _predict(self, optimizer: Any, count: int, forward: bool) -> None:
        if self.weight_prediction:
            optimizer.update_weight_using_future_predictions(
                self.rank, self.num_stages, count, self.chunks, forward=forward
            )

    def _compute(self, batch: Batch) -> Batch:
        run = functools.partial(_call_with_parameter_aliases, self.partitions[0].module)
        task = create_task_without_skip_trackers(self.checkpoint_stop, batch.index, self.rank, batch, run)
        output = task.compute()
        task.finalize(output)
        return output

    def _activation_message(self, output: Batch) -> PipeMessage:
        invocation = self.partitions[0].invocations[0]
        this = Location(self.rank, 0)
        dest = Location(self.rank + 1, 0)
        body = AsyncMessageBody(AsyncMessageType.Activations, output.index, this, dest, invocation.order + 1)
        return PipeMessage(
            self.ranks[self.rank],
            self.ranks[self.rank + 1],
            queue_name=EVENT_LOOP_ACTIVATIONS_QUEUE,
            args=body,
            tensors=tuple(output),
        )

    def _send(self, message: PipeMessage) -> None:
        self.transport.send_message(message, sync=True)
        self.activations_sent += 1

    def _recv(self, queue_name: int, expected: AsyncMessageType) -> PipeMessage:
        message = self.transport.recv_message_header(queue_name)
        kind = message.args.message_type
        if kind is AsyncMessageType.Abort:
            origin = message.args.source.stage
            from_previous = queue_name == EVENT_LOOP_ACTIVATIONS_QUEUE
            # Acknowledge: the sender drains what this stage sent it, up to this message.
            if from_previous:
                self._post_abort(origin, self.rank - 1, EVENT_LOOP_GRADIENTS_QUEUE)
            else:
                self._post_abort(origin, self.rank + 1, EVENT_LOOP_ACTIVATIONS_QUEUE)
            # Pass it on in the direction it travels: activations flow forward, gradients backward.
            self._send_aborts(origin, forward=from_previous, backward=not from_previous)
            raise PipelineAbortedError(
                f"pipeline stage {origin} failed; stage {self.rank} stopped waiting for it (see that rank's error)"
            )
        if kind is not expected:
            raise RuntimeError(f"stage {self.rank} expected {expected.name}, got {message.args}")
        return message

    def get_batch_from_message(self, message: PipeMessage, queue_name: int) -> Batch:
        """The activations of ``message`` (a header read from the activations queue) as a micro-batch whose
        backward sends their gradients to the previous stage on ``queue_name``."""
        phony = torch.empty(0, requires_grad=True)
        result = AsyncRecvOperator.apply(phony, self.transport, message, queue_name)
        index = message.args.microbatch_index
        return Batch(result[0] if len(result) == 1 else tuple(result), index)

    def _recv_activations(self) -> Batch:
        """The next activations from the previous stage, wrapped so that their backward sends the gradients."""
        message = self._recv(EVENT_LOOP_ACTIVATIONS_QUEUE, AsyncMessageType.Activations)
        return self.get_batch_from_message(message, EVENT_LOOP_GRADIENTS_QUEUE)

    def _forward_and_keep(self, batch: Batch, activations: Dict[int, Batch]) -> PipeMessage:
        """Compute ``batch``, keep its outputs in ``activations`` for the backward; return their message."""
        output = self._compute(batch)
        activations[batch.index] = output
        return self._activation_message(output)

    def async_send_inner(self, batch: Batch, index: int) -> PipeMessage:
        """Compute micro-batch ``index`` (``batch``), keep its outputs and send them to the next stage now."""
        if batch.index != index:
            raise ValueError(f"batch.index is {batch.index}, but index {index} was given; they must be equal")
        message = self._forward_and_keep(batch, self.activations)
        self._send(message)
        return message

    def async_grad_inner(self, message: PipeMessage, activations: Dict[int, Batch]) -> None:
        """Back-propagate the gradients of ``message`` (a gradients header) through the outputs of its
        micro-batch, taken out of ``activations``."""
        grads = self.transport.recv_message_tensors(message).tensors
        output = activations.pop(message.args.microbatch_index)
        outputs = list(output)
        if len(outputs) != len(grads):
            raise RuntimeError("different number of tensors and gradients")
        # The receiving stage sends one gradient per tensor; only those of differentiable outputs are used.
        pairs = [(t, g.to(t.device)) for t, g in zip(outputs, grads) if t.requires_grad or t.grad_fn is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], retain_graph=True)
        if self.rank > 0:
            self.gradients_sent += 1  # the backward reached the receive operator, which sent them on

    def event_loop_trunk_backward_helper(self, activations: Dict[int, Batch]) -> None:
        """Receive the next gradients and back-propagate them through their micro-batch's outputs."""
        message = self._recv(EVENT_LOOP_GRADIENTS_QUEUE, AsyncMessageType.Gradients)
        self.async_grad_inner(message, activations)

    def _backward(self, optimizer: Any, count: int) -> None:
        # The weight prediction only touches the weights, so it may come before the gradients are received.
        self._predict(optimizer, count, forward=False)
        self.event_loop_trunk_backward_helper(self.activations)

    def _backward_and_step(self, optimizer: Any, count: int, transform_logger_object: Any) -> int:
        """Back-propagate micro-batch ``count``, then step the optimizer if that completes an update; returns the
        number of micro-batches back-propagated (``count + 1``)."""
        self._backward(optimizer, count)
        self._maybe_step(optimizer, count + 1, transform_logger_object)
        return count + 1

    # ------------------------------------------------------------------------------------------ the three loops

    def event_loop_head_across_minibatches(
        self, lm_dataloader: Any, criterion: Any, optimizer: Any, transform_logger_object: Any
    ) -> None:
        """Stage 0: forward every micro-batch of the loader, back-propagating gradients as they come back."""
        self.num_microbatch = num_microbatch = len(lm_dataloader)
        warm_up = min(self.num_stages - 1, num_microbatch)
        num_gradients = 0
        batches = iter(lm_dataloader)
        for i in range(num_microbatch):
            batch = Batch(transform_logger_object.transform_input(_next_item(batches, i, num_microbatch)), i)
            self._predict(optimizer, i, forward=True)
            if i < warm_up:
                self.async_send_inner(batch, i)
                continue
            message = self._forward_and_keep(batch, self.activations)
            # Steady state: one gradient back for every micro-batch sent, before sending the next.
            num_gradients = self._backward_and_step(optimizer, num_gradients, transform_logger_object)
            self._send(message)
        while num_gradients < num_microbatch:
            num_gradients = self._backward_and_step(optimizer, num_gradients, transform_logger_object)
        _warn_if_more(batches, num_microbatch)

    def event_loop_tail_across_minibatches(
        self, lm_dataloader: Any, criterion: Any, optimizer: Any, transform_logger_object: Any
    ) -> None:
        """The final stage: forward each arriving micro-batch, compute its loss and run its backward at once."""
        self.num_microbatch = num_microbatch = len(lm_dataloader)
        count = 0
        # Exactly len() items, as the head and the trunk run: iterating the loader itself waited for a micro-batch
        # the head never sent when the loader yielded more than its len().
        batches = iter(lm_dataloader)
        for i in range(num_microbatch):
            batch = _next_item(batches, i, num_microbatch)
            target = transform_logger_object.transform_target(batch)
            received = self._recv_activations()
            if received.index != count:
                raise RuntimeError(f"the final stage expected micro-batch {count}, got {received.index}")
            self._predict(optimizer, count, forward=True)
            output = self._compute(received)
            out = transform_logger_object.transform_output_before_loss(output.tensor_or_tensors)
            loss = criterion(out, target)
            self._predict(optimizer, count, forward=False)
            loss.backward()
            self.gradients_sent += 1
            count += 1
            self._maybe_step(optimizer, count, transform_logger_object)
            transform_logger_object.log_loss(batch, loss, count)
        _warn_if_more(batches, num_microbatch)

    def event_loop_trunk_forward_helper(self, activations: Dict[int, Batch]) -> PipeMessage:
        """Receive and compute the next micro-batch, keeping its outputs in ``activations``; return the message
        of its outputs (not sent yet)."""
        return self._forward_and_keep(self._recv_activations(), activations)

    def _trunk_forward(self, optimizer: Any, count: int) -> PipeMessage:
        # The weight prediction only touches the weights, so it may come before the activations are received.
        self._predict(optimizer, count, forward=True)
        return self.event_loop_trunk_forward_helper(self.activations)

    def event_loop_across_minibatches(
        self, lm_dataloader: Any, criterion: Any, optimizer: Any, transform_logger_object: Any
    ) -> None:
        """A middle stage: interleave forwards of new micro-batches with backwards of earlier ones."""
        self.num_microbatch = num_microbatch = len(lm_dataloader)
        warm_up = min(self.num_stages - 1 - self.rank, num_microbatch)
        num_activations = 0
        num_gradients = 0
        while num_activations < warm_up:
            self._send(self._trunk_forward(optimizer, num_activations))
            num_activations += 1
        while num_activations < num_microbatch:
            message = self._trunk_forward(optimizer, num_activations)
            num_activations += 1
            num_gradients = self._backward_and_step(optimizer, num_gradients, transform_logger_object)
            self._send(message)
        while num_gradients < num_microbatch:
            num_gradients = self._backward_and_step(optimizer, num_gradients, transform_logger_object)

    # ------------------------------------------------------------------------------------------ failures

    def fail_over(self) -> None:
        """After this stage failed: tell the neighbours still waiting for it, so that none waits forever."""
        self._send_aborts(self.rank, forward=True, backward=True)

    def _send_aborts(self, origin: int, *, forward: bool, backward: bool) -> None:
        """Abort the neighbours still waiting for this stage, then drain what they sent until their answer.

        A neighbour answers an abort with one of its own on the queue it sends this stage, after its earlier
        messages; receiving up to it leaves no message of this epoch in flight (a later epoch starts clean).
        """
        m = self.num_microbatch
        targets = []
        # The next stage reads activations from this one until it got all of them; it sends gradients back.
        if forward and self.rank < self.num_stages - 1 and self.activations_sent < m:
            targets.append((self.rank + 1, EVENT_LOOP_ACTIVATIONS_QUEUE, EVENT_LOOP_GRADIENTS_QUEUE))
        # The previous stage reads gradients from this one until it got all of them; it sends activations.
        if backward and self.rank > 0 and self.gradients_sent < m:
            targets.append((self.rank - 1, EVENT_LOOP_GRADIENTS_QUEUE, EVENT_LOOP_ACTIVATIONS_QUEUE))
        for stage, queue_name, _ in targets:
            self._post_abort(origin, stage, queue_name)
        for _, _, answer_queue in targets:
            try:
                while True:
                    message = self.transport.recv_message_header(answer_queue)
                    if message.args.message_type is AsyncMessageType.Abort:
                        break
                    self.transport.recv_message_tensors(message)
            except Exception:  # noqa: B902 - best effort: the original error matters more
                pass

    def _post_abort(self, origin: int, stage: int, queue_name: int) -> None:
        body = AsyncMessageBody(AsyncMessageType.Abort, -1, Location(origin, 0), Location(stage, 0), -1)
        message = PipeMessage(self.ranks[self.rank], self.ranks[stage], queue_name=queue_name, args=body)
        try:
            self.transport.send_message(message, sync=False)
        except Exception:  # noqa: B902 - best effort: the original error matters more
            pass
