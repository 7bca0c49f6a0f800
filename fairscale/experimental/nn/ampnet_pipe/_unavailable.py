# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The error raised by the AMPnet names until the asynchronous pipe they build on is available."""

MESSAGE = (
    "{name} is not yet available in this distribution of fairscale: AMPnet runs on the multi-process "
    "fairscale.nn.pipe.AsyncPipe event loop, which is not ported yet. Use fairscale.nn.Pipe (synchronous GPipe) "
    "or fairscale.experimental.nn.distributed_pipeline.DistributedPipeline instead."
)


def unavailable(name: str) -> NotImplementedError:
    """The error for ``name``, saying what to use instead."""
    return NotImplementedError(MESSAGE.format(name=name))
