# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Batch many small gradient reduce-scatters into a few large ones.

Each reduce-scatter has a fixed latency cost, so FSDP queues per-parameter gradient chunks in a
bucket and reduce-scatters the whole bucket at once. A bucket is a ``(group size, shard size)``
matrix: row ``r`` collects the chunks destined for rank ``r``, column ranges are parameters.
Reduce-scattering the used columns (flattened row by row, which every backend accepts) leaves
each rank with its own row summed over ranks, i.e. its shard of every queued gradient.

With a *replicate group* (hybrid sharding: shard inside a node, replicate across nodes) the reduced row is then
all-reduced over that group before the callbacks run: one all-reduce per bucket, so bucketing merges the slow
inter-node all-reduces of small gradients just as it merges the reduce-scatters.

With ``overlap=True`` (what FSDP uses) a collective on CPU tensors is issued asynchronously and *completed* (waited,
then the replicate all-reduce, then the callbacks) only when the bucketer issues its next collective, or at
:meth:`ReduceScatterBucketer.flush`: gloo's collectives block the calling thread until the peers arrive, so a
synchronous reduce-scatter makes each rank wait for the slowest one once per bucket, while a deferred one runs on
gloo's threads during the next unit's backward. The reduction is the same (same inputs, same collective), only
waited later, so results are bitwise equal; the cost is at most one more pending fill (its input and output) per
bucketer, as PyTorch FSDP2 keeps its reduce-scatter input until the next one. That memory is real on parameter-heavy
models: with ``--layers 2 --hidden 512`` (28.1 MiB of gradient over three units) the benchmark's accumulation window
peaks at 120.7 MiB of heap with deferral and 114.0 MiB without. So an input larger than ``bucket_cap_mb`` is never
deferred (it completes at once): the bucket size the user chose also bounds what a pending reduction holds. On accelerators the collectives never
block the CPU (they are queued on streams), so there nothing is deferred.
"""

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, cast

import torch
from torch import Tensor

from . import collectives
from .errors import FairscaleValueError

__all__ = ["HOLD_FLOOR_BYTES", "Bucket", "ReduceScatterBucketer", "enable_nccl_base_collectives"]

#: The least a fill may hold before it is sent, in bytes of full (unsharded) gradient, whatever the gradient sizes.
#: A fill is otherwise sent before it would hold more than the largest single gradient seen so far (about one FSDP
#: unit's), so that the bucket adds no more memory during backward than PyTorch FSDP2's per-unit reduce-scatter
#: input. The floor keeps the point of bucketing for small gradients: below ~1 MiB a reduce-scatter is latency-bound
#: (tens of microseconds of fixed cost against ~20-100 us of transfer at 10-50 GB/s), so merging up to 1 MiB removes
#: most of the per-collective cost, while 1 MiB of held gradient is negligible next to activations and parameters.
HOLD_FLOOR_BYTES = 2**20

#: Upstream's switch between the tensor ("base") and list variants of the collectives, which its tests turned off.
#: Kept for code that reads or sets it; :mod:`fairscale.internal.collectives` picks the variant each backend
#: supports by itself (the tensor variant where it exists), so the value does not change what runs.
enable_nccl_base_collectives = True

#: ``ReduceScatterBucketer``'s default ``bucket_cap_mb``; also the bound on deferred inputs when bucketing is off.
_DEFAULT_BUCKET_CAP_MB = 25

_F = TypeVar("_F", bound=Callable[..., Any])


def _no_grad(fn: _F) -> _F:
    """``torch.no_grad()`` as a decorator, entered only when grad mode is on.

    FSDP calls the bucketer from backward hooks, where grad mode is already off; ``@torch.no_grad()`` would still
    build and enter a new context object (about ten Python calls) per gradient.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return cast(_F, wrapper)


