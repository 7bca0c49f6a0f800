# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Callbacks told about each recomputation of a :func:`checkpoint_wrapper` module, with its output tensors.

A recomputation runs inside backward, and its outputs start a backward of their own (torch's reentrant checkpoint
back-propagates through them in a nested graph task). A wrapper around the checkpointed module whose own forward is
not recomputed (FullyShardedDataParallel around ``checkpoint_wrapper(block)``) sees that nested backward only
through these outputs: it registers a callback here and hooks them.
"""

from typing import Callable, List, Sequence

import torch
from torch import nn

RecomputationHook = Callable[[nn.Module, Sequence[torch.Tensor]], None]

_hooks: List[RecomputationHook] = []


def register_recomputation_hook(fn: RecomputationHook) -> None:
    """Call ``fn(module, output_tensors)`` after every recomputation of a checkpointed module (once per ``fn``)."""
    if fn not in _hooks:
        _hooks.append(fn)


def run_recomputation_hooks(module: nn.Module, output_tensors: Sequence[torch.Tensor]) -> None:
    for fn in list(_hooks):
        fn(module, output_tensors)
