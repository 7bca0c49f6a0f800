# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Batch many small gradient reduce-scatters into a few large ones.

Each reduce-scatter has a fixed latency cost, so FSDP queues per-parameter gradient chunks in a
bucket and reduce-scatters the whole bucket at once. A bucket is a ``(group size, shard size)``
matrix: row ``r`` collects the chunks destined for rank ``r``, column ranges are parameters.
Reduce-scattering the used columns (flattened row by row, which every backend accepts) leaves
each rank with its own row summed over ranks, i.e. its shard of every queued gradient.
"""

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import collectives

__all__ = ["Bucket", "ReduceScatterBucketer"]


class Bucket:
    """Queued reduce-scatter inputs of one ``(dtype, device, process group)``.

    Attributes:
        data (Tensor): the ``(group size, shard size)`` input matrix; columns ``[0, offset)`` are used.
        group (Any): the process group of the reduce-scatter.
        offset (int): number of used columns.
        callbacks (List[Callable[[], None]]): what to run after the next :meth:`flush`.
        output_shard (Tensor): receives this rank's reduced row; callbacks get slices of it.
    """

    def __init__(self, data: Tensor, group: Any) -> None:
        self.data = data
        self.group = group
        self.offset = 0
        self.callbacks: List[Callable[[], None]] = []
        self.output_shard = torch.zeros_like(data[0])

    def flush(self) -> None:
        """Reduce-scatter the used columns, run the queued callbacks and empty the bucket."""
        if self.offset == 0:
            if self.callbacks:
                raise RuntimeError("Bucket.flush: callbacks are queued but no data is; the bucket is corrupt")
            return
        # data[:, :offset] is not contiguous; the collectives layer flattens it row by row, which
        # is the concatenation of per-rank chunks that reduce-scatter expects.
        collectives.reduce_scatter_from_flat(
            self.output_shard[: self.offset], self.data[:, : self.offset], group=self.group
        )
        for callback in self.callbacks:
            callback()
        # Zero the used columns for the next round. The callbacks may keep views of the output
        # (FSDP stores the reduced gradient shard as one), so it is replaced, never reused.
        self.data[:, : self.offset].zero_()
        self.offset = 0
        self.callbacks.clear()
        self.output_shard = torch.zeros_like(self.data[0])

    def setup(self) -> None:
        """(Re)allocate the buffers after :meth:`teardown` (called before each use)."""
        if self.data.untyped_storage().size() == 0:
            self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())
            self.data.zero_()
        if self.output_shard.untyped_storage().size() == 0:
            self.output_shard.untyped_storage().resize_(self.output_shard.numel() * self.output_shard.element_size())
            self.output_shard.zero_()

    def teardown(self) -> None:
        """Release the buffers' memory (e.g. after backward); the bucket must be empty."""
        if self.offset != 0 or self.callbacks:
            raise RuntimeError("Bucket.teardown: the bucket still holds unreduced data; call flush() first")
        self.data.untyped_storage().resize_(0)
        self.output_shard.untyped_storage().resize_(0)