class Bucket:
    """Queued reduce-scatter inputs of one ``(dtype, device, process group)``.

    The bucket costs memory only while it holds gradients: its input matrix is allocated when the first input of a
    fill arrives and released right after the flush that sends it. It is sized from what the same fill held in the
    previous backward (a backward's sequence of gradients repeats), so in steady state it is exactly as large as
    what it holds; when a fill outgrows that guess (the first backward, or a changed model), it grows, at most
    doubling, never beyond ``capacity``.

    Attributes:
        data (Tensor): the ``(group size, allocated columns)`` input matrix; columns ``[0, offset)`` are used.
            Holds no storage while the bucket is empty.
        group (Any): the process group of the reduce-scatter.
        replicate_group (Any): the group the reduced row is all-reduced over after the reduce-scatter (``None``:
            none; see the module docstring).
        capacity (int): the most columns a fill may hold (per-rank elements of ``bucket_cap_mb``).
        offset (int): number of used columns.
        callbacks (List[Callable[[Tensor], None]]): what to run after the next :meth:`flush`, each with its slice
            of this rank's reduced row.
    """

    def __init__(
        self, data: Tensor, group: Any, capacity: Optional[int] = None, replicate_group: Optional[Any] = None
    ) -> None:
        self.data = data
        self.group = group
        self.replicate_group = replicate_group
        self.capacity = data.size(1) if capacity is None else capacity
        self.offset = 0
        self.callbacks: List[Callable[[Tensor], None]] = []
        self._slots: List[Tuple[int, int, torch.Size]] = []
        # Columns used by each flush of the current backward, and of the previous one (the sizing guess).
        self._fills: List[int] = []
        self._hints: List[int] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of full gradient the current fill holds (all rows of the used columns)."""
        return self.offset * self.data.size(0) * self.data.element_size()

    @property
    def free_columns(self) -> int:
        """Columns a new input may still use in the current fill."""
        return self.capacity - self.offset

    def append(self, input_list: List[Tensor], callback_fn: Optional[Callable[[Tensor], None]]) -> None:
        """Copy one chunk per rank into the next columns; ``callback_fn`` gets this rank's reduced chunk at flush."""
        first = input_list[0]
        numel = first.numel()
        self._reserve(self.offset + numel)
        columns = slice(self.offset, self.offset + numel)
        for row, chunk in zip(self.data, input_list):
            row[columns].copy_(chunk.reshape(-1))
        if callback_fn is not None:
            self.callbacks.append(callback_fn)
            self._slots.append((self.offset, numel, first.shape))
        self.offset += numel

    def append_flat(self, flat: Tensor, callback_fn: Optional[Callable[[Tensor], None]]) -> None:
        """:meth:`append` of ``flat.chunk(rows)`` (a contiguous 1-D tensor), in one copy instead of one per row."""
        rows = self.data.size(0)
        numel = flat.numel() // rows
        self._reserve(self.offset + numel)
        # Row r of the new columns is chunk r of flat, which is row r of flat seen as (rows, numel).
        self.data.narrow(1, self.offset, numel).copy_(flat.view(rows, numel))
        if callback_fn is not None:
            self.callbacks.append(callback_fn)
            self._slots.append((self.offset, numel, torch.Size((numel,))))
        self.offset += numel

    def _reserve(self, columns: int) -> None:
        allocated = self.data.size(1) if self.data.untyped_storage().nbytes() > 0 else 0
        if columns <= allocated:
            return
        if columns > self.capacity:
            raise RuntimeError(f"Bucket: {columns} columns requested but the capacity is {self.capacity}")
        fill = len(self._fills)
        guess = self._hints[fill] if fill < len(self._hints) else 0
        size = min(self.capacity, max(columns, guess, 2 * allocated))
        # Every column is written before it is read (copied in, or reduced into the output), so no zeroing.
        grown = self.data.new_empty((self.data.size(0), size))
        if self.offset > 0:
            grown[:, : self.offset].copy_(self.data[:, : self.offset])
        self.data = grown

    def flush(self) -> None:
        """Reduce-scatter the used columns, run the queued callbacks and release the buffer."""
        pending = self.issue(async_op=False)
        if pending is not None:
            pending.complete()

    def issue(self, async_op: bool) -> Optional["PendingReduction"]:
        """Start the reduce-scatter of the used columns and release the buffer; the callbacks run in the returned
        reduction's :meth:`~PendingReduction.complete` (``None``: the bucket was empty).

        Args:
            async_op (bool): issue the collective asynchronously; the pending reduction then keeps the input matrix
                alive until it is waited.
        """
        if self.offset == 0:
            if self.callbacks:
                raise RuntimeError("Bucket.flush: callbacks are queued but no data is; the bucket is corrupt")
            return None
        # Sized to the used columns: the callbacks may keep views of it (it is never reused).
        output = self.data.new_empty(self.offset)
        # data[:, :offset] is not contiguous when the fill did not use every allocated column; the row-by-row
        # flattening is the concatenation of per-rank chunks that reduce-scatter expects. It is made here, not in
        # the collectives layer, so that an asynchronous collective's input is a tensor the pending reduction holds.
        used = self.data[:, : self.offset]
        flat = used.reshape(-1)
        work = collectives.reduce_scatter_from_flat(output, flat, group=self.group, async_op=async_op)
        pending = PendingReduction(work, output, flat, self.replicate_group, self.callbacks, self._slots)
        self._fills.append(self.offset)
        self._release()
        return pending

    def _release(self) -> None:
        self.offset = 0
        self.callbacks = []
        self._slots = []
        self.data = self.data.new_empty((self.data.size(0), 0))

    @property
    def output_shard(self) -> Tensor:
        """Upstream's attribute; the reduced row is now allocated per flush, so this is always empty."""
        return self.data.new_empty(0)

    def setup(self) -> None:
        """Kept for upstream's API: buffers are allocated on demand, so there is nothing to prepare."""

    def teardown(self) -> None:
        """End of a backward: the bucket must be empty; its fills become the sizing guess of the next backward."""
        if self.offset != 0 or self.callbacks:
            raise RuntimeError("Bucket.teardown: the bucket still holds unreduced data; call flush() first")
        self._release()
        if self._fills:
            self._hints = self._fills
        self._fills = []

    def discard(self) -> None:
        """Drop every queued input and callback and release the buffer (after an aborted backward)."""
        self._release()
        self._fills = []


