# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``AMPnetPipe``: asynchronous (AMPnet, stale weights) training over a multi-process pipeline.

Not yet available in this distribution; constructing it raises :class:`NotImplementedError` (see
``docs/experimental.rst``).
"""

from typing import Any

from ._unavailable import unavailable

__all__ = ["AMPnetPipe"]


class AMPnetPipe:
    """AMPnet training loop on top of ``fairscale.nn.pipe.AsyncPipe`` (keyword arguments of ``AsyncPipe``).

    Raises:
        NotImplementedError: always, in this distribution (the asynchronous pipe it builds on is not ported yet).
    """

    def __init__(self, **kwargs: Any) -> None:
        raise unavailable("AMPnetPipe")

    def interleave(
        self,
        lm_dataloader: Any,
        criterion: Any,
        optimizer: Any,
        transform_logger_object: Any,
        min_update_interval: int = 1,
        weight_prediction: bool = False,
    ) -> None:
        """Run one epoch of asynchronous pipelined training (not available, see the class docstring)."""
        raise unavailable("AMPnetPipe.interleave")
