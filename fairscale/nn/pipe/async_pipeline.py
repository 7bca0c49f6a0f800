# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The engine of one :class:`~fairscale.nn.pipe.AsyncPipe` stage: picks the head/middle/tail event loop."""

from threading import Event
from typing import Any, Dict, List, Optional

from .async_schedule import AsyncEventLoop, ModuleWrapper, PipelineAbortedError
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

    @property
    def checkpoint_stop(self) -> int:
        """Micro-batches below this index are checkpointed (none in eval mode)."""
        training = self.partitions[0].module.training
        if not training:
            return 0
        return self.__checkpoint_stop

    def run(self, training: bool, batches: List[Batch], event: Optional[Event]) -> None:
        """Run this stage on ``batches`` (the final stage replaces them by its outputs, in place)."""
        self.training = training
        m = len(batches)
        skip_trackers = [SkipTrackerThroughPotals(self.skip_layout, i) for i in range(m)]
        rank = self.group.rank()
        event_loop = AsyncEventLoop(self.partitions, self.group, self.transport, self.training, self.checkpoint_stop)
        if self.num_stages is not None:
            event_loop.num_stages = self.num_stages
        try:
            if rank == 0 and not self.final_stage:
                event_loop.event_loop_head(batches, skip_trackers, event)
            elif self.final_stage:
                event_loop.event_loop_tail(batches, skip_trackers)
            else:
                event_loop.event_loop(m, skip_trackers)
        except PipelineAbortedError:
            raise
        except Exception:
            # Stop every stage, not only this one: the others would wait for its messages forever.
            event_loop.fail_over()
            raise

    def back_helper(self, output: List[Batch]) -> None:
        """A no-op: the backward of a non-final stage happens inside its ``forward``."""
