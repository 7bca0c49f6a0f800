# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The event loop of one :class:`~fairscale.nn.pipe.AsyncPipe` stage.

Each stage runs its partition on every micro-batch as activations arrive and sends the result on; the head
keeps only a scalar stand-in per micro-batch whose backward pushes the gradients that come back later. Gradients
travel back as messages: the tail's receive operator sends them when the user runs backward, each middle stage
back-propagates them through its partition and sends the input gradients on, down to the head.

This module holds the event loop (:class:`AsyncEventLoop`) and the tasks it runs (:func:`create_task`). Where the
partitions run and the messages between stages are :mod:`.async_messages`, the last stage's backward
:mod:`.async_tail`. This module re-exports their names, and their public classes keep it as their qualified home,
so imports and pickles are unchanged.
"""

from threading import Event
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from fairscale.internal.errors import FairscaleTypeError
from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_ranks as get_pipeline_parallel_ranks

from .async_messages import (
    Activations,
    AsyncMessageBody,
    AsyncMessageType,
    AsyncRecvOperator,
    AutogradWithoutActivations,
    Invocation,
    Invocations,
    Location,
    ModuleWrapper,
    PipelineAbortedError,
    StagesDisagreeError,
    StepDisagreement,
    TailBackwardContext,
)
from .async_tail import _abandon_unfinished_tails as _abandon_unfinished_tails
from .async_tail import _TailBackward as _TailBackward
from .checkpoint import Checkpointing
from .messages import Transport
from .microbatch import Batch
from .skip.tracker import SkipTrackerThroughPotals, use_skip_tracker
from .types import EVENT_LOOP_QUEUE, PipeMessage, TensorOrTensors
from .worker import Task

__all__ = [
    "create_task",
    "Location",
    "Invocation",
    "ModuleWrapper",
    "AsyncMessageType",
    "AsyncMessageBody",
    "TailBackwardContext",
    "AutogradWithoutActivations",
    "AsyncRecvOperator",
    "AsyncEventLoop",
    "PipelineAbortedError",
    "StagesDisagreeError",
    "StepDisagreement",
]

# How long a stage that stops with an error waits for its abort messages to reach the stages waiting for it. They
# are receiving, so this is quick; the bound only keeps a peer that went elsewhere from holding the error back.
_ABORT_FLUSH_TIMEOUT_S = 10.0


def create_task(
    checkpoint_stop: int,
    chunk_id: int,
    part_id: int,
    batch: Batch,
    partition: nn.Sequential,
    skip_trackers: List[SkipTrackerThroughPotals],
) -> Task:
    """A task running ``partition`` on ``batch`` (checkpointed when ``chunk_id < checkpoint_stop``); no stream."""

    def function(input: TensorOrTensors) -> TensorOrTensors:
        with use_skip_tracker(skip_trackers[chunk_id]), record_function(f"chunk{chunk_id}-part{part_id}"):
            output = partition(input)
        if not isinstance(output, (Tensor, tuple)):
            raise FairscaleTypeError(
                f"Only Tensor or Tuple of Tensor output is supported: the partition of stage {part_id} returned a "
                f"{type(output).__name__} for micro-batch {chunk_id}"
            )
        return output

    if chunk_id < checkpoint_stop:
        chk = Checkpointing(function, batch, partition)
        return Task(None, compute=chk.checkpoint, finalize=chk.recompute)

    def compute() -> Batch:
        return batch.call(function)

    return Task(None, compute=compute, finalize=None)


class AsyncEventLoop:
    """Runs one stage's share of the pipeline (head, middle or tail) for one mini-batch.

    Args:
        partitions (List[ModuleWrapper]): this stage's partitions (one without layer reuse).
        group: the pipeline process group; stage ``s`` is its rank ``s``.
        transport (Transport): how messages travel.
        training (bool): whether gradients will come back, so that the stages wait for them (training mode with
            autograd enabled). Otherwise received activations are not connected to the stage that sent them.
        checkpoint_stop (int): micro-batches below this index are checkpointed.
    """

    def __init__(
        self, partitions: List[ModuleWrapper], group: Any, transport: Transport, training: bool, checkpoint_stop: int
    ) -> None:
        self.training = training
        self.checkpoint_stop = checkpoint_stop
        self.transport = transport
        self.group = group
        self.partitions = partitions
        self.ranks: List[int] = _group_ranks(group)
        self.rank: int = group.rank()
        # This stage's invocations by order, and what each produced per micro-batch: the stand-ins of the
        # activations sent on (their backward needs the gradients that come back), or the tail's outputs.
        self.invocations, self.activations = self.get_invocations_and_activations()
        # Stages that take part (ranks past the balance hold none); set by the pipeline.
        self.num_stages: int = len(self.ranks)
        # This mini-batch's number among the pipeline's steps (set by the pipeline; ``None``: not checked). With
        # ``training`` and ``num_microbatch`` it describes the step in every message header (see check_header).
        self.step: Optional[int] = None
        # Message counts of this mini-batch, for a clean stop when a stage fails (see fail_over).
        self.num_microbatch = 0
        self.activations_received = 0
        self.activations_sent = 0
        self.gradients_received = 0
        self.gradients_sent = 0
        # The last stage in training: the backward of the outputs of this mini-batch (set by event_loop_tail).
        self.tail_backward: Optional[_TailBackward] = None

    @property
    def invocation(self) -> Invocation:
        return self.partitions[0].invocations[0]

    def get_invocations_and_activations(self) -> Tuple[Invocations, Activations]:
        """This stage's invocations by order, and an empty activation store.

        Returns:
            ``(invocations, activations)``: ``invocations[order]`` is the invocation of that order;
            ``activations[partition index][order]`` maps micro-batch indices to what the invocation produced.
        """
        invocations: Invocations = {}
        activations: Activations = {}
        for index, partition in enumerate(self.partitions):
            activations[index] = {}
            for invocation in partition.invocations:
                activations[index][invocation.order] = {}
                invocations[invocation.order] = invocation
        return invocations, activations

    def run_invocation(
        self,
        batch: Batch,
        partition: ModuleWrapper,
        skip_trackers: List[SkipTrackerThroughPotals],
        invocation: Invocation,
    ) -> Batch:
        """Run ``partition`` on ``batch``; an output bound for another stage is sent there.

        Returns:
            The output, or its scalar stand-in when it was sent to another stage.
        """
        task = create_task(self.checkpoint_stop, batch.index, self.rank, batch, partition.module, skip_trackers)
        result = task.compute()
        task.finalize(result)
        dest = invocation.dest
        if dest is not None and dest.stage != invocation.this.stage:
            return self.send_async_message(self.ranks[dest.stage], result, invocation)
        return result

    def run_invocations_on_batch(
        self,
        batch: Batch,
        invocations: Invocations,
        order: int,
        skip_trackers: List[SkipTrackerThroughPotals],
        activations: Activations,
    ) -> Tuple[int, int]:
        """Run the invocation ``order`` on ``batch``, then the following ones while the output stays on this stage.

        What each invocation produced is kept in ``activations[partition index][order][micro-batch index]``.

        Returns:
            ``(number of invocations run, order of the last one)``.
        """
        count = 0
        while True:
            invocation = invocations[order]
            index = invocation.this.index
            batch = self.run_invocation(batch, self.partitions[index], skip_trackers, invocation)
            activations[index][order][batch.index] = batch
            count += 1
            dest = invocation.dest
            if dest is None or dest.stage != invocation.this.stage or order + 1 not in invocations:
                return count, order
            order += 1

    def send_async_message(self, dst_rank: int, result: Batch, invocation: Invocation) -> Batch:
        """Send ``result`` to global rank ``dst_rank``; return its stand-in (kept for the backward)."""
        assert invocation.dest is not None
        body = AsyncMessageBody(
            AsyncMessageType.Activations,
            result.index,
            invocation.this,
            invocation.dest,
            invocation.order + 1,
            step=self.step,
            training=self.training,
            num_microbatches=self.num_microbatch,
        )
        message = PipeMessage(
            self.ranks[self.rank], dst_rank, queue_name=EVENT_LOOP_QUEUE, args=body, tensors=tuple(result)
        )
        self.transport.send_message(message, sync=True)
        self.activations_sent += 1
        stand_in = AutogradWithoutActivations.apply(*result)
        return Batch(stand_in, result.index)

    def get_batch_from_message(self, message: PipeMessage) -> Batch:
        """The activations of ``message`` as a batch (in training through :class:`AsyncRecvOperator`, whose
        backward sends their gradients back)."""
        if not self.training:
            # Nobody waits for gradients: a backward (in eval mode, say) stays on this stage.
            result = self.transport.recv_message_tensors(message).tensors
        else:
            phony = torch.empty(0, requires_grad=True)
            result = AsyncRecvOperator.apply(phony, self.transport, message, EVENT_LOOP_QUEUE, self)
        if len(result) == 1:
            return Batch(result[0], message.args.microbatch_index)
        return Batch(tuple(result), message.args.microbatch_index)

    @staticmethod
    def perform_backward_for_invocation(
        transport: Transport, message: PipeMessage, activations: Activations, invocation: Invocation
    ) -> None:
        """Back-propagate the gradients of ``message`` through the stand-in ``invocation`` left for its micro-batch."""
        tensors = transport.recv_message_tensors(message).tensors
        stand_in = activations[invocation.this.index][invocation.order].pop(message.args.microbatch_index)
        grad_fn: Any = stand_in.tensor.grad_fn
        if grad_fn is None:
            return  # nothing of this stage requires grad
        grad_fn.grad_from_pipeline = tensors
        stand_in.tensor.backward(retain_graph=True)

    def process_batch_backward(self, message: PipeMessage) -> None:
        """Back-propagate the gradients of ``message`` through the stand-in of its invocation and micro-batch.

        When the backward reaches this stage's :class:`AsyncRecvOperator`, it sends the gradients on (and counts
        them in :attr:`gradients_sent`).
        """
        invocation = self.invocations[message.args.order]
        self.perform_backward_for_invocation(self.transport, message, self.activations, invocation)

    @staticmethod
    def prepare_tail_backward(
        batch: Batch,
        activations: Activations,
        invocations: Invocations,
        count_per_order: Dict[int, int],
        expected_gradients: int,
    ) -> None:
        """Prepare the final stage for gradients it gets back after the user's backward of ``batch``.

        Only a stage that also runs before later stages (layer reuse) gets such gradients; without layer reuse
        (:func:`~fairscale.nn.pipe.async_pipe.verify_module` rejects a layer used twice) there is nothing to do.
        """
        if expected_gradients > 0:
            raise NotImplementedError(
                f"the final stage would wait for {expected_gradients} gradient(s) after the output's backward: "
                "layer reuse across stages is not supported by AsyncPipe (use each layer object once)"
            )

    def recv_header(self) -> PipeMessage:
        """The next event-loop message.

        Raises:
            PipelineAbortedError: another stage failed.
            StagesDisagreeError: the message describes a step that does not match this stage's (see
                :meth:`check_header`), or another stage found such a message.
        """
        message = self.transport.recv_message_header(EVENT_LOOP_QUEUE)
        kind = message.args.message_type
        if kind is AsyncMessageType.Abort:
            origin = message.args.source.stage
            disagreement = message.args.disagreement
            # Pass the stop on, in the direction it travels, behind the messages already sent that way.
            from_previous = self.ranks.index(message.src) < self.rank
            self._send_aborts(origin, forward=from_previous, backward=not from_previous, disagreement=disagreement)
            if disagreement is not None:
                raise StagesDisagreeError(disagreement.message())
            raise PipelineAbortedError(
                f"pipeline stage {origin} failed; stage {self.rank} stopped waiting for it (see that rank's error)"
            )
        if kind is AsyncMessageType.Activations:
            self.activations_received += 1
        else:
            self.gradients_received += 1
        self.check_header(message)
        return message

    def check_header(self, message: PipeMessage) -> None:
        """Raise :class:`StagesDisagreeError` unless ``message`` (activations or gradients) describes this step.

        The stages of a step must agree on its number, its mode (whether gradients come back) and its number of
        micro-batches, or they wait for messages that never come, or use those of another step. Only the first step
        is checked with a collective; the later ones are checked here, on the headers that travel anyway (no extra
        collective or message per step). The first message from a neighbour in a step is the one that differs: every
        header of a stage's step describes it alike.

        Before raising, the stage receives the rest of what the previous stage sends in its step (its sender thread
        would block on them) and stops, with the same error, the stages that wait for this one: the next stage (it
        waits for activations this stage never sent) and the previous one when it waits for gradients (as the
        header of its activations says). An earlier stage that waits for nothing (eval mode) returns normally from
        its step.

        Args:
            message (PipeMessage): a received activations or gradients message, whose tensors were not received.

        Raises:
            StagesDisagreeError: the header's step, mode or number of micro-batches is not this stage's.
        """
        header: AsyncMessageBody = message.args
        expected = {"step": self.step, "training": self.training, "num_microbatches": self.num_microbatch}
        differences = tuple(
            (field, getattr(header, field), mine)
            for field, mine in expected.items()
            if mine is not None and getattr(header, field) is not None and getattr(header, field) != mine
        )
        if not differences:
            return
        sender = self.ranks.index(message.src)
        disagreement = StepDisagreement(sender, self.rank, (message.src, self.ranks[self.rank]), differences)
        try:
            self.transport.recv_message_tensors(message)
        except Exception:  # noqa: B902 - best effort: the disagreement is the error to report
            pass
        if header.message_type is AsyncMessageType.Activations:
            # The previous stage sends all the micro-batches of its own step, then waits for their gradients if it
            # trains (whatever this stage does). Found at its first message: this stage has sent nothing yet.
            total, previous_trains = header.num_microbatches, bool(header.training)
        else:
            # Gradients of another step (not seen unless a step went wrong before): this stage's own counts apply
            # (the first stage receives no activations).
            total, previous_trains = (self.num_microbatch if self.rank > 0 else 0), self.training
        previous_stopped = self._drain_activations(total)
        self._send_aborts(
            self.rank,
            forward=True,
            backward=True,
            disagreement=disagreement,
            previous_waits=previous_trains and not previous_stopped,
        )
        raise StagesDisagreeError(disagreement.message())

    def _drain_activations(self, total: Optional[int]) -> bool:
        """Receive (and drop) the previous stage's activations of its step, up to ``total`` in all (other messages
        that come meanwhile are dropped too).

        Returns:
            bool: whether the previous stage sent an abort instead (it stopped: it waits for nothing any more).
        """
        remaining = (total if total is not None else self.num_microbatch) - self.activations_received
        try:
            while remaining > 0:
                message = self.transport.recv_message_header(EVENT_LOOP_QUEUE)
                if message.args.message_type is AsyncMessageType.Abort:
                    return self.ranks.index(message.src) < self.rank
                self.transport.recv_message_tensors(message)
                if message.args.message_type is AsyncMessageType.Activations:
                    self.activations_received += 1
                    remaining -= 1
        except Exception:  # noqa: B902 - best effort: the disagreement is the error to report
            pass
        return False

    def fail_over(self) -> None:
        """After this stage failed: let no peer wait for it forever, and leave no send blocked.

        First receive (and drop) what the neighbours will send anyway: the remaining activations and, once the
        backward phase started, the remaining gradients. Then send an abort message to each neighbour still
        waiting for this stage; each passes it on to the next one in the same direction, after its own messages,
        so every send of the pipeline is received before the stages stop.
        """
        m = self.num_microbatch
        final = self.rank == self.num_stages - 1
        expected_activations = m if self.rank > 0 else 0
        backward_phase = self.training and not final and self.activations_sent >= m
        expected_gradients = m if backward_phase else 0
        try:
            while self.activations_received < expected_activations or self.gradients_received < expected_gradients:
                message = self.transport.recv_message_header(EVENT_LOOP_QUEUE)
                if message.args.message_type is AsyncMessageType.Abort:
                    break
                self.transport.recv_message_tensors(message)
                if message.args.message_type is AsyncMessageType.Activations:
                    self.activations_received += 1
                else:
                    self.gradients_received += 1
        except Exception:  # noqa: B902 - best effort: the original error matters more
            pass
        self._send_aborts(self.rank, forward=True, backward=True)

    def _send_aborts(
        self,
        origin: int,
        *,
        forward: bool,
        backward: bool,
        disagreement: Optional[StepDisagreement] = None,
        previous_waits: Optional[bool] = None,
    ) -> None:
        """Send an abort (of stage ``origin``; with ``disagreement`` when that is why) to the neighbours that wait.

        ``previous_waits`` says whether the previous stage waits for gradients (``None``: when this one trains).
        """
        m = self.num_microbatch
        targets = []
        # The next stage waits for activations until it got all of them.
        if forward and self.rank < self.num_stages - 1 and self.activations_sent < m:
            targets.append(self.rank + 1)
        # In training, the previous stage waits for gradients until it got all of them.
        if previous_waits is None:
            previous_waits = self.training
        if backward and previous_waits and self.rank > 0 and self.gradients_sent < m:
            targets.append(self.rank - 1)
        for stage in targets:
            body = AsyncMessageBody(
                AsyncMessageType.Abort, -1, Location(origin, 0), Location(stage, 0), -1, disagreement=disagreement
            )
            message = PipeMessage(self.ranks[self.rank], self.ranks[stage], queue_name=EVENT_LOOP_QUEUE, args=body)
            try:
                self.transport.send_message(message, sync=False)
            except Exception:  # noqa: B902 - best effort: the original error matters more
                pass
        # The error that follows may end the process, and with it the sender thread: let the aborts (and the
        # messages before them) reach the stages that wait for them first.
        try:
            self.transport.flush(_ABORT_FLUSH_TIMEOUT_S)
        except Exception:  # noqa: B902 - a failed send: the original error matters more
            pass

    def abort_after_backward_failure(self) -> None:
        """The last stage's backward failed (outside the event loop): stop the stages still waiting for gradients.

        Nothing is left to receive first: the last stage got every activation in its forward.
        """
        self._send_aborts(self.rank, forward=False, backward=True)

    def event_loop_inner(
        self,
        expected_invocations: int,
        skip_trackers: List[SkipTrackerThroughPotals],
        activations: Activations,
        invocations: Invocations,
        count_per_order: Dict[int, int],
        *,
        already_received: int = 0,
        ignore_gradients: bool = False,
        event: Optional[Event] = None,
        tail: bool = False,
    ) -> int:
        """Receive and run event-loop messages until this stage's share of the mini-batch is done.

        Args:
            expected_invocations (int): activation messages to run (counting ``already_received``); in training
                as many gradient messages are back-propagated, unless ``ignore_gradients`` or ``tail``.
            skip_trackers: one skip tracker per micro-batch.
            activations (Activations): where outputs and stand-ins are kept (see
                :meth:`get_invocations_and_activations`).
            invocations (Invocations): this stage's invocations by order.
            count_per_order (Dict[int, int]): runs per invocation order, updated here.
            already_received (int): activation messages already run (the head computes its inputs itself).
            ignore_gradients (bool): do not wait for gradients.
            event (Optional[Event]): waited for before the first gradient is received.
            tail (bool): this stage produces the output: it gets activations only.

        Returns:
            The number of activation messages run, ``already_received`` included.
        """
        num_activations = already_received
        num_gradients = 0
        expected_gradients = 0 if ignore_gradients or tail or not self.training else expected_invocations
        while num_activations < expected_invocations or num_gradients < expected_gradients:
            if event is not None and num_activations >= expected_invocations:
                event.wait()
                event = None
            message = self.recv_header()
            if message.args.message_type is AsyncMessageType.Activations:
                if num_activations >= expected_invocations:
                    raise RuntimeError(f"stage {self.rank} expected gradients, got {message.args}")
                batch = self.get_batch_from_message(message)
                first = message.args.order
                _, last = self.run_invocations_on_batch(batch, invocations, first, skip_trackers, activations)
                for order in range(first, last + 1):
                    count_per_order[order] = count_per_order.get(order, 0) + 1
                if tail:
                    index = invocations[last].this.index
                    output = activations[index][last][batch.index]
                    self.prepare_tail_backward(output, activations, invocations, count_per_order, 0)
                num_activations += 1
            else:
                if tail or num_gradients >= expected_gradients:
                    raise RuntimeError(f"stage {self.rank} expected activations, got {message.args}")
                self.process_batch_backward(message)
                num_gradients += 1
        return num_activations

    def event_loop_head(
        self, batches: List[Batch], skip_trackers: List[SkipTrackerThroughPotals], event: Optional[Event]
    ) -> None:
        """The first stage: compute and send every micro-batch, then (training) process the gradients."""
        self.num_microbatch = len(batches)
        order = self.invocation.order
        for batch in batches:
            self.run_invocations_on_batch(batch, self.invocations, order, skip_trackers, self.activations)
        if self.training:
            count_per_order = {order: len(batches)}
            self.event_loop_inner(
                len(batches),
                skip_trackers,
                self.activations,
                self.invocations,
                count_per_order,
                already_received=len(batches),
                event=event,
            )

    def event_loop_tail(self, batches: List[Batch], skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """The last stage: compute every micro-batch as it arrives; results are written into ``batches``.

        In training, the outputs' backward (in the user's ``backward`` call) sends the gradients to the previous
        stage, through :class:`_TailBackward`.
        """
        self.num_microbatch = len(batches)
        invocation = self.invocation
        if self.rank == 0:
            # A single stage computes locally.
            for batch in batches:
                self.run_invocations_on_batch(
                    batch, self.invocations, invocation.order, skip_trackers, self.activations
                )
        else:
            self.event_loop_inner(len(batches), skip_trackers, self.activations, self.invocations, {}, tail=True)
        outputs = dict(self.activations[invocation.this.index][invocation.order])
        # Handed to the caller: no gradient message ever comes back for them (the pop that frees a middle stage's),
        # and kept here they made a cycle through the autograd graph (its receive nodes hold this loop) that the
        # garbage collector cannot see: every step's outputs stayed alive (a leak fuzz, session 49).
        for per_order in self.activations.values():
            for per_batch in per_order.values():
                per_batch.clear()
        if not self.training or self.rank == 0:
            for index, output in outputs.items():
                batches[index] = output
            return
        for index, output in outputs.items():
            if not any(t.requires_grad for t in output):
                raise RuntimeError(
                    f"the last AsyncPipe stage's output of micro-batch {index} does not require grad, so no backward "
                    "can send gradients to the earlier stages, which wait for them in training mode. Run inference "
                    "in eval mode or under torch.no_grad() on every stage"
                )
        self.tail_backward = _TailBackward(self, len(outputs))
        for index, output in outputs.items():
            batches[index] = self.tail_backward.wrap(output)

    def event_loop(self, num_microbatch: int, skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """A middle stage: forward activations and (training) gradients until all micro-batches went through."""
        self.num_microbatch = num_microbatch
        self.event_loop_inner(num_microbatch, skip_trackers, self.activations, self.invocations, {})


def _group_ranks(group: Any) -> List[int]:
    """Global ranks of the group, in group-rank (stage) order."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return list(dist.get_process_group_ranks(group))
    return list(range(group.size()))
