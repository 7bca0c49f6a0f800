# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recording each logical collective once: the opt-in counter, and the simulated link's completion time."""

from typing import Optional

import torch

from .. import simulated_link as _link
from ..collective_counter import record_collective
from .groups import _GroupInfo


def _record(
    kind: str, info: _GroupInfo, dtype: Optional[torch.dtype], numel: int, element_size: int
) -> Optional[float]:
    """Count the call; with a simulated link (:mod:`fairscale.internal.simulated_link`) return when it completes."""
    record_collective(kind, info.size, info.ranks, dtype, numel, element_size)
    return _link.ready_time(info.pg, info.size, numel * element_size)
