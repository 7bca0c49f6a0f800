# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The event loop of one :class:`~fairscale.nn.pipe.AsyncPipe` stage.

Each stage runs its partition on every micro-batch as activations arrive and sends the result on; the head
keeps only a scalar stand-in per micro-batch whose backward pushes the gradients that come back later. Gradients
travel back as messages: the tail's receive operator sends them when the user runs backward, each middle stage
back-propagates them through its partition and sends the input gradients on, down to the head.
"""

from dataclasses import dataclass
from enum import Enum, auto
from threading import Event
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from .checkpoint import Checkpointing
from .messages import Transport
from .microbatch import Batch
from .skip.tracker import SkipTrackerThroughPotals, use_skip_tracker
from .types import EVENT_LOOP_QUEUE, PipeMessage, TensorOrTensors, Tensors
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
]


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
        assert isinstance(output, (Tensor, tuple)), "Only Tensor or Tuple of Tensor output is supported"
        return output

    if chunk_id < checkpoint_stop:
        chk = Checkpointing(function, batch)
        return Task(None, compute=chk.checkpoint, finalize=chk.recompute)

    def compute() -> Batch:
        return batch.call(function)

    return Task(None, compute=compute, finalize=None)


@dataclass(frozen=True)
class Location:
    """Where a module runs: ``stage`` (pipeline rank) and ``index`` (position among the stage's partitions)."""

    stage: int
    index: int

    def __repr__(self) -> str:
        return f"{self.stage}@{self.index}"


@dataclass(frozen=True)
class Invocation:
    """One run of a partition: its global ``order``, where it runs, and where its input/output come from/go."""

    order: int
    this: Location
    source: Optional[Location]
    dest: Optional[Location]


Activations = Dict[int, Dict[int, Dict[int, Batch]]]
Invocations = Dict[int, Invocation]


@dataclass(frozen=True)
class TailBackwardContext:
    activations: Activations
    invocations: Invocations
    count_per_order: Dict[int, int]
    expected_gradients: int


class ModuleWrapper:
    """The partition of one stage with its location and invocations."""

    def __init__(self, module: nn.Sequential, location: Location, invocations: Optional[List[Invocation]] = None):
        self.module: nn.Sequential = module
        self.location = location
        self.invocations: List[Invocation] = invocations or []

    def __repr__(self) -> str:
        return f"{self.location}:\n" + "\n".join(map(str, self.invocations)) + "\n\t" + str(self.module)

    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self) -> Iterable[nn.Module]:
        yield from self.module


class AsyncMessageType(Enum):
    Activations = auto()
    Gradients = auto()
    #: (fork addition) A stage failed: the receivers stop with :class:`PipelineAbortedError` instead of waiting.
    Abort = auto()


class PipelineAbortedError(RuntimeError):
    """Another stage of the pipeline failed; this stage stopped waiting for it."""


@dataclass(frozen=True)
class AsyncMessageBody:
    message_type: AsyncMessageType
    microbatch_index: int
    source: Location
    dest: Location
    order: int


