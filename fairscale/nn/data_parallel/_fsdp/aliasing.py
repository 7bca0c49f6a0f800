# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parameters that share elements of one storage (``nn.Parameter(other.data[:, :4])``).

FSDP copies each parameter into its own shard, so two parameters that shared elements train apart from then on: a
plain module (and torch DDP, which copies nothing) updates the shared elements through both, and the wrapped model
drifted from it silently (a fuzz of model construction, session 49). Parameters that share a storage without sharing
elements (slices of one buffer loaded with ``mmap=True`` and ``assign=True``, the columns of a fused weight) are fine,
and so are overlapping ones that are all frozen (nothing changes them). The same ``Parameter`` object registered
twice is a tie, handled in :mod:`.ties`.

Cost: a dictionary lookup per parameter; the elements are compared only for parameters of one storage whose byte
ranges overlap, as runs of contiguous bytes, and not at all past a million runs (the check then gives up).
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

_MAX_RUNS = 10**6

Span = Tuple[int, int, int]  # first byte, past the last byte, index of the parameter


def _range(p: nn.Parameter) -> Tuple[int, int]:
    """The bytes of its storage between ``p``'s first and last element."""
    size, offset = p.element_size(), int(p.storage_offset())
    last = offset + sum((int(d) - 1) * abs(int(s)) for d, s in zip(p.shape, p.stride()))
    return offset * size, (last + 1) * size


def _runs(p: nn.Parameter, index: int) -> Optional[List[Span]]:
    """``p``'s bytes as runs of contiguous bytes (its rows when its last dimension is contiguous); None: too many."""
    size = p.element_size()
    dims = [(int(d), int(s)) for d, s in zip(p.shape, p.stride())]
    run = size
    if dims and dims[-1][1] == 1:
        run = dims[-1][0] * size
        dims = dims[:-1]
    count = 1
    for d, _ in dims:
        count *= d
    if count > _MAX_RUNS:
        return None
    starts = torch.tensor([int(p.storage_offset())], dtype=torch.int64)
    for d, s in dims:
        starts = (starts.unsqueeze(-1) + torch.arange(d, dtype=torch.int64) * s).reshape(-1)
    return [(int(b) * size, int(b) * size + run, index) for b in starts.tolist()]


def _shared_elements(group: List[Tuple[str, nn.Parameter]]) -> Optional[Tuple[int, int]]:
    """Indices into ``group`` of two parameters sharing bytes, one of them trainable (None: none, or too many runs)."""
    spans: List[Span] = []
    for i, (_, p) in enumerate(group):
        runs = _runs(p, i)
        if runs is None or len(spans) + len(runs) > _MAX_RUNS:
            return None
        spans.extend(runs)
    spans.sort()
    reach_end, reach_owner = -1, -1
    for start, end, owner in spans:
        if start < reach_end and owner != reach_owner:
            a, b = group[reach_owner][1], group[owner][1]
            if a.requires_grad or b.requires_grad:
                return reach_owner, owner
        if end > reach_end:
            reach_end, reach_owner = end, owner
    return None


def find_overlapping(named: List[Tuple[str, nn.Parameter]]) -> Optional[Tuple[str, str]]:
    """The names of two distinct parameters of ``named`` that share elements, one of them trainable; else None."""
    by_storage: Dict[int, List[Tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        if p.numel() == 0 or p.device.type == "meta" or p.layout != torch.strided:
            continue
        try:
            key = p.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage: nothing to compare
            continue
        by_storage.setdefault(key, []).append((name, p))
    for group in by_storage.values():
        if len(group) < 2:
            continue
        ranges = sorted((*_range(p), i) for i, (_, p) in enumerate(group))
        if all(ranges[k][1] <= ranges[k + 1][0] for k in range(len(ranges) - 1)):
            continue  # apart (slices of one buffer): the common case, no element compared
        found = _shared_elements(group)
        if found is not None:
            return group[found[0]][0], group[found[1]][0]
    return None
