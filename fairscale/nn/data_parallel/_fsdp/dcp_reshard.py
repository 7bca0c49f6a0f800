# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Moving values between FSDP's flat shards and DCP's dim-0 chunks, one flat parameter at a time.

Rank ``s`` holds flat elements ``[s * S, (s + 1) * S)`` of a flat parameter (its shard); rank ``q`` must hold rows
``[q * C, (q + 1) * C)`` of every original parameter in it (its chunks). Both cuts are arithmetic, so every rank knows,
without communication, which flat interval goes from which shard owner to which chunk owner (:func:`_plan`). Each
direction is then one ``all_to_all`` per flat tensor, of equal blocks sized for the largest pair:

* :func:`flat_to_chunks`: every rank sends each peer the elements of its shard that the peer's chunks hold, and
  assembles its own chunks (elements of its own shard are copied locally, without the wire);
* :func:`chunks_to_flat`: the reverse, into a flat tensor shaped like the shard. Parameters given as full tensors,
  or as this rank's boxes of its own shard (what ``load`` reads a checkpoint into, :mod:`.dcp_views`), are copied
  locally, without communication.

A rank sends and receives only what the other layout needs (for 2 ranks about half a shard, instead of the whole
flat parameter an all-gather would bring). Besides its chunks it holds the send and receive buffers of one
exchange, ``W * block`` elements each, which is at most the padded flat parameter (a block never exceeds a shard);
in usual layouts both together are about the padded flat parameter at 2 ranks and less beyond (twice it at worst,
when parameters have fewer rows than there are ranks). Small flat tensors share an exchange within the largest
one's size (:func:`_run`).

The exchanges are collective: every rank of the group must call these functions for the same handles, with the
same kinds of values, in the same order (the callers agree on that first).
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives

from .dcp_layout import HandleLayout
from .dcp_views import box_sources

__all__ = ["flat_to_chunks", "chunks_to_flat", "CHUNK", "FULL", "BOXES"]

# Kinds of the values chunks_to_flat takes: this rank's dim-0 chunk, the full tensor, or a ShardedTensor whose local
# shards are this rank's boxes of the parameter (views of a staging copy of its own shard).
CHUNK = "chunk"
FULL = "full"
BOXES = "boxes"


Segment = Tuple[int, int, int]  # (parameter index, first flat element, end flat element)


@dataclass
class _Plan:
    """What this rank exchanges for one flat parameter.

    Attributes:
        as_shard_owner: per chunk owner ``q``, the intervals of this rank's shard that ``q``'s chunks hold.
        as_chunk_owner: per shard owner ``s``, the intervals of this rank's chunks that ``s``'s shard holds.
        block: the largest total between two different ranks: the size of every block of the exchange.
    """

    as_shard_owner: List[List[Segment]]
    as_chunk_owner: List[List[Segment]]
    block: int