class PendingReduction:
    """A reduce-scatter that was issued and whose callbacks have not run yet.

    Args:
        work (Optional[WorkHandle]): the collective's handle (``None``: it completed when issued).
        output (Tensor): this rank's reduced row.
        input (Tensor): the collective's input, held until the work is waited (gloo and NCCL read it until then).
        replicate_group (Any): all-reduce ``output`` over this group before the callbacks (``None``: none).
        callbacks (List[Callable[[Tensor], None]]): what gets a piece of ``output`` once it is reduced.
        slots (List[Tuple[int, int, torch.Size]]): ``(start, numel, shape)`` of each callback's piece; an empty
            list gives the single callback the whole ``output``, as it is.
    """

    __slots__ = ("work", "output", "input", "replicate_group", "callbacks", "slots")

    def __init__(
        self,
        work: Optional[collectives.WorkHandle],
        output: Tensor,
        input: Tensor,
        replicate_group: Any,
        callbacks: List[Callable[[Tensor], None]],
        slots: List[Tuple[int, int, torch.Size]],
    ) -> None:
        self.work = work
        self.output = output
        self.input: Optional[Tensor] = input
        self.replicate_group = replicate_group
        self.callbacks = callbacks
        self.slots = slots

    def complete(self) -> None:
        """Wait for the reduce-scatter, all-reduce over the replicate group, then run the callbacks (once).

        The replicate all-reduce needs the reduce-scatter's result, so it is issued only now; it is synchronous.
        """
        work, self.work = self.work, None
        if work is not None:
            work.wait()  # on accelerators: orders the current stream after the collective, without blocking
        self.input = None  # the collective no longer reads it
        output = self.output
        if self.replicate_group is not None:
            collectives.all_reduce(output, group=self.replicate_group)
        callbacks, slots = self.callbacks, self.slots
        self.callbacks, self.slots = [], []
        if not slots:
            for callback in callbacks:
                callback(output)
            return
        for callback, (start, numel, shape) in zip(callbacks, slots):
            piece = output.narrow(0, start, numel)
            callback(piece if len(shape) == 1 else piece.view(shape))  # a 1-D slot's shape is (numel,) already


