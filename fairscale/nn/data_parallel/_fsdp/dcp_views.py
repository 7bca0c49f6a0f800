# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Zero-copy DCP values for a save: the pieces of every original parameter that lie in this rank's flat shard.

A flat shard cuts its original parameters at arbitrary elements, so the part of a parameter of shape
``(d0, ..., dk)`` that a rank holds is a contiguous range ``[a, b)`` of its row-major elements. :func:`flat_boxes`
cuts such a range into at most ``2k + 1`` rectangular boxes (a partial last-dimension run, partial blocks of the
next dimensions up, whole leading rows, and the mirror image at the end), each itself a contiguous range, so each is a
view of the shard reshaped. :func:`sharded_views` presents those views as a ``ShardedTensor`` whose metadata (every
rank's boxes) is computed locally from the FSDP layout (every rank's shard range is arithmetic), so a save needs no
exchange and no copy: DCP writes the boxes as its chunks and reshards them on load like any other chunks.

With hybrid sharding every replica holds the same shards; one replica (chosen per tensor, round robin, so the writes
spread over the replicas) lists its boxes, the others none, so each box is written once. 0-dim parameters are one
box of one element on the rank that holds it.

A load reads the other way (:func:`staging_views`): the ``ShardedTensor`` s list this rank's boxes of a *staging*
tensor shaped like the flat shard, so ``dcp.load`` writes every element straight into the place it will take (a
checkpoint of the same layout: one read per saved chunk). Every replica reads its own copy, so each rank lists its own
replica's boxes only: DCP's load planner uses the local shards alone, and the metadata needs to cover the tensor once.
:func:`box_sources` then says where each local box goes in the live shard, for a plain copy once every rank read.
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .dcp_layout import HandleLayout, OrigParam

try:  # torch >= 2.0
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.api import EnumerableShardingSpec

    _SHARDED_TENSOR_ERROR = None
except ImportError as e:  # pragma: no cover - a torch without ShardedTensor: the copying save path is used
    _SHARDED_TENSOR_ERROR = str(e)

__all__ = [
    "Box",
    "flat_boxes",
    "param_boxes",
    "sharded_views",
    "staging_views",
    "box_sources",
    "is_sharded_tensor",
    "shape_of",
    "dtype_of",
    "views_available",
    "PreStaged",
]

# (offsets, sizes, start): a box of the tensor at ``offsets`` with ``sizes``, whose elements are the row-major
# elements ``[start, start + prod(sizes))`` of the tensor.
Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]


def views_available() -> bool:
    return _SHARDED_TENSOR_ERROR is None


