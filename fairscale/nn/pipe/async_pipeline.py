# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The engine of one :class:`~fairscale.nn.pipe.AsyncPipe` stage: picks the head/middle/tail event loop."""

from threading import Event
from typing import Any, Dict, List, Optional

from .async_schedule import AsyncEventLoop, ModuleWrapper, PipelineAbortedError, StagesDisagreeError, _TailBackward
from .messages import MakeTransport, Transport, use_rpc_by_default
from .microbatch import Batch
from .skip.layout import SkipLayout
from .skip.tracker import SkipTrackerThroughPotals
from .types import InputDevice

__all__ = ["AsyncPipeline"]


class AsyncPipeline:
    """Runs this stage's partition in the multi-process pipeline.

    Args:
        partitions (List[ModuleWrapper]): this stage's partitions.
        skip_layout (SkipLayout): skip routes (empty: skips across stages are not supported).
        checkpoint_stop (int): micro-batches below this index are checkpointed in training.
        group: the pipeline process group.

    Keyword Args:
        worker_map (Optional[Dict[int, str]]): RPC worker names by global rank (RPC transport).
        input_device: where received activations are placed.
        final_stage (bool): whether this stage produces the output.
        num_stages (Optional[int]): the number of stages (default: the group size).
    """

    def __init__(
        self,
        partitions: List[ModuleWrapper],
        skip_layout: SkipLayout,
        checkpoint_stop: int,
        group: Any,
        *,
        worker_map: Optional[Dict[int, str]] = None,
        input_device: InputDevice = None,
        final_stage: bool = False,
        num_stages: Optional[int] = None,
    ) -> None:
        self.partitions = partitions
        self.skip_layout = skip_layout
        self.__checkpoint_stop = checkpoint_stop
        self.group = group
        self.training: bool
        self.transport: Transport = MakeTransport(
            use_rpc=use_rpc_by_default(worker_map), worker_map=worker_map, input_device=input_device, group=group
        )
        self.input_device = input_device
        self.final_stage = final_stage
        # Number of stages (``len(balance)``); ranks past it hold none. ``None``: the group size.
        self.num_stages = num_stages
        # The last stage: the backward of the previous mini-batch's outputs, which the earlier stages wait for.
        self._tail_backward: Optional[_TailBackward] = None
        # Steps run so far. Every message header carries its step's number, so that a stage that runs a step the
        # others do not (or skips one) is caught at its next message instead of using another step's messages.
        self.steps = 0

    @property
    def checkpoint_stop(self) -> int:
        """Micro-batches below this index are checkpointed (none in eval mode)."""
        training = self.partitions[0].module.training
        if not training:
            return 0
        return self.__checkpoint_stop

    def run(self, training: bool, batches: List[Batch], event: Optional[Event]) -> None:
        """Run this stage on ``batches`` (the final stage replaces them by its outputs, in place).

        Returns only once every message this stage sent was received, so that the process may end right after.

        Args:
            training (bool): whether gradients come back (training mode with autograd enabled): the stages before
                the last one then wait for them, and the last one sends them in its outputs' backward.
            batches (List[Batch]): this stage's micro-batches (only the first stage's values are used).
            event (Optional[Event]): the first stage waits for it before it receives gradients.

        Raises:
            PipelineAbortedError: another stage failed.
            StagesDisagreeError: the stages run steps that do not match (mode, number of micro-batches, or step
                number); raised by the stage that received a message of the other kind of step and by the stages
                that waited for it.
            RuntimeError: on the last stage, the previous output's backward did not run (the earlier stages, which
                waited for it, are stopped with ``PipelineAbortedError``).
        """
        previous, self._tail_backward = self._tail_backward, None
        if previous is not None and previous.abandon():
            raise RuntimeError(
                "AsyncPipe: the last stage runs forward again before the backward of its previous output: the "
                "earlier stages were still waiting for those gradients (they were stopped with PipelineAbortedError "
                "now, instead of waiting forever). In training mode, back-propagate every output of the last stage; "
                "for forward-only passes use eval mode or torch.no_grad() on every stage"
            )
        self.training = training
        # Counted once the step really starts, on every stage alike: a last stage that refused to run above did not
        # start its step, and the stages it stopped did not finish theirs (they counted it).
        self.steps += 1
        m = len(batches)
        skip_trackers = [SkipTrackerThroughPotals(self.skip_layout, i) for i in range(m)]
        rank = self.group.rank()
        event_loop = AsyncEventLoop(self.partitions, self.group, self.transport, self.training, self.checkpoint_stop)
        event_loop.step = self.steps
        if self.num_stages is not None:
            event_loop.num_stages = self.num_stages
        try:
            if rank == 0 and not self.final_stage:
                event_loop.event_loop_head(batches, skip_trackers, event)
            elif self.final_stage:
                event_loop.event_loop_tail(batches, skip_trackers)
            else:
                event_loop.event_loop(m, skip_trackers)
        except (PipelineAbortedError, StagesDisagreeError):
            # The stages concerned were told already (and what they still sent was received).
            raise
        except Exception:
            # Stop every stage, not only this one: the others would wait for its messages forever.
            event_loop.fail_over()
            raise
        self._tail_backward = event_loop.tail_backward
        # The sends run on a daemon thread, which does not outlive the interpreter: none may be left in flight
        # when forward returns (in eval mode the first stage would otherwise end before its activations left).
        self.transport.flush()

    def back_helper(self, output: List[Batch]) -> None:
        """A no-op: the backward of a non-final stage happens inside its ``forward``."""
