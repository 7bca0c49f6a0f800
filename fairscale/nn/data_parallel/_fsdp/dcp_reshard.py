# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Moving values between FSDP's flat shards and DCP's dim-0 chunks, one flat parameter at a time.

Both directions communicate over the handle's process group and hold at most one flat parameter's full size at a
time (plus this rank's pieces), never the whole model:

* :func:`flat_to_chunks` all-gathers one flat tensor shaped like the handle's shard (the fp32 parameter shard, or an
  optimizer state of it) and cuts this rank's dim-0 chunk of every original parameter out of it;
* :func:`chunks_to_flat` is the reverse: every rank puts its chunks into a fixed-size slot per parameter, the slots
  are all-gathered, and every rank copies the elements its own flat shard covers out of them. Parameters given as
  full tensors are copied locally, without communication.

The gathers are collective: every rank of the group must call these functions for the same handles, with the same
kinds of values, in the same order (the callers agree on that first).
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives

from .dcp_layout import HandleLayout

__all__ = ["flat_to_chunks", "chunks_to_flat", "CHUNK", "FULL"]

# Kinds of the values chunks_to_flat takes: this rank's dim-0 chunk, or the full tensor.
CHUNK = "chunk"
FULL = "full"


@torch.no_grad()
def flat_to_chunks(hl: HandleLayout, shard: Tensor, out_device: torch.device) -> List[Tensor]:
    """This rank's dim-0 chunk of every original parameter of ``hl``, cut out of a flat tensor.

    Args:
        hl: the handle and its original parameters.
        shard: this rank's flat tensor shaped like the handle's shard (parameter or optimizer state).
        out_device: where the chunks go.

    Returns:
        One fresh tensor per parameter of ``hl.params`` (never a view of ``shard`` or of a gathered buffer), with the
        parameter's dtype-independent chunk shape (:meth:`OrigParam.chunk_shape`).
    """
    h = hl.handle
    config = hl.unit.config
    if h.is_sharded:
        src = shard.detach().to(config.compute_device).reshape(-1)
        full = torch.empty(h.padded_numel, dtype=src.dtype, device=src.device)
        collectives.all_gather_into_flat(full, src, config.process_group)
    else:
        full = shard.detach().reshape(-1)
    out: List[Tensor] = []
    for p in hl.params:
        start, end = p.rows(hl.world_size, hl.rank)
        piece = full.narrow(0, p.offset + start * p.row_numel, (end - start) * p.row_numel)
        out.append(piece.view(p.chunk_shape(hl.world_size, hl.rank)).to(device=out_device, copy=True))
    return out


@torch.no_grad()
def chunks_to_flat(hl: HandleLayout, values: List[Optional[Tuple[str, Tensor]]], out: Tensor) -> None:
    """Write every given original parameter's elements that this rank's flat shard covers into ``out``.

    Args:
        hl: the handle and its original parameters.
        values: per parameter of ``hl.params``: ``(CHUNK, this rank's dim-0 chunk)``, ``(FULL, the full tensor)``,
            or ``None`` to leave the parameter's elements of ``out`` as they are.
        out: this rank's flat tensor shaped like the handle's shard (written in place; padding is not touched).
    """
    h = hl.handle
    config = hl.unit.config
    world, rank = hl.world_size, hl.rank
    lo, hi = hl.shard_range()
    flat_out = out.view(-1)
    slots: List[int] = []  # per CHUNK parameter: its slot offset in every rank's part of the exchange buffer
    total = 0
    for p, value in zip(hl.params, values):
        if value is not None and value[0] == CHUNK:
            slots.append(total)
            total += p.slot_numel(world)
        else:
            slots.append(-1)
    gathered: Optional[Tensor] = None
    if total > 0:
        mine = torch.zeros(total, dtype=out.dtype, device=config.compute_device)
        for p, value, slot in zip(hl.params, values, slots):
            if slot >= 0:
                assert value is not None
                chunk = value[1].reshape(-1)
                mine.narrow(0, slot, chunk.numel()).copy_(chunk)
        if h.is_sharded:
            gathered = torch.empty(world * total, dtype=mine.dtype, device=mine.device)
            collectives.all_gather_into_flat(gathered, mine, config.process_group)
        else:
            gathered = mine
    for p, value, slot in zip(hl.params, values, slots):
        if value is None:
            continue
        # The elements of this parameter that this rank's shard covers, in parameter coordinates.
        a, b = max(lo, p.offset) - p.offset, min(hi, p.offset + p.numel) - p.offset
        if a >= b:
            continue
        if slot < 0:
            flat_out.narrow(0, p.offset + a - lo, b - a).copy_(value[1].reshape(-1).narrow(0, a, b - a))
            continue
        assert gathered is not None
        for q in range(world):
            start, end = p.rows(world, q)
            x0, x1 = max(a, start * p.row_numel), min(b, end * p.row_numel)
            if x0 >= x1:
                continue
            src = gathered.narrow(0, q * total + slot + x0 - start * p.row_numel, x1 - x0)
            flat_out.narrow(0, p.offset + x0 - lo, x1 - x0).copy_(src)