class AutogradWithoutActivations(torch.autograd.Function):
    """A scalar stand-in for activations sent to the next stage.

    Its backward returns the gradients that came back from that stage, set on its ``grad_fn`` as
    ``grad_from_pipeline`` just before ``backward`` is called on it.
    """

    @staticmethod
    def forward(ctx: Any, *args: Tensor) -> Tensor:
        ctx.devices = [t.device for t in args]
        return torch.tensor(1.0)

    @staticmethod
    def backward(ctx: Any, *grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        assert ctx.grad_from_pipeline is not None
        # Gradients arrive where the transport put them (the CPU for send/recv): back to each activation's device.
        return tuple(
            g.to(device) if needed else None
            for g, device, needed in zip(ctx.grad_from_pipeline, ctx.devices, ctx.needs_input_grad)
        )


class AsyncRecvOperator(torch.autograd.Function):
    """Receives the tensors of an activation message; its backward sends their gradients back to the sender."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, transport: Transport, message: PipeMessage, queue_name: int) -> Tensors:
        ctx.transport = transport
        ctx.index = message.args.microbatch_index
        ctx.queue_name = queue_name
        ctx.args = message.args
        ctx.src = message.src
        ctx.dest = message.dest
        result = transport.recv_message_tensors(message).tensors
        ctx.meta = [(t.shape, t.dtype, t.device) for t in result]
        non_float = [t for t in result if not t.is_floating_point()]
        if non_float:
            ctx.mark_non_differentiable(*non_float)
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grad: Optional[Tensor]) -> Tuple[None, None, None, None]:
        # Every received tensor gets a gradient slot on the wire; non-differentiable ones send zeros.
        grads = tuple(
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grad, ctx.meta)
        )
        body = AsyncMessageBody(
            AsyncMessageType.Gradients, ctx.index, source=ctx.args.dest, dest=ctx.args.source, order=ctx.args.order - 1
        )
        ctx.transport.send_message(
            PipeMessage(ctx.dest, ctx.src, queue_name=ctx.queue_name, args=body, tensors=grads), sync=True
        )
        return (None, None, None, None)


class AsyncEventLoop:
    """Runs one stage's share of the pipeline (head, middle or tail) for one mini-batch.

    Args:
        partitions (List[ModuleWrapper]): this stage's partitions (one without layer reuse).
        group: the pipeline process group; stage ``s`` is its rank ``s``.
        transport (Transport): how messages travel.
        training (bool): whether gradients will come back (the stages then wait for them).
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
        # Stand-ins of the activations this stage sent, by micro-batch: their backward needs the gradients.
        self.stand_ins: Dict[int, Batch] = {}
        # Stages that take part (ranks past the balance hold none); set by the pipeline.
        self.num_stages: int = len(self.ranks)
        # Message counts of this mini-batch, for a clean stop when a stage fails (see fail_over).
        self.num_microbatch = 0
        self.activations_received = 0
        self.activations_sent = 0
        self.gradients_received = 0
        self.gradients_sent = 0

    @property
    def invocation(self) -> Invocation:
        return self.partitions[0].invocations[0]

    def _run(self, batch: Batch, skip_trackers: List[SkipTrackerThroughPotals]) -> Batch:
        task = create_task(
            self.checkpoint_stop, batch.index, self.rank, batch, self.partitions[0].module, skip_trackers
        )
        result = task.compute()
        task.finalize(result)
        return result

    def send_async_message(self, dst_rank: int, result: Batch, invocation: Invocation) -> Batch:
        """Send ``result`` to global rank ``dst_rank``; return its stand-in (kept for the backward)."""
        assert invocation.dest is not None
        body = AsyncMessageBody(
            AsyncMessageType.Activations, result.index, invocation.this, invocation.dest, invocation.order + 1
        )
        message = PipeMessage(
            self.ranks[self.rank], dst_rank, queue_name=EVENT_LOOP_QUEUE, args=body, tensors=tuple(result)
        )
        self.transport.send_message(message, sync=True)
        self.activations_sent += 1
        stand_in = AutogradWithoutActivations.apply(*result)
        return Batch(stand_in, result.index)

    def get_batch_from_message(self, message: PipeMessage) -> Batch:
        """The activations of ``message`` (received through :class:`AsyncRecvOperator`) as a batch."""
        phony = torch.empty(0, requires_grad=True)
        result = AsyncRecvOperator.apply(phony, self.transport, message, EVENT_LOOP_QUEUE)
        if len(result) == 1:
            return Batch(result[0], message.args.microbatch_index)
        return Batch(tuple(result), message.args.microbatch_index)

    def process_batch_backward(self, message: PipeMessage) -> None:
        """Back-propagate the gradients of ``message`` through the stand-in of its micro-batch."""
        tensors = self.transport.recv_message_tensors(message).tensors
        stand_in = self.stand_ins.pop(message.args.microbatch_index)
        grad_fn: Any = stand_in.tensor.grad_fn
        if grad_fn is None:
            return  # nothing of this stage requires grad
        grad_fn.grad_from_pipeline = tensors
        stand_in.tensor.backward(retain_graph=True)
        if self.rank > 0:
            self.gradients_sent += 1  # the backward reached this stage's receive operator, which sent them on

    def recv_header(self) -> PipeMessage:
        """The next event-loop message; raises :class:`PipelineAbortedError` when another stage failed."""
        message = self.transport.recv_message_header(EVENT_LOOP_QUEUE)
        kind = message.args.message_type
        if kind is AsyncMessageType.Abort:
            origin = message.args.source.stage
            # Pass the stop on, in the direction it travels, behind the messages already sent that way.
            from_previous = self.ranks.index(message.src) < self.rank
            self._send_aborts(origin, forward=from_previous, backward=not from_previous)
            raise PipelineAbortedError(
                f"pipeline stage {origin} failed; stage {self.rank} stopped waiting for it (see that rank's error)"
            )
        if kind is AsyncMessageType.Activations:
            self.activations_received += 1
        else:
            self.gradients_received += 1
        return message

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

    def _send_aborts(self, origin: int, *, forward: bool, backward: bool) -> None:
        m = self.num_microbatch
        targets = []
        # The next stage waits for activations until it got all of them.
        if forward and self.rank < self.num_stages - 1 and self.activations_sent < m:
            targets.append(self.rank + 1)
        # In training, the previous stage waits for gradients until it got all of them.
        if backward and self.training and self.rank > 0 and self.gradients_sent < m:
            targets.append(self.rank - 1)
        for stage in targets:
            body = AsyncMessageBody(AsyncMessageType.Abort, -1, Location(origin, 0), Location(stage, 0), -1)
            message = PipeMessage(self.ranks[self.rank], self.ranks[stage], queue_name=EVENT_LOOP_QUEUE, args=body)
            try:
                self.transport.send_message(message, sync=False)
            except Exception:  # noqa: B902 - best effort: the original error matters more
                pass

    def _forward_and_send(self, batch: Batch, skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        result = self._run(batch, skip_trackers)
        self.stand_ins[batch.index] = self.send_async_message(self.ranks[self.rank + 1], result, self.invocation)

    def _receive_gradients(self, count: int) -> None:
        for _ in range(count):
            message = self.recv_header()
            if message.args.message_type is not AsyncMessageType.Gradients:
                raise RuntimeError(f"stage {self.rank} expected gradients, got {message.args}")
            self.process_batch_backward(message)

    def event_loop_head(
        self, batches: List[Batch], skip_trackers: List[SkipTrackerThroughPotals], event: Optional[Event]
    ) -> None:
        """The first stage: compute and send every micro-batch, then (training) process the gradients."""
        self.num_microbatch = len(batches)
        for batch in batches:
            self._forward_and_send(batch, skip_trackers)
        if self.training:
            if event is not None:
                event.wait()
            self._receive_gradients(len(batches))

    def event_loop_tail(self, batches: List[Batch], skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """The last stage: compute every micro-batch as it arrives; results are written into ``batches``."""
        self.num_microbatch = len(batches)
        if self.rank == 0:
            # A single stage computes locally.
            for i, batch in enumerate(batches):
                batches[i] = self._run(batch, skip_trackers)
            return
        for _ in range(len(batches)):
            message = self.recv_header()
            if message.args.message_type is not AsyncMessageType.Activations:
                raise RuntimeError(f"the final stage expected activations, got {message.args}")
            batch = self.get_batch_from_message(message)
            batches[batch.index] = self._run(batch, skip_trackers)

    def event_loop(self, num_microbatch: int, skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """A middle stage: forward activations and (training) gradients until all micro-batches went through."""
        self.num_microbatch = num_microbatch
        forwarded = 0
        backwarded = 0
        expected_gradients = num_microbatch if self.training else 0
        while forwarded < num_microbatch or backwarded < expected_gradients:
            message = self.recv_header()
            if message.args.message_type is AsyncMessageType.Activations:
                self._forward_and_send(self.get_batch_from_message(message), skip_trackers)
                forwarded += 1
            else:
                self.process_batch_backward(message)
                backwarded += 1


def _group_ranks(group: Any) -> List[int]:
    """Global ranks of the group, in group-rank (stage) order."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return list(dist.get_process_group_ranks(group))
    return list(range(group.size()))
