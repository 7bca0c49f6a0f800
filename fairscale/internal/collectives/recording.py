# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recording each logical collective once: the opt-in counter, and the simulated link's completion time."""

from typing import Optional

import torch

from .. import simulated_link as _link
from ..collective_counter import _active_counters, record_collective
from .groups import _GroupInfo

# Counting and the simulated link are off unless a test or benchmark opens them. The collectives test these two
# containers (each mutated in place, never rebound) before calling _record, so a call with both off costs two truth
# tests instead of a function call that records nothing and a second one that delays nothing.
ACTIVE_COUNTERS = _active_counters
LINKS = _link._links


def _record(
    kind: str, info: _GroupInfo, dtype: Optional[torch.dtype], numel: int, element_size: int
) -> Optional[float]:
    """Count the call; with a simulated link (:mod:`fairscale.internal.simulated_link`) return when it completes."""
    record_collective(kind, info.size, info.ranks, dtype, numel, element_size)
    return _link.ready_time(info.pg, info.size, numel * element_size)
