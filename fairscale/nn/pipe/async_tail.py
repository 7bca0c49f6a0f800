# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The last :class:`~fairscale.nn.pipe.AsyncPipe` stage's share of the backward, run in the user's ``backward``.

:class:`_TailBackward` wraps each output of the last stage (through :class:`_TailOutput`) so that its backward
back-propagates the stage's own graph and sends the gradients to the previous stage, telling the earlier stages to
stop when it fails, or when it never comes (:meth:`_TailBackward.abandon`, also at interpreter exit). The event loop
(:mod:`fairscale.nn.pipe.async_schedule`) creates it for each mini-batch in training.
"""

import atexit
import multiprocessing.util
import os
import warnings
import weakref
from typing import Any, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import Tensor

from .messages import Transport
from .microbatch import Batch
from .types import Tensors


class _TailStage(Protocol):
    """What :class:`_TailBackward` needs of the last stage's event loop (an ``AsyncEventLoop``)."""

    transport: Transport

    def abort_after_backward_failure(self) -> None: ...


class _TailBackward:
    """The last stage's share of the backward of one mini-batch.

    It runs in the user's ``backward`` call, outside the event loop (and its error handler), and it is the last
    thing of the step that sends messages. So each micro-batch's output goes through :class:`_TailOutput`, whose
    backward runs the stage's own backward here: a failure in it (a layer's backward, checkpointing's
    recomputation, a send) first tells the previous stage, which waits for these gradients, then propagates; and the
    backward of the last micro-batch returns only once every gradient was received, so that a script may end right
    after it.

    When the backward does not come at all (the next ``forward`` of the last stage comes first, or the process ends,
    after an error in the loss, say), :meth:`abandon` stops the waiting stages instead.
    """

    def __init__(self, event_loop: _TailStage, num_microbatches: int) -> None:
        self.event_loop = event_loop
        self.num_microbatches = num_microbatches
        self.done: Set[int] = set()
        # The earlier stages were told to stop waiting (a failed backward, or abandon()).
        self.aborted = False
        _unfinished_tails.add(self)
        _hook_process_exit()

    @property
    def finished(self) -> bool:
        """Whether no earlier stage waits for this mini-batch's gradients any more."""
        return self.aborted or len(self.done) == self.num_microbatches

    def abandon(self) -> bool:
        """Stop the earlier stages that still wait for gradients of this mini-batch (which will never come).

        Returns:
            bool: whether some did.
        """
        _unfinished_tails.discard(self)
        if self.finished:
            return False
        self.aborted = True
        self.event_loop.abort_after_backward_failure()
        return True

    def wrap(self, output: Batch) -> Batch:
        """``output`` as the user gets it: the same values, whose backward comes through :meth:`backward`."""
        tensors = tuple(output)
        phony = torch.empty(0, requires_grad=True)
        wrapped = _TailOutput.apply(phony, self, output.index, tensors)
        return Batch(wrapped[0] if output.atomic else tuple(wrapped), output.index)

    def backward(self, index: int, outputs: Tensors, grads: Sequence[Optional[Tensor]]) -> None:
        """Back-propagate ``grads`` through micro-batch ``index``'s outputs, down to the sends to the previous stage."""
        if self.aborted:
            # The earlier stages stopped waiting for these gradients: sending them now would feed a later step.
            raise RuntimeError(
                "backward of an AsyncPipe output whose pipeline step was aborted (its backward failed before, or "
                "the last stage ran forward again first): the earlier stages no longer wait for its gradients"
            )
        if index in self.done:
            raise RuntimeError(
                f"the backward of micro-batch {index} of the last AsyncPipe stage ran twice: its gradients were sent "
                "to the previous stage already (back-propagate a pipeline output once per forward)"
            )
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad and g is not None]
        try:
            if pairs:
                # Autograd is on here only for a backward with create_graph=True: keep the gradients' graph then.
                create_graph = torch.is_grad_enabled()
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], create_graph=create_graph)
        except BaseException:
            self.abandon()
            raise
        self.done.add(index)
        if len(self.done) == self.num_microbatches:
            _unfinished_tails.discard(self)
            self.event_loop.transport.flush()


# Last stages of this process whose outputs still owe gradients to the earlier stages.
_unfinished_tails: "weakref.WeakSet[_TailBackward]" = weakref.WeakSet()


# The process whose multiprocessing exit also runs _abandon_unfinished_tails (see _hook_process_exit).
_exit_hooked_pid = [0]


def _hook_process_exit() -> None:
    """Run :func:`_abandon_unfinished_tails` at the exit of a ``multiprocessing`` child too: a forked child ends with
    ``os._exit``, which skips ``atexit``, and its earlier stages waited for the process-group timeout (found by a
    fuzz). Its exit runs multiprocessing's finalizers, which it clears at start: registered once per process."""
    if _exit_hooked_pid[0] != os.getpid():
        _exit_hooked_pid[0] = os.getpid()
        multiprocessing.util.Finalize(None, _abandon_unfinished_tails, exitpriority=10)


@atexit.register
def _abandon_unfinished_tails() -> None:
    """At interpreter exit: stop the earlier stages that wait for gradients this process will never send.

    A last stage whose script ends (an error in the loss, say) before its outputs' backward would otherwise leave
    them waiting until the process-group timeout (gloo does not notice that a peer is gone).
    """
    import torch.distributed as dist

    for tail in list(_unfinished_tails):
        if not (dist.is_available() and dist.is_initialized()):
            # destroy_process_group() ran first (in a `finally`, as scripts end): nothing can tell the earlier
            # stages any more, and the warning said they were stopped (found by a review, session 47).
            _unfinished_tails.discard(tail)
            warnings.warn(
                "the process ends before the backward of its last AsyncPipe stage's output, after its process group "
                "was destroyed: the earlier stages could not be told and wait until their timeout. Back-propagate "
                "the output, or end the script, before destroy_process_group()"
            )
            continue
        try:
            if tail.abandon():
                warnings.warn(
                    "the process ends before the backward of its last AsyncPipe stage's output: the earlier stages "
                    "were stopped with PipelineAbortedError"
                )
        except Exception:  # noqa: B902 - best effort at exit
            pass


class _TailOutput(torch.autograd.Function):
    """Identity on one micro-batch's outputs of the last stage; its backward is :meth:`_TailBackward.backward`.

    The outputs are passed as a tuple (not as tensor arguments), so the user's backward stops here and the stage's
    own graph is back-propagated by :class:`_TailBackward`, where its failures can be caught.
    """

    @staticmethod
    def forward(ctx: Any, phony: Tensor, tail: _TailBackward, index: int, outputs: Tensors) -> Tensors:
        ctx.tail = tail
        ctx.index = index
        ctx.outputs = outputs
        result = tuple(t.detach() for t in outputs)
        constant = [r for r, t in zip(result, outputs) if not t.requires_grad]
        if constant:
            ctx.mark_non_differentiable(*constant)
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, None, None, None]:
        outputs, ctx.outputs = ctx.outputs, None  # the stage's graph is freed by its backward anyway
        ctx.tail.backward(ctx.index, outputs, grads)
        return (None, None, None, None)
