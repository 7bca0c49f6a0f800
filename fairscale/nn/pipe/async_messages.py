# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where the partitions of an :class:`~fairscale.nn.pipe.AsyncPipe` run, and the messages between its stages.

* :class:`Location` and :class:`Invocation` place each run of a partition (stage, position, order, where its input
  comes from and its output goes); :class:`ModuleWrapper` is a stage's partition with its invocations.
* :class:`AsyncMessageBody` is the header of an event-loop message (:class:`AsyncMessageType`: activations,
  gradients, or the abort that ends waiting stages with :class:`PipelineAbortedError`). It also describes the
  sender's step (:class:`StepDisagreement` and :class:`StagesDisagreeError` when the receiver's does not match).
* :class:`AutogradWithoutActivations` and :class:`AsyncRecvOperator` are the autograd ends of an activation
  message: the sender keeps a scalar stand-in whose backward takes the gradients that come back, the receiver's
  backward sends them.

The event loop that uses them is :mod:`fairscale.nn.pipe.async_schedule`, which re-exports the public ones; their
qualified names stay there (see the end of this module).
"""

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal.agreement import RanksDisagreeError

from .messages import Transport
from .microbatch import Batch
from .types import PipeMessage, Tensors


class _CountsGradients(Protocol):
    """What :class:`AsyncRecvOperator` needs of the event loop it reports to (an ``AsyncEventLoop``)."""

    gradients_sent: int


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


# What the fields of a step's description (see AsyncMessageBody) mean, for the error message.
_STEP_FIELDS = {
    "step": "the step number (calls of forward on this AsyncPipe that ran the pipeline)",
    "training": "whether gradients come back (training mode with autograd on)",
    "num_microbatches": "the number of micro-batches",
}


@dataclass(frozen=True)
class StepDisagreement:
    """What a stage found when a message's header did not describe its own step (carried by the abort it sends).

    ``differences`` holds ``(field, sender's value, receiver's value)`` per differing field of
    :class:`AsyncMessageBody` (``step``, ``training``, ``num_microbatches``); stages are pipeline ranks, ``ranks``
    the global ranks of ``(sender, receiver)``.
    """

    sender: int
    receiver: int
    ranks: Tuple[int, int]
    differences: Tuple[Tuple[str, Any, Any], ...]

    def message(self) -> str:
        """The error message, the same on every stage that raises it."""
        what = "; ".join(
            f"{_STEP_FIELDS.get(field, field)}: {sent!r} on stage {self.sender}, {own!r} on stage {self.receiver}"
            for field, sent, own in self.differences
        )
        return (
            f"AsyncPipe: pipeline stages {self.sender} and {self.receiver} (global ranks {self.ranks[0]} and "
            f"{self.ranks[1]}) run steps that do not match ({what}). A stage waits for as many messages as it has "
            "micro-batches, and for gradients only in training: the stages would wait for each other forever or use "
            "gradients of another step. Call forward on every stage once per step, in the same mode (train()/eval() "
            "and autograd on/off on every rank), with an input that splits into the same number of micro-batches "
            "(same batch size and chunks). Only the first step is checked with a collective; later steps are checked "
            "through the headers of the pipeline's messages, so a stage that waits for no message in that step (an "
            "earlier stage in eval mode) returns normally."
        )


class StagesDisagreeError(RanksDisagreeError):
    """The stages of an :class:`~fairscale.nn.pipe.AsyncPipe` ran a step that does not match (mode, number of
    micro-batches or step number): raised by the stage that received a message of another kind of step, and by
    every stage that waited for it."""


@dataclass(frozen=True)
class AsyncMessageBody:
    """The header of an event-loop message.

    The last fields are fork additions. ``step``, ``training`` and ``num_microbatches`` describe the sender's step
    (its step number, whether gradients come back, its number of micro-batches); the receiver checks them against
    its own before it uses the message (``None``: not described, not checked). Only the first step is checked with
    a collective: a few integers in a header that travels anyway check every later step at no extra message or
    synchronisation. ``disagreement`` (aborts only) tells the stopped stages why.
    """

    message_type: AsyncMessageType
    microbatch_index: int
    source: Location
    dest: Location
    order: int
    step: Optional[int] = None
    training: Optional[bool] = None
    num_microbatches: Optional[int] = None
    disagreement: Optional[StepDisagreement] = None


class AutogradWithoutActivations(torch.autograd.Function):
    """A scalar stand-in for activations sent to the next stage.

    Its backward returns the gradients that came back from that stage, set on its ``grad_fn`` as
    ``grad_from_pipeline`` just before ``backward`` is called on it.
    """

    @staticmethod
    def forward(ctx: Any, *x: Tensor) -> Tensor:
        ctx.devices = [t.device for t in x]
        return torch.tensor(1.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        # ``grad`` (of the scalar stand-in) carries nothing: the real gradients came back from the next stage.
        assert ctx.grad_from_pipeline is not None
        # Gradients arrive where the transport put them (the CPU for send/recv): back to each activation's device.
        return tuple(
            g.to(device) if needed else None
            for g, device, needed in zip(ctx.grad_from_pipeline, ctx.devices, ctx.needs_input_grad)
        )


class AsyncRecvOperator(torch.autograd.Function):
    """Receives the tensors of an activation message; its backward sends their gradients back to the sender.

    ``apply(phony, transport, message, queue_name, event_loop=None)``: when an ``event_loop`` is given, its
    ``gradients_sent`` counts the gradient messages this operator sent (what a failing stage still owes its peers).
    """

    @staticmethod
    def forward(
        ctx: Any,
        phony: Tensor,
        transport: Transport,
        message: PipeMessage,
        queue_name: int,
        event_loop: Optional[_CountsGradients] = None,
    ) -> Tensors:
        ctx.transport = transport
        ctx.event_loop = event_loop
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
    def backward(ctx: Any, *grad: Optional[Tensor]) -> Tuple[None, None, None, None, None]:
        # Every received tensor gets a gradient slot on the wire; non-differentiable ones send zeros.
        grads = tuple(
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grad, ctx.meta)
        )
        # The step described by the activations' header, which this stage checked against its own.
        body = AsyncMessageBody(
            AsyncMessageType.Gradients,
            ctx.index,
            source=ctx.args.dest,
            dest=ctx.args.source,
            order=ctx.args.order - 1,
            step=ctx.args.step,
            training=ctx.args.training,
            num_microbatches=ctx.args.num_microbatches,
        )
        ctx.transport.send_message(
            PipeMessage(ctx.dest, ctx.src, queue_name=ctx.queue_name, args=body, tensors=grads), sync=True
        )
        if ctx.event_loop is not None:
            ctx.event_loop.gradients_sent += 1
        return (None, None, None, None, None)


# The public classes keep fairscale.nn.pipe.async_schedule (which re-exports them) as their qualified home, as before
# this module was split out of it: message headers travel pickled, by qualified name (so do pickled partitions), and
# users, the docs and error reports name them there.
for _cls in (
    Location,
    Invocation,
    TailBackwardContext,
    ModuleWrapper,
    AsyncMessageType,
    PipelineAbortedError,
    StepDisagreement,
    StagesDisagreeError,
    AsyncMessageBody,
    AutogradWithoutActivations,
    AsyncRecvOperator,
):
    _cls.__module__ = "fairscale.nn.pipe.async_schedule"
del _cls