class ReduceScatterBucketer:
    """Reduce-scatter helper that buckets small inputs into larger collectives.

    Args:
        bucket_cap_mb (int): bucket size in MiB across all ranks; each rank's row holds
            ``bucket_cap_mb * 2**20 / element_size // group_size`` elements. Inputs whose per-rank
            chunk is larger are reduce-scattered at once; ``0`` (or less) disables bucketing.

    Use :meth:`reduce_scatter_async` per gradient, :meth:`flush` when all are queued (callbacks
    run then) and :meth:`teardown` to release the buffers until the next backward.
    """

    def __init__(self, bucket_cap_mb: int = 25) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets: Dict[Tuple[torch.dtype, torch.device, Any], Bucket] = {}

    @torch.no_grad()
    def reduce_scatter_async(
        self,
        input_list: List[Tensor],
        group: Any,
        callback_fn: Optional[Callable[[Tensor], None]] = None,
    ) -> None:
        """Reduce-scatter ``input_list`` over ``group``, possibly later in a bucket.

        Args:
            input_list (List[Tensor]): one chunk per rank of ``group`` (all the same numel, dtype
                and device, e.g. from :func:`~fairscale.internal.parallel.chunk_and_pad`); chunk
                ``r`` is reduced into rank ``r``'s result.
            group (Any): the process group (``None`` for the default world group).
            callback_fn (Optional[Callable[[Tensor], None]]): called with this rank's reduced
                chunk (shaped like ``input_list[0]``) once it is ready: at once for inputs too
                large to bucket, else at the next flush. Do not modify the inputs before then;
                they are copied into the bucket right away, so they may be freed.
        """
        size = collectives.group_size(group)
        if len(input_list) != size:
            raise ValueError(
                f"reduce_scatter_async: got {len(input_list)} inputs for a group of {size} ranks; "
                "pass one chunk per rank (see chunk_and_pad)"
            )
        first = input_list[0]
        numel = first.numel()
        for chunk in input_list[1:]:
            if chunk.numel() != numel or chunk.dtype != first.dtype or chunk.device != first.device:
                raise ValueError(
                    "reduce_scatter_async: all inputs need the same numel, dtype and device; got "
                    f"{[(c.numel(), c.dtype, str(c.device)) for c in input_list]}"
                )

        if numel == 0:  # nothing to reduce; a bucket cannot hold an empty slot
            if callback_fn is not None:
                callback_fn(torch.zeros_like(first))
            return
        if numel > self._get_shard_size(first.element_size(), size):
            # Too large for a bucket: reduce-scatter it now, as one flat input.
            output = torch.zeros_like(first)
            flat_input = torch.cat([chunk.reshape(-1) for chunk in input_list])
            collectives.reduce_scatter_from_flat(output, flat_input, group=group)
            if callback_fn is not None:
                callback_fn(output)
            return

        bucket = self._find_or_create_bucket(first, group)
        if numel > bucket.data.size(1) - bucket.offset:
            bucket.flush()
        columns = slice(bucket.offset, bucket.offset + numel)
        for row, chunk in zip(bucket.data, input_list):
            row[columns].copy_(chunk.reshape(-1))
        if callback_fn is not None:
            result_view = bucket.output_shard[columns].view_as(first)
            bucket.callbacks.append(functools.partial(callback_fn, result_view))
        bucket.offset += numel

    @torch.no_grad()
    def reduce_scatter_flat_async(
        self, flat: Tensor, group: Any, callback_fn: Optional[Callable[[Tensor], None]] = None
    ) -> None:
        """Like :meth:`reduce_scatter_async` for one contiguous tensor laid out as the concatenation of per-rank
        chunks (``flat.numel()`` divisible by the group size). An input too large for a bucket is reduce-scattered
        straight from ``flat``, without the per-chunk concatenation copy."""
        size = collectives.group_size(group)
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % size != 0:
            raise ValueError(
                f"reduce_scatter_flat_async needs a contiguous 1-D tensor whose numel ({flat.numel()}) is divisible "
                f"by the group size ({size})"
            )
        chunk = flat.numel() // size
        if chunk > 0 and chunk > self._get_shard_size(flat.element_size(), size):
            output = flat.new_empty(chunk)
            collectives.reduce_scatter_from_flat(output, flat, group=group)
            if callback_fn is not None:
                callback_fn(output)
            return
        self.reduce_scatter_async(list(flat.chunk(size)) if chunk > 0 else [flat[:0]] * size, group, callback_fn)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every non-empty bucket and run its callbacks."""
        for bucket in self.buckets.values():
            bucket.flush()

    @torch.no_grad()
    def teardown(self) -> None:
        """Release every bucket's memory; call after :meth:`flush` (e.g. at the end of backward)."""
        for bucket in self.buckets.values():
            bucket.teardown()

    @torch.no_grad()
    def discard(self) -> None:
        """Drop every queued input and callback and release the buffers (after an aborted backward)."""
        for bucket in self.buckets.values():
            bucket.offset = 0
            bucket.callbacks.clear()
            bucket.teardown()

    def _get_shard_size(self, element_size: int, num_shards: int) -> int:
        if self.bucket_cap_mb <= 0:  # bucketing disabled
            return 0
        bucket_elements = self.bucket_cap_mb * 2**20 / element_size
        return int(bucket_elements // num_shards)

    def _find_or_create_bucket(self, tensor: Tensor, group: Any) -> Bucket:
        key = (tensor.dtype, tensor.device, group)
        if key not in self.buckets:
            size = collectives.group_size(group)
            shard_size = self._get_shard_size(tensor.element_size(), size)
            self.buckets[key] = Bucket(tensor.new_zeros((size, shard_size)), group)
        self.buckets[key].setup()
        return self.buckets[key]