def flat_boxes(shape: Sequence[int], a: int, b: int) -> List[Box]:
    """The boxes that tile the row-major elements ``[a, b)`` of a tensor of ``shape``, in flat order.

    Each box has the form ``(1, ..., 1, m, d_{j+1}, ..., d_k)``, so its elements are contiguous in the flat order and
    ``flat[start : start + numel].view(sizes)`` is the box. At most ``2 * len(shape) - 1`` boxes (one for 0-dim).
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= a <= b <= numel:
        raise ValueError(f"flat range [{a}, {b}) is not inside a tensor of shape {shape} ({numel} elements)")
    out: List[Box] = []
    if a < b:
        _boxes(shape, a, b, (), 0, out)
    return out


def _boxes(shape: Tuple[int, ...], a: int, b: int, prefix: Tuple[int, ...], base: int, out: List[Box]) -> None:
    """Append the boxes of ``[a, b)`` (``a < b``) of the sub-tensor at index ``prefix`` (flat start ``base``)."""
    ones = (1,) * len(prefix)
    if len(shape) <= 1:
        sizes = (b - a,) if shape else ()
        out.append((prefix + ((a,) if shape else ()), ones + sizes, base + a))
        return
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, last = a // inner, b // inner  # the row of a, and the row b falls in (b itself excluded)
    if first == last:  # inside one row: cut it one dimension down
        _boxes(shape[1:], a - first * inner, b - first * inner, prefix + (first,), base + first * inner, out)
        return
    whole_from = first
    if a % inner:  # the tail of a partial first row
        _boxes(shape[1:], a % inner, inner, prefix + (first,), base + first * inner, out)
        whole_from = first + 1
    if last > whole_from:  # whole rows: one box
        rest = shape[1:]
        out.append(
            (prefix + (whole_from,) + (0,) * len(rest), ones + (last - whole_from,) + rest, base + whole_from * inner)
        )
    if b % inner:  # the head of a partial last row
        _boxes(shape[1:], 0, b % inner, prefix + (last,), base + last * inner, out)


def param_boxes(p: OrigParam, hl: HandleLayout, group_rank: int) -> List[Box]:
    """The boxes of ``p`` in the shard of group rank ``group_rank`` (``start`` relative to ``p``; none for padding)."""
    shard = hl.handle.shard_numel if hl.handle.is_sharded else hl.handle.numel
    lo = group_rank * shard if hl.handle.is_sharded else (0 if group_rank == 0 else hl.handle.numel)
    a, b = max(lo, p.offset), min(lo + shard, p.offset + p.numel)
    if a >= b:
        return []
    return flat_boxes(p.shape, a - p.offset, b - p.offset)


def sharded_views(
    hl: HandleLayout, flat: Tensor, writers: Sequence[Sequence[int]], first_index: int, snapshot: bool = False
) -> List[Any]:
    """A ``ShardedTensor`` per parameter of ``hl`` whose local shards are views of ``flat`` (no copy, no exchange).

    Args:
        hl: the handle's layout.
        flat: this rank's tensor shaped like the handle's shard (the parameter shard or an optimizer state).
        writers: per replica, the global rank of every group rank (one row without hybrid sharding).
        first_index: a running index of the tensors of the save (the same on every rank): parameter ``i`` of this
            handle is listed by replica ``(first_index + i) % len(writers)``.
        snapshot: view a CPU copy of ``flat`` (one copy of the shard, padding included) instead of ``flat``.
    """
    flat = flat.detach().reshape(-1)  # a view: the shards are contiguous
    if snapshot:  # async_save: training goes on while the files are written, so the views are of a CPU copy
        flat = flat.to(torch.device("cpu"), copy=True)
    me = torch.distributed.get_rank()
    props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False, pin_memory=False)
    lo = hl.rank * hl.handle.shard_numel if hl.handle.is_sharded else 0
    out: List[Any] = []
    for i, p in enumerate(hl.params):
        ranks = writers[(first_index + i) % len(writers)]
        metadata: List[ShardMetadata] = []
        local: List[Any] = []
        for q, global_rank in enumerate(ranks):
            for offsets, sizes, start in param_boxes(p, hl, q):
                # Only this rank's shards are checked against their tensors' device: the others' is nominal.
                md = ShardMetadata(list(offsets), list(sizes), f"rank:{global_rank}/{flat.device}")
                metadata.append(md)
                if global_rank == me:
                    begin = p.offset + start - lo
                    numel = 1
                    for s in sizes:
                        numel *= s
                    local.append(Shard(_box_view(flat, begin, numel, sizes), md))
        if not metadata:  # an empty parameter: DCP still needs one (empty) chunk of it
            md = ShardMetadata([0] * len(p.shape), list(p.shape), f"rank:{ranks[0]}/{flat.device}")
            metadata.append(md)
            if ranks[0] == me:
                local.append(Shard(flat[:0].view(p.shape), md))
        global_md = ShardedTensorMetadata(metadata, torch.Size(p.shape), props)
        out.append(
            ShardedTensor._init_from_local_shards_and_global_metadata(
                local, global_md, sharding_spec=EnumerableShardingSpec(metadata)
            )
        )
    return out


def staging_views(hl: HandleLayout, like: Tensor, device: torch.device, row: Sequence[int]) -> List[Any]:
    """Per parameter of ``hl``, a ``ShardedTensor`` for ``dcp.load`` to read into: this rank's boxes of a new staging
    tensor (``like``'s shape and dtype, on ``device``), listed over ``row`` (the global ranks of this rank's replica).

    The staging tensor is only reachable through the views: :func:`box_sources` finds where each goes. Its padding is
    never read.
    """
    staging = torch.empty(like.shape, dtype=like.dtype, device=device)
    return sharded_views(hl, staging, [row], 0)


def is_sharded_tensor(value: Any) -> bool:
    return _SHARDED_TENSOR_ERROR is None and isinstance(value, ShardedTensor)


# A ShardedTensor answers its attributes (shape, dtype, size()) through __torch_function__, which warns that it is
# deprecated and validates its arguments on every call (a fraction of a millisecond, several times per tensor of a
# load): its metadata holds the same.


def shape_of(value: Tensor) -> Tuple[int, ...]:
    """The (global) shape of a tensor or ``ShardedTensor``."""
    if is_sharded_tensor(value):
        return tuple(value.metadata().size)  # type: ignore[attr-defined]
    return tuple(value.shape)


def dtype_of(value: Tensor) -> torch.dtype:
    """The dtype of a tensor or ``ShardedTensor``."""
    if is_sharded_tensor(value):
        dtype: torch.dtype = value.metadata().tensor_properties.dtype  # type: ignore[attr-defined]
        return dtype
    return value.dtype


def box_sources(value: Any, p: OrigParam, hl: HandleLayout) -> Optional[List[Tuple[int, Tensor]]]:
    """``(first element in this rank's flat shard, local tensor)`` per local shard of the ``ShardedTensor``
    ``value`` when its local shards are exactly this rank's boxes of ``p`` (as :func:`staging_views` makes them);
    ``None`` when they are not."""
    shards = value.local_shards()
    expected = param_boxes(p, hl, hl.rank)
    if not expected:  # no element here; an empty parameter has one empty chunk on one rank
        return [] if all(s.tensor.numel() == 0 for s in shards) else None
    if len(shards) != len(expected):
        return None
    lo = hl.shard_range()[0]
    out: List[Tuple[int, Tensor]] = []
    for (offsets, sizes, start), s in zip(expected, shards):
        if tuple(s.metadata.shard_offsets) != offsets or tuple(s.tensor.shape) != sizes:
            return None
        out.append((p.offset + start - lo, s.tensor))
    return out


def _box_view(flat: Tensor, begin: int, numel: int, sizes: Sequence[int]) -> Tensor:
    """``flat[begin : begin + numel]`` shaped ``sizes``, on the CPU over a storage of exactly its bytes.

    DCP's file writer copies a CPU tensor whose storage is larger than the tensor (to write "minimal storage"), and
    its file loop keeps every tensor it wrote until the file is closed: views of the shards would cost a copy of the
    whole shards. A tensor made through numpy over the same memory has a storage of exactly its bytes (no copy; the
    numpy array keeps the shard alive). Any dtype: the bytes go through uint8. Device tensors are copied to the CPU by
    the writer anyway.
    """
    view = flat[begin : begin + numel]
    if view.device.type != "cpu" or numel == 0:
        return view.view(list(sizes))
    exact = torch.from_numpy(view.view(torch.uint8).numpy())
    return exact.view(flat.dtype).view(list(sizes))


class PreStaged:
    """An ``AsyncStager`` for ``dcp.async_save`` of a state dict that is already a snapshot (``snapshot=True``).

    DCP's default stager deep-copies tensors storage by storage, which a ``ShardedTensor`` does not support; the
    snapshot views are already CPU copies, so staging has nothing left to do.
    """

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