def _plan(hl: HandleLayout, include: Sequence[bool]) -> _Plan:
    """The intervals every pair of ranks exchanges for the included parameters (arithmetic only, O(W * params))."""
    key = tuple(include)
    cached = hl.plans.get(key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    world, rank = hl.world_size, hl.rank
    shard = hl.handle.shard_numel if hl.handle.is_sharded else hl.handle.numel
    as_shard_owner: List[List[Segment]] = [[] for _ in range(world)]
    as_chunk_owner: List[List[Segment]] = [[] for _ in range(world)]
    totals: Dict[Tuple[int, int], int] = {}
    for i, p in enumerate(hl.params):
        if not include[i]:
            continue
        for q in range(world):
            start, end = p.rows(world, q)
            lo, hi = p.offset + start * p.row_numel, p.offset + end * p.row_numel
            s = lo // shard if shard > 0 else 0
            while lo < hi and s * shard < hi:
                a, b = max(lo, s * shard), min(hi, (s + 1) * shard)
                if s == rank:
                    as_shard_owner[q].append((i, a, b))
                if q == rank:
                    as_chunk_owner[s].append((i, a, b))
                if s != q:
                    totals[(s, q)] = totals.get((s, q), 0) + b - a
                s += 1
    plan = _Plan(as_shard_owner, as_chunk_owner, max(totals.values(), default=0))
    hl.plans[key] = plan
    return plan


def _chunk_start(hl: HandleLayout, i: int) -> int:
    """The flat index of the first element of this rank's chunk of parameter ``i``."""
    p = hl.params[i]
    return p.offset + p.rows(hl.world_size, hl.rank)[0] * p.row_numel


@dataclass
class _Transfer:
    """One flat tensor's part of an exchange: how to fill this rank's block for a peer, and how to use a peer's."""

    hl: HandleLayout
    plan: _Plan
    dtype: torch.dtype
    pack: Callable[[int, Tensor], None]  # (peer, its block of the send buffer: plan.block elements)
    unpack: Callable[[int, Tensor], None]  # (peer, its block of the receipt)


def _run(transfers: Sequence[_Transfer]) -> None:
    """Exchange every transfer that needs the wire, several per ``all_to_all`` when they fit.

    Consecutive transfers of one dtype and device share an exchange while their buffers together stay within the
    largest single transfer's (so batching never raises the peak, and the few large flat parameters go alone). The
    grouping is arithmetic on what every rank knows, so every rank makes the same calls.
    """
    todo = [t for t in transfers if t.hl.world_size > 1 and t.plan.block > 0]
    if not todo:
        return
    cap = max(t.plan.block for t in todo)
    group: List[_Transfer] = []
    for t in todo:
        if group and (
            t.dtype != group[0].dtype
            or t.hl.unit.config.compute_device != group[0].hl.unit.config.compute_device
            or sum(g.plan.block for g in group) + t.plan.block > cap
        ):
            _exchange(group)
            group = []
        group.append(t)
    _exchange(group)


def _exchange(group: Sequence[_Transfer]) -> None:
    config = group[0].hl.unit.config
    world, rank = group[0].hl.world_size, group[0].hl.rank
    total = sum(t.plan.block for t in group)
    send = torch.empty(world * total, dtype=group[0].dtype, device=config.compute_device)
    for j in range(world):
        if j != rank:
            pos = j * total
            for t in group:
                t.pack(j, send.narrow(0, pos, t.plan.block))
                pos += t.plan.block
    received = torch.empty_like(send)
    collectives.all_to_all_single(received, send, config.process_group)
    del send
    for j in range(world):
        if j != rank:
            pos = j * total
            for t in group:
                t.unpack(j, received.narrow(0, pos, t.plan.block))
                pos += t.plan.block


def _to_chunks(hl: HandleLayout, shard: Tensor, out_device: torch.device) -> Tuple[List[Tensor], _Transfer]:
    """The chunks of one flat tensor (this rank's own elements copied), and the transfer that completes them."""
    world, rank = hl.world_size, hl.rank
    flat = shard.detach().reshape(-1)
    lo = rank * hl.handle.shard_numel if hl.handle.is_sharded else 0
    chunks = [torch.empty(p.chunk_shape(world, rank), dtype=flat.dtype, device=out_device) for p in hl.params]
    pieces = [c.view(-1) for c in chunks]
    starts = [_chunk_start(hl, i) for i in range(len(hl.params))]
    plan = _plan(hl, [True] * len(hl.params))
    for i, a, b in plan.as_shard_owner[rank]:  # elements of this rank's own shard
        pieces[i].narrow(0, a - starts[i], b - a).copy_(flat.narrow(0, a - lo, b - a))

    def pack(q: int, block: Tensor) -> None:
        pos = 0
        for _, a, b in plan.as_shard_owner[q]:
            block.narrow(0, pos, b - a).copy_(flat.narrow(0, a - lo, b - a))
            pos += b - a

    def unpack(s: int, block: Tensor) -> None:
        pos = 0
        for i, a, b in plan.as_chunk_owner[s]:
            pieces[i].narrow(0, a - starts[i], b - a).copy_(block.narrow(0, pos, b - a))
            pos += b - a

    return chunks, _Transfer(hl, plan, flat.dtype, pack, unpack)


@torch.no_grad()
def flat_to_chunks(items: Sequence[Tuple[HandleLayout, Tensor, torch.device]]) -> List[List[Tensor]]:
    """This rank's dim-0 chunk of every original parameter, cut out of the ranks' flat tensors.

    Args:
        items: ``(handle layout, this rank's flat tensor shaped like the handle's shard (parameter or optimizer
            state), device for the chunks)`` per flat tensor, in the same order on every rank.

    Returns:
        Per item, one fresh tensor per parameter of its ``hl.params``, of the parameter's chunk shape
        (:meth:`OrigParam.chunk_shape`) and the flat tensor's dtype. Never a view: ``torch.save`` (which DCP's
        writer uses) writes a view's whole storage, here the whole shard.
    """
    results: List[List[Tensor]] = []
    transfers: List[_Transfer] = []
    for hl, shard, out_device in items:
        chunks, transfer = _to_chunks(hl, shard, out_device)
        results.append(chunks)
        transfers.append(transfer)
    _run(transfers)
    return results


Value = Optional[Tuple[str, Tensor]]


def _to_flat(hl: HandleLayout, values: List[Value], out: Tensor) -> Optional[_Transfer]:
    """Copy this rank's own elements into ``out``; the transfer that brings the others (``None``: nothing to bring)."""
    world, rank = hl.world_size, hl.rank
    flat_out = out.view(-1)
    lo, hi = hl.shard_range()
    for p, value in zip(hl.params, values):
        if value is not None and value[0] == BOXES:
            sources = box_sources(value[1], p, hl)
            if sources is None:  # checked when the load was planned
                raise RuntimeError(f"the boxes given for {p.fqn!r} are not this rank's")
            for begin, box in sources:
                flat_out.narrow(0, begin, box.numel()).copy_(box.reshape(-1))
            continue
        if value is None or value[0] != FULL:
            continue
        # The elements of this parameter that this rank's shard covers, in parameter coordinates.
        a, b = max(lo, p.offset) - p.offset, min(hi, p.offset + p.numel) - p.offset
        if a < b:
            flat_out.narrow(0, p.offset + a - lo, b - a).copy_(value[1].reshape(-1).narrow(0, a, b - a))
    include = [v is not None and v[0] == CHUNK for v in values]
    if not any(include):
        return None
    pieces = [v[1].reshape(-1) if (v is not None and v[0] == CHUNK) else out for v in values]  # `out`: never read
    starts = [_chunk_start(hl, i) for i in range(len(hl.params))]
    plan = _plan(hl, include)
    for i, a, b in plan.as_chunk_owner[rank]:  # this rank's own chunks that its own shard holds
        flat_out.narrow(0, a - lo, b - a).copy_(pieces[i].narrow(0, a - starts[i], b - a))

    def pack(s: int, block: Tensor) -> None:
        pos = 0
        for i, a, b in plan.as_chunk_owner[s]:
            block.narrow(0, pos, b - a).copy_(pieces[i].narrow(0, a - starts[i], b - a))
            pos += b - a

    def unpack(q: int, block: Tensor) -> None:
        pos = 0
        for _, a, b in plan.as_shard_owner[q]:
            flat_out.narrow(0, a - lo, b - a).copy_(block.narrow(0, pos, b - a))
            pos += b - a

    return _Transfer(hl, plan, out.dtype, pack, unpack)


@torch.no_grad()
def chunks_to_flat(items: Sequence[Tuple[HandleLayout, List[Value], Tensor]]) -> None:
    """Write every given original parameter's elements that this rank's flat shard covers into the flat tensors.

    Args:
        items: ``(handle layout, values, out)`` per flat tensor, in the same order on every rank. ``values`` has,
            per parameter of ``hl.params``: ``(CHUNK, this rank's dim-0 chunk)``, ``(FULL, the full tensor)``,
            ``(BOXES, a ShardedTensor of this rank's boxes)``, or ``None`` to leave the parameter's elements as they
            are; ``out`` is this rank's flat tensor shaped like the handle's shard (written in place; its padding is
            not touched). Only CHUNK values are exchanged: a load of boxes is local copies only.
    """
    transfers = [t for t in (_to_flat(hl, values, out) for hl, values, out in items) if t is not None]
    _run(transfers)