class ReduceScatterBucketer:
    """Reduce-scatter helper that buckets small inputs into larger collectives.

    Args:
        bucket_cap_mb (int): bucket size in MiB across all ranks; each rank's row holds
            ``bucket_cap_mb * 2**20 / element_size // group_size`` elements. Inputs whose per-rank
            chunk is at least that large are reduce-scattered at once, from their own buffer; ``0`` (or
            less) disables bucketing.
        overlap (bool): (fork) defer the completion of collectives on CPU tensors (see the module docstring): each
            whose input is at most ``bucket_cap_mb`` is issued asynchronously and waited, with its callbacks run,
            when the next one is issued or at :meth:`flush`; larger ones complete at once, so that reductions in
            flight hold at most about ``bucket_cap_mb`` of input (25 MiB when bucketing is off). ``False``: every collective completes before the
            call that sends it returns.

    Use :meth:`reduce_scatter_async` per gradient, :meth:`flush` when all are queued (every callback has run
    when it returns) and :meth:`teardown` to release the buffers until the next backward.

    Flush policy: a fill never holds more than its *hold limit*, ``min(bucket size, max(largest bucketed gradient
    seen so far, hold_floor_bytes))`` bytes of full gradient (the largest counts every input so far, the new one
    included, smaller than a bucket row, in this and earlier backwards). A fill that a new input would take past
    the limit is sent first, and a fill that reaches the limit is sent at once (any further input would send it
    anyway); an input that reaches the limit alone is sent from its own buffer. With FSDP's one gradient per unit,
    the bucket so holds at most about one unit's gradient, as FSDP2's per-unit reduce-scatter does, while gradients
    smaller than the floor are still merged.

    Attributes:
        hold_floor_bytes (int): the least hold limit (:data:`HOLD_FLOOR_BYTES` unless set on the instance).
        largest_bytes (int): the largest bucketed input seen so far, in bytes of full gradient.
        overlap (bool): the ``overlap`` argument.
    """

    def __init__(self, bucket_cap_mb: int = 25, overlap: bool = False) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = overlap
        self.buckets: Dict[Tuple[torch.dtype, torch.device, Any, Any], Bucket] = {}
        self.hold_floor_bytes = HOLD_FLOOR_BYTES
        self.largest_bytes = 0
        # The one issued collective whose callbacks have not run (overlap only). One for all buckets, not one per
        # bucket: callbacks then run in the order their collectives were issued, as without overlap.
        self._pending: Optional[PendingReduction] = None

    @property
    def in_flight_cap_bytes(self) -> int:
        """The largest collective input (bytes) that ``overlap`` defers: ``bucket_cap_mb``, else 25 MiB."""
        return (self.bucket_cap_mb if self.bucket_cap_mb > 0 else _DEFAULT_BUCKET_CAP_MB) * 2**20

    @property
    def pending(self) -> bool:
        """Whether an issued collective still waits for its completion (its callbacks have not run)."""
        return self._pending is not None

    def _defer(self, tensor: Tensor, numel: int) -> bool:
        """Whether a collective reading ``numel`` elements of ``tensor`` is issued asynchronously.

        Accelerator collectives are queued on streams and never block the CPU: deferring their wait gains nothing.
        A deferred collective keeps its input and output alive during the next unit's backward, so only inputs of at
        most ``bucket_cap_mb`` are deferred: the knob that sizes buckets also bounds the memory of reductions in
        flight (a held input adds its size to the next unit's backward). Without
        bucketing (``bucket_cap_mb <= 0``) the bound is the default bucket size, 25 MiB.
        """
        if not self.overlap or tensor.device.type != "cpu":
            return False
        return numel * tensor.element_size() <= self.in_flight_cap_bytes

    def _submit(self, pending: Optional[PendingReduction]) -> None:
        """Make ``pending`` the pending reduction and complete the previous one (after ``pending`` was issued, so
        the two collectives overlap), or complete ``pending`` at once when it was issued synchronously."""
        if pending is None:
            return
        previous = self._pending
        if pending.work is None:  # synchronous (or already complete): nothing to wait for later
            self._complete_pending()
            pending.complete()
            return
        self._pending = pending
        if previous is not None:
            previous.complete()

    def _complete_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.complete()

    def _send(self, bucket: Bucket) -> None:
        self._submit(bucket.issue(async_op=self._defer(bucket.data, bucket.offset * bucket.data.size(0))))

    def _send_direct(
        self,
        output: Tensor,
        flat: Tensor,
        group: Any,
        replicate_group: Optional[Any],
        callback_fn: Optional[Callable[[Tensor], None]],
    ) -> None:
        """Reduce-scatter one input from its own flat buffer (not bucketed); ``callback_fn`` gets ``output``."""
        async_op = self._defer(flat, flat.numel())
        work = collectives.reduce_scatter_from_flat(output, flat, group=group, async_op=async_op)
        callbacks = [] if callback_fn is None else [callback_fn]
        self._submit(PendingReduction(work, output, flat, replicate_group, callbacks, []))

    @_no_grad
    def reduce_scatter_async(
        self,
        input_list: List[Tensor],
        group: Any,
        callback_fn: Optional[Callable[[Tensor], None]] = None,
        replicate_group: Optional[Any] = None,
    ) -> None:
        """Reduce-scatter ``input_list`` over ``group``, possibly later in a bucket.

        Args:
            input_list (List[Tensor]): one chunk per rank of ``group`` (all the same numel, dtype
                and device, e.g. from :func:`~fairscale.internal.parallel.chunk_and_pad`); chunk
                ``r`` is reduced into rank ``r``'s result.
            group (Any): the process group (``None`` for the default world group).
            callback_fn (Optional[Callable[[Tensor], None]]): called with this rank's reduced
                chunk (shaped like ``input_list[0]``) once it is ready: at once for inputs that are
                not bucketed (see the flush policy above), else when their fill is sent. Do not modify
                the inputs before then; they are copied into the bucket right away, so they may be freed.
            replicate_group (Optional[Any]): (fork) all-reduce the reduced chunk over this group before the
                callback runs (hybrid sharding); ``None``: no all-reduce.
        """
        size = collectives.group_size(group)
        if size < 1:  # torch's size of a group on a rank outside it
            raise FairscaleValueError(
                "reduce_scatter_async: this rank is not a member of the process group; call it on the group's ranks"
            )
        if len(input_list) != size:
            raise FairscaleValueError(  # also an AssertionError, as upstream
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
        bucket = self._make_room(first, size, group, replicate_group=replicate_group)
        if bucket is None:
            # Reduce-scatter it now, as one flat input (a bucket would only copy it).
            # Contiguous whatever the chunks' layout (transposed, channels_last): it is written in place, as the
            # bucketed path's output is.
            output = torch.zeros_like(first, memory_format=torch.contiguous_format)
            flat_input = torch.cat([chunk.reshape(-1) for chunk in input_list])
            self._send_direct(output, flat_input, group, replicate_group, callback_fn)
            return
        self._append(bucket, input_list, callback_fn)

    def _append(
        self,
        bucket: Bucket,
        input_list: Optional[List[Tensor]],
        callback_fn: Optional[Callable[[Tensor], None]],
        flat: Optional[Tensor] = None,
    ) -> None:
        if flat is not None:
            bucket.append_flat(flat, callback_fn)
        else:
            assert input_list is not None
            bucket.append(input_list, callback_fn)
        if bucket.held_bytes >= self.hold_limit(bucket):
            self._send(bucket)  # full: any further input would send it first, so holding it longer only costs memory

    def _make_room(
        self, first: Tensor, size: int, group: Any, numel: Optional[int] = None, replicate_group: Optional[Any] = None
    ) -> Optional[Bucket]:
        """The bucket to append a non-empty input shaped like ``first`` to, after sending the fill it would take past
        the hold limit; ``None`` when the input goes out at once from its own buffer: when its per-rank chunk is at
        least a bucket row, or when it reaches the hold limit on its own (a fill of it alone would be sent at once,
        so copying it into the bucket would only hold a second copy of it during the collective). ``numel`` is the
        per-rank chunk's size when ``first`` is the whole flat input (it only gives dtype and device then)."""
        if numel is None:
            numel = first.numel()
        if numel >= self._get_shard_size(first.element_size(), size):
            return None
        bucket = self._find_or_create_bucket(first, group, replicate_group)
        nbytes = numel * size * first.element_size()
        # Inputs of a bucket row or more do not count: they would raise the limit to the whole bucket.
        self.largest_bytes = max(self.largest_bytes, nbytes)
        limit = self.hold_limit(bucket)
        if numel > bucket.free_columns or bucket.held_bytes + nbytes > limit:
            self._send(bucket)
        return None if nbytes >= limit else bucket

    def hold_limit(self, bucket: Bucket) -> int:
        """The most bytes of full gradient ``bucket``'s fill may hold now (see the class docstring)."""
        capacity_bytes = bucket.capacity * bucket.data.size(0) * bucket.data.element_size()
        return min(capacity_bytes, max(self.largest_bytes, self.hold_floor_bytes))

    @_no_grad
    def reduce_scatter_flat_async(
        self,
        flat: Tensor,
        group: Any,
        callback_fn: Optional[Callable[[Tensor], None]] = None,
        replicate_group: Optional[Any] = None,
    ) -> None:
        """Like :meth:`reduce_scatter_async` for one contiguous tensor laid out as the concatenation of per-rank
        chunks (``flat.numel()`` divisible by the group size). An input that is not bucketed (as large as a bucket
        row, or reaching the hold limit alone) is reduce-scattered straight from ``flat``, without a copy."""
        size = collectives.group_size(group)
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % size != 0:
            raise ValueError(
                f"reduce_scatter_flat_async needs a contiguous 1-D tensor whose numel ({flat.numel()}) is divisible "
                f"by the group size ({size})"
            )
        chunk = flat.numel() // size
        if chunk == 0:
            self.reduce_scatter_async([flat[:0]] * size, group, callback_fn, replicate_group)
            return
        bucket = self._make_room(flat, size, group, chunk, replicate_group)
        if bucket is not None:
            self._append(bucket, None, callback_fn, flat=flat)
            return
        self._send_direct(flat.new_empty(chunk), flat, group, replicate_group, callback_fn)

    @_no_grad
    def flush(self) -> None:
        """Reduce-scatter every non-empty bucket and complete every issued collective: all callbacks have run when
        it returns (on accelerators: their work is queued on the current stream)."""
        for bucket in self.buckets.values():
            self._send(bucket)
        self._complete_pending()

    @_no_grad
    def teardown(self) -> None:
        """Release every bucket's memory; call after :meth:`flush` (e.g. at the end of backward)."""
        if self._pending is not None:
            raise RuntimeError(
                "ReduceScatterBucketer.teardown: a reduce-scatter was issued but not completed; call flush() first"
            )
        for bucket in self.buckets.values():
            bucket.teardown()

    @_no_grad
    def discard(self) -> None:
        """Drop every queued input and callback and release the buffers (after an aborted backward).

        A pending collective is abandoned, not waited: after an error its peers may never join it, and waiting would
        hang. Its callbacks never run; torch's work object keeps its tensors alive until it finishes or fails.
        """
        self._pending = None
        for bucket in self.buckets.values():
            bucket.discard()

    def _get_shard_size(self, element_size: int, num_shards: int) -> int:
        if self.bucket_cap_mb <= 0:  # bucketing disabled
            return 0
        bucket_elements = self.bucket_cap_mb * 2**20 / element_size
        return int(bucket_elements // num_shards)

    def _find_or_create_bucket(self, tensor: Tensor, group: Any, replicate_group: Optional[Any] = None) -> Bucket:
        key = (tensor.dtype, tensor.device, group, replicate_group)
        if key not in self.buckets:
            size = collectives.group_size(group)
            shard_size = self._get_shard_size(tensor.element_size(), size)
            self.buckets[key] = Bucket(tensor.new_empty((size, 0)), group, shard_size, replicate_group)
        return self.buckets[key]
