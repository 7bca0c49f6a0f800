# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of ReduceScatterBucketer on real gloo worlds."""

import time
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import count_collectives, reduce_scatter_from_flat
from fairscale.internal.parallel import chunk_and_pad
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
from fairscale.nn.data_parallel import hybrid_groups

MIB = 2**20


def _grad(rank: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: sums are exact in fp32 and bf16 whatever the reduction order.
    return ((torch.arange(numel) * (index + 1) + rank) % 7).to(dtype)


def _unbucketed(grad: torch.Tensor, ws: int) -> torch.Tensor:
    chunks = chunk_and_pad(grad, ws)
    out = torch.empty_like(chunks[0])
    reduce_scatter_from_flat(out, torch.cat(chunks))
    return out


def _check_buckets_and_direct(rank: int, ws: int) -> None:
    """Several sizes: some share a bucket, one forces a flush, one is too large to bucket."""
    bucketer = ReduceScatterBucketer(bucket_cap_mb=1)
    shard_size = MIB // 4 // ws  # fp32 elements per rank row of a 1 MiB bucket
    # Per-rank chunk sizes: a, b fill most of the row; c does not fit next to them (flush);
    # d is larger than the row (direct); e is tiny and uneven.
    numels = [
        int(0.4 * shard_size) * ws,
        int(0.5 * shard_size) * ws - 3,
        int(0.3 * shard_size) * ws,
        (shard_size + 5) * ws,
        11,
    ]
    grads = [_grad(rank, i, n, torch.float32) for i, n in enumerate(numels)]
    results: Dict[int, torch.Tensor] = {}

    def keep(i: int):  # type: ignore[no-untyped-def]
        return lambda reduced: results.__setitem__(i, reduced)

    with count_collectives() as counter:
        bucketer.reduce_scatter_async(chunk_and_pad(grads[0], ws), None, keep(0))
        bucketer.reduce_scatter_async(chunk_and_pad(grads[1], ws), None, keep(1))
        assert results == {} and counter.count() == 0  # queued, nothing sent yet
        bucketer.reduce_scatter_async(chunk_and_pad(grads[2], ws), None, keep(2))
        assert sorted(results) == [0, 1] and counter.count() == 1  # c did not fit: a+b flushed
        bucketer.reduce_scatter_async(chunk_and_pad(grads[3], ws), None, keep(3))
        assert sorted(results) == [0, 1, 3] and counter.count() == 2  # d went directly
        bucketer.reduce_scatter_async(chunk_and_pad(grads[4], ws), None, keep(4))
        bucketer.flush()
        assert sorted(results) == [0, 1, 2, 3, 4] and counter.count() == 3  # c+e in one flush
        bucketer.flush()  # empty buckets: nothing to send
        assert counter.count() == 3
    per_rank = [(n + ws - 1) // ws for n in numels]
    assert [r.numel for r in counter.records] == [
        ws * (per_rank[0] + per_rank[1]),
        ws * per_rank[3],
        ws * (per_rank[2] + per_rank[4]),
    ]
    bucketer.teardown()
    for i, grad in enumerate(grads):
        assert results[i].shape == (per_rank[i],)
        assert torch.equal(results[i], _unbucketed(grad, ws)), i  # views survive teardown


def _check_dtypes_groups_and_reuse(rank: int, ws: int) -> None:
    """Separate buckets per dtype and group; teardown then reuse in a second "backward"."""
    bucketer = ReduceScatterBucketer(bucket_cap_mb=1)
    groups = [None, dist.new_group(list(range(ws)))]
    keys = [(torch.float32, groups[0]), (torch.bfloat16, groups[0]), (torch.float32, groups[1]), (torch.bfloat16, None)]
    for step in range(2):
        results: List[torch.Tensor] = []
        grads = [_grad(rank + step, i, 10 * i + 3, dtype) for i, (dtype, _) in enumerate(keys)]
        expected = [_unbucketed(grad, ws) for grad in grads]
        with count_collectives() as counter:
            for grad, (_, group) in zip(grads, keys):
                bucketer.reduce_scatter_async(chunk_and_pad(grad, ws), group, results.append)
            assert results == []
            bucketer.flush()
        assert counter.count() == 3  # (fp32, None), (bf16, None), (fp32, group)
        per_rank = [(n + ws - 1) // ws for n in (3, 13, 23, 33)]
        assert [(r.dtype, r.numel) for r in counter.records] == [
            (torch.float32, ws * per_rank[0]),
            (torch.bfloat16, ws * (per_rank[1] + per_rank[3])),
            (torch.float32, ws * per_rank[2]),
        ]
        # Callbacks run in bucket order, so match them by dtype and size instead of position.
        by_key = {(r.dtype, r.numel()): r for r in results}
        for exp in expected:
            assert torch.equal(by_key[(exp.dtype, exp.numel())], exp)
        bucketer.teardown()
        assert all(b.data.untyped_storage().size() == 0 for b in bucketer.buckets.values())


def _check_no_bucketing_and_bad_input(rank: int, ws: int) -> None:
    bucketer = ReduceScatterBucketer(bucket_cap_mb=0)
    results: List[torch.Tensor] = []
    with count_collectives() as counter:
        for i in range(3):
            bucketer.reduce_scatter_async(chunk_and_pad(_grad(rank, i, 5, torch.float32), ws), None, results.append)
            assert len(results) == i + 1  # every call reduce-scatters at once
        bucketer.reduce_scatter_async(chunk_and_pad(torch.zeros(0), ws), None, results.append)
    assert counter.count() == 3 and results[3].numel() == 0
    for i in range(3):
        assert torch.equal(results[i], _unbucketed(_grad(rank, i, 5, torch.float32), ws))
    with pytest.raises(ValueError, match=f"got {ws + 1} inputs for a group of {ws} ranks"):
        bucketer.reduce_scatter_async([torch.zeros(2)] * (ws + 1), None)
    if ws > 1:
        with pytest.raises(ValueError, match="same numel"):
            bucketer.reduce_scatter_async([torch.zeros(2)] * (ws - 1) + [torch.zeros(3)], None)
        only_first = dist.new_group([0])  # world-collective: every rank makes it
        if rank != 0:  # was "a group of -1 ranks"
            with pytest.raises(ValueError, match="not a member of the process group"):
                bucketer.reduce_scatter_async([torch.zeros(2)], only_first)


def _check_flat_inputs(rank: int, ws: int) -> None:
    """reduce_scatter_flat_async: same results as the chunk-list path, bucketed or direct; the direct path reduces
    straight from the given tensor (one collective, no extra flush)."""
    bucketer = ReduceScatterBucketer(bucket_cap_mb=1)  # a row holds 2**18 / ws fp32 elements
    results: Dict[int, torch.Tensor] = {}
    big = (2**18 // ws + 5) * ws
    sizes = [7 * ws, big, 3 * ws, 0]
    with count_collectives() as counter:
        for i, numel in enumerate(sizes):
            flat = _grad(rank, i, numel, torch.float32)
            bucketer.reduce_scatter_flat_async(flat, None, callback_fn=lambda out, i=i: results.__setitem__(i, out))
        direct = counter.count("reduce_scatter")
        bucketer.flush()
    assert direct == 1  # only the big one went at once; the small ones wait for the flush
    assert counter.count("reduce_scatter") == 2
    for i, numel in enumerate(sizes):
        assert torch.equal(results[i], _unbucketed(_grad(rank, i, numel, torch.float32), ws)), i
    bucketer.teardown()
    with pytest.raises(ValueError, match="divisible"):
        (
            bucketer.reduce_scatter_flat_async(torch.zeros(ws + 1), None)
            if ws > 1
            else (_ for _ in ()).throw(ValueError("divisible"))
        )


def _body(rank: int, ws: int) -> None:
    _check_flat_inputs(rank, ws)
    _check_buckets_and_direct(rank, ws)
    _check_dtypes_groups_and_reuse(rank, ws)
    _check_no_bucketing_and_bad_input(rank, ws)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reduce_scatter_bucketer(world_size: int) -> None:
    run_distributed(_body, world_size, timeout=120)


KIB = 2**10


def _feed(
    bucketer: ReduceScatterBucketer, kib: List[int], rank: int, seed: int
) -> "tuple[List[int], List[int], Dict[int, torch.Tensor], List[torch.Tensor]]":
    """FSDP's use: one flat fp32 gradient per unit through reduce_scatter_flat_async, then flush. Returns the
    reduce-scatter count after each call and after the flush, the full numel of each one sent, the results and
    the inputs. Checks after every call that the fill holds no more than its hold limit."""
    ws = dist.get_world_size()
    results: Dict[int, torch.Tensor] = {}
    grads = [_grad(rank, seed + i, n * KIB // 4, torch.float32) for i, n in enumerate(kib)]
    counts = []
    with count_collectives() as counter:
        for i, grad in enumerate(grads):
            bucketer.reduce_scatter_flat_async(grad, None, callback_fn=lambda out, i=i: results.__setitem__(i, out))
            counts.append(counter.count("reduce_scatter"))
            for bucket in bucketer.buckets.values():
                limit = bucketer.hold_limit(bucket)
                assert bucket.held_bytes <= limit <= max(bucketer.largest_bytes, bucketer.hold_floor_bytes)
                assert bucket.held_bytes == bucket.offset * ws * 4
        bucketer.flush()
        counts.append(counter.count("reduce_scatter"))
    sent = [r.numel for r in counter.records if r.kind == "reduce_scatter"]
    bucketer.teardown()
    assert all(b.data.untyped_storage().size() == 0 for b in bucketer.buckets.values())  # freed after the flush
    return counts, sent, results, grads


def _check_results(results: Dict[int, torch.Tensor], grads: List[torch.Tensor], ws: int) -> None:
    assert sorted(results) == list(range(len(grads)))
    for i, grad in enumerate(grads):
        assert torch.equal(results[i], _unbucketed(grad, ws)), i


def _check_unit_sized_fills(rank: int, ws: int) -> None:
    """Gradients above the floor: a fill never holds more than the largest gradient seen, in this or an earlier
    backward; a fill that reaches it is sent at once (a gradient that reaches it alone, from its own buffer);
    smaller gradients still share a fill."""
    bucketer = ReduceScatterBucketer()  # 25 MB: every gradient below fits a bucket row, none goes direct
    assert bucketer.hold_floor_bytes == 1024 * KIB
    # Limit 2048 KiB after the first. 2048: sent at once. 1536+256+256 = 2048: sent on reaching it. 1536, then
    # 1024 would pass 2048: the 1536 goes first; the 1024 waits for the flush.
    counts, sent, results, grads = _feed(bucketer, [2048, 1536, 256, 256, 1536, 1024], rank, 0)
    assert counts == [1, 1, 1, 2, 2, 3, 4]
    assert sent == [k * KIB // 4 for k in (2048, 2048, 1536, 1024)]
    _check_results(results, grads, ws)
    # The first one reached the limit alone: reduced from its own buffer, not copied into a bucket (whose sends
    # hand out views of one output row).
    assert results[0]._base is None and all(results[i]._base is not None for i in range(1, 6))
    assert bucketer.largest_bytes == 2048 * KIB
    # Next backward: the limit remembers the 2048 KiB gradient (not max(768, floor) = 1024 KiB: one send each).
    for step in range(2):
        counts, sent, results, grads = _feed(bucketer, [768, 768, 768], rank, 10 + step)
        assert counts == [0, 0, 1, 2] and sent == [k * KIB // 4 for k in (1536, 768)]
        _check_results(results, grads, ws)
    # Steady state: the fill is sized from the previous backward, exactly what it holds.
    bucketer.reduce_scatter_flat_async(_grad(rank, 0, 768 * KIB // 4, torch.float32), None)
    (bucket,) = bucketer.buckets.values()
    assert bucket.data.size(1) == 1536 * KIB // 4 // ws and bucket.offset == 768 * KIB // 4 // ws
    bucketer.flush()
    bucketer.teardown()


def _check_small_gradients_merge_up_to_the_floor(rank: int, ws: int) -> None:
    """Below the floor, gradients share a fill until it holds the floor, then it is sent: fewer collectives than
    one per gradient, and never a fill above the floor."""
    bucketer = ReduceScatterBucketer()
    counts, sent, results, grads = _feed(bucketer, [128] * 20, rank, 0)
    assert counts == [(i + 1) // 8 for i in range(20)] + [3]  # 8 x 128 KiB = the 1 MiB floor
    assert sent == [k * KIB // 4 for k in (1024, 1024, 512)]
    _check_results(results, grads, ws)
    # A floor set on the instance (a smaller limit for tests or tight memory).
    bucketer = ReduceScatterBucketer()
    bucketer.hold_floor_bytes = 256 * KIB
    counts, sent, results, grads = _feed(bucketer, [64, 64, 64, 64, 96, 96, 96], rank, 5)
    assert counts == [0, 0, 0, 1, 1, 1, 2, 3] and sent == [k * KIB // 4 for k in (256, 192, 96)]
    _check_results(results, grads, ws)


def _hold_limit_body(rank: int, ws: int) -> None:
    _check_unit_sized_fills(rank, ws)
    _check_small_gradients_merge_up_to_the_floor(rank, ws)


def test_fill_holds_at_most_one_unit_gradient() -> None:
    run_distributed(_hold_limit_body, 2, timeout=120)


# ------------------------------------------------------------------------------------- overlap (deferred completion)


def _check_overlap_defers_completion(rank: int, ws: int) -> None:
    """overlap=True: each collective is issued asynchronously and completed (callbacks run) when the next one is
    issued or at flush; same collectives, same results, bitwise, as the synchronous bucketer."""
    shard_size = MIB // 4 // ws
    numels = [int(0.4 * shard_size) * ws, int(0.5 * shard_size) * ws - 3, int(0.3 * shard_size) * ws]
    numels += [(shard_size + 5) * ws, 11]
    grads = [_grad(rank, i, n, torch.float32) for i, n in enumerate(numels)]
    results: Dict[int, torch.Tensor] = {}

    def keep(i: int):  # type: ignore[no-untyped-def]
        return lambda reduced: results.__setitem__(i, reduced)

    bucketer = ReduceScatterBucketer(bucket_cap_mb=1, overlap=True)
    with count_collectives() as counter:
        bucketer.reduce_scatter_async(chunk_and_pad(grads[0], ws), None, keep(0))
        bucketer.reduce_scatter_async(chunk_and_pad(grads[1], ws), None, keep(1))
        assert results == {} and counter.count() == 0 and not bucketer.pending
        bucketer.reduce_scatter_async(chunk_and_pad(grads[2], ws), None, keep(2))
        assert counter.count() == 1 and bucketer.pending and results == {}  # a+b sent, not waited
        (bucket,) = bucketer.buckets.values()
        assert bucket.offset > 0  # c is in the next fill while a+b's input is held by the pending reduction
        bucketer.reduce_scatter_async(chunk_and_pad(grads[3], ws), None, keep(3))
        # d is larger than the bucket (1 MiB): sent directly and completed at once, after a+b, so that no more
        # than the bucket size is ever held by a pending reduction.
        assert counter.count() == 2 and sorted(results) == [0, 1, 3]
        assert not bucketer.pending
        with pytest.raises(RuntimeError, match="call flush"):
            bucketer.teardown()
        bucketer.reduce_scatter_async(chunk_and_pad(grads[4], ws), None, keep(4))
        bucketer.flush()  # sends c+e and completes it
        assert not bucketer.pending and sorted(results) == [0, 1, 2, 3, 4] and counter.count() == 3
        bucketer.flush()  # nothing left: no collective
        assert counter.count() == 3
    bucketer.teardown()
    per_rank = [(n + ws - 1) // ws for n in numels]
    for i, grad in enumerate(grads):
        assert results[i].shape == (per_rank[i],)
        assert torch.equal(results[i], _unbucketed(grad, ws)), i


def _check_overlap_flush_with_pending_and_discard(rank: int, ws: int) -> None:
    """A bucket flushed while an earlier fill of it is pending; a discard with pending work abandons it (no wait,
    no callback) and the next round on the same bucketer completes normally."""
    bucketer = ReduceScatterBucketer(overlap=True)
    bucketer.hold_floor_bytes = 64 * KIB
    results: Dict[int, torch.Tensor] = {}
    # 40 KiB of full gradient each, limit 64 KiB: one per fill, each sent when the next arrives.
    grads = [_grad(rank, i, 40 * KIB // 4 // ws * ws, torch.float32) for i in range(5)]
    for i in range(3):
        bucketer.reduce_scatter_flat_async(grads[i], None, callback_fn=lambda out, i=i: results.__setitem__(i, out))
    assert bucketer.pending and sorted(results) == [0]  # 1 pending, 2 in the bucket
    bucketer.flush()  # the bucket sends 2 while its previous fill (1) is pending
    assert not bucketer.pending and sorted(results) == [0, 1, 2]
    bucketer.teardown()
    # An aborted "backward": a fill was sent (pending) when the error struck; discard drops it without waiting.
    dropped: List[int] = []
    for i in range(3, 5):
        bucketer.reduce_scatter_flat_async(grads[i], None, callback_fn=lambda out, i=i: dropped.append(i))
    assert bucketer.pending
    bucketer.discard()
    assert not bucketer.pending and dropped == [] and all(b.offset == 0 for b in bucketer.buckets.values())
    bucketer.teardown()
    results.clear()
    for i in range(3):  # the next backward: nothing of the abandoned one is left or waited for
        bucketer.reduce_scatter_flat_async(grads[i], None, callback_fn=lambda out, i=i: results.__setitem__(i, out))
    bucketer.flush()
    bucketer.teardown()
    assert dropped == [] and sorted(results) == [0, 1, 2]
    for i in range(3):
        assert torch.equal(results[i], _unbucketed(grads[i], ws)), i


def _check_overlap_does_not_block(rank: int, ws: int) -> None:
    """The point of overlap: sending a fill does not wait for the slowest rank. Rank 1 joins late; rank 0's sending
    call returns at once with overlap and only after rank 1 joined without it."""
    late_s = 0.5
    for overlap in (False, True):
        bucketer = ReduceScatterBucketer(overlap=overlap)
        per_rank = -(-bucketer.hold_floor_bytes // 4 // ws)
        grad = _grad(rank, 0, per_rank * ws, torch.float32)  # reaches the hold limit alone: sent at once
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
        start = time.perf_counter()
        bucketer.reduce_scatter_flat_async(grad, None)
        send_s = time.perf_counter() - start
        bucketer.flush()
        bucketer.teardown()
        if rank == 0:
            if overlap:
                assert send_s < late_s / 2, send_s
            else:
                assert send_s > late_s / 2, send_s  # the control: synchronous, it waits for rank 1


def _check_overlap_hybrid(rank: int, ws: int) -> None:
    """A replicate group (hybrid sharding): the all-reduce runs after the deferred reduce-scatter, before the
    callbacks; results bitwise equal to the synchronous bucketer's."""
    shard, replicate = hybrid_groups(2)
    out: Dict[bool, Dict[int, torch.Tensor]] = {}
    for overlap in (False, True):
        bucketer = ReduceScatterBucketer(overlap=overlap)
        bucketer.hold_floor_bytes = 64 * KIB
        results: Dict[int, torch.Tensor] = {}
        for i in range(5):
            grad = torch.randn(16 * KIB // 4 * 2, generator=torch.Generator().manual_seed(100 * rank + i))
            bucketer.reduce_scatter_flat_async(
                grad, shard, callback_fn=lambda r, i=i: results.__setitem__(i, r), replicate_group=replicate
            )
        bucketer.flush()
        bucketer.teardown()
        out[overlap] = results
    assert sorted(out[True]) == list(range(5))
    for i in range(5):
        assert torch.equal(out[True][i], out[False][i]), i
    # The replicate all-reduce ran: both members of a replicate group hold the same (world-summed) shards.
    gathered = [torch.empty_like(out[True][0]) for _ in range(2)]
    dist.all_gather(gathered, out[True][0], group=replicate)
    assert torch.equal(gathered[0], gathered[1])


def _check_overlap_in_flight_cap(rank: int, ws: int) -> None:
    """What a pending reduction may hold is bounded: an input up to bucket_cap_mb (25 MiB when bucketing is off)
    is deferred, a larger one completes at once (its callback has run when the call returns)."""
    for cap_mb, small_mib, large_mib in ((2, 1, 3), (0, 1, 26)):
        bucketer = ReduceScatterBucketer(bucket_cap_mb=cap_mb, overlap=True)
        bucketer.hold_floor_bytes = 0  # every input reaches the hold limit alone: sent at once
        done: List[int] = []
        assert bucketer.in_flight_cap_bytes == (cap_mb or 25) * MIB
        for i, mib in enumerate((small_mib, large_mib)):
            grad = _grad(rank, i, mib * MIB // 4 // ws * ws, torch.float32)
            bucketer.reduce_scatter_flat_async(grad, None, callback_fn=lambda out, i=i: done.append(i))
            if i == 0:
                assert bucketer.pending and done == [], f"cap {cap_mb}: a {mib} MiB input must be deferred"
        assert not bucketer.pending and done == [0, 1], f"cap {cap_mb}: a {large_mib} MiB input must complete"
        bucketer.flush()
        bucketer.teardown()


def _overlap_body(rank: int, ws: int) -> None:
    _check_overlap_defers_completion(rank, ws)
    _check_overlap_in_flight_cap(rank, ws)
    _check_overlap_flush_with_pending_and_discard(rank, ws)
    if ws >= 2:
        _check_overlap_does_not_block(rank, ws)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_overlap_defers_completion(world_size: int) -> None:
    run_distributed(_overlap_body, world_size, timeout=120)


def test_overlap_hybrid() -> None:
    run_distributed(_check_overlap_hybrid, 4, timeout=120)
