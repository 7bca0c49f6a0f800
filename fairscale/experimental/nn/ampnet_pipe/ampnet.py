# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The AMPnet event loop of :class:`~fairscale.experimental.nn.ampnet_pipe.pipe.AMPnetPipe` (not yet available)."""

from typing import Any

from ._unavailable import unavailable

__all__ = ["AsyncAMPnetEventLoop", "create_task_without_skip_trackers"]


def create_task_without_skip_trackers(checkpoint_stop: int, i: int, j: int, batch: Any, partition: Any) -> Any:
    """A pipe task running ``partition`` on ``batch`` (not available in this distribution)."""
    raise unavailable("create_task_without_skip_trackers")


class AsyncAMPnetEventLoop:
    """Head, trunk and tail loops of AMPnet training (not available in this distribution)."""

    def __init__(
        self,
        partitions: Any,
        group: Any,
        transport: Any,
        min_update_interval: int,
        weight_prediction: bool,
        checkpoint_stop: int,
        input_device: Any,
        chunks: int,
    ) -> None:
        raise unavailable("AsyncAMPnetEventLoop")
