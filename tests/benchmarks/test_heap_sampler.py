# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The main job's CPU memory method: the C heap in use, sampled on a thread (benchmarks/_fsdp_bench/heap.py)."""

import os
import sys
import threading

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.heap import HeapSampler, heap_in_use  # noqa: E402

MIB = 2**20
needs_glibc = pytest.mark.skipif(heap_in_use() is None, reason="glibc mallinfo2 is not available (not glibc >= 2.33)")


@needs_glibc
def test_sampler_sees_a_short_lived_tensor_freed_before_exit() -> None:
    before = heap_in_use()
    assert before is not None
    with HeapSampler() as sampler:
        big = torch.ones(16 * MIB // 4)  # 16 MiB, written so the pages are real
        threading.Event().wait(0.02)  # several sample intervals
        del big
    after = heap_in_use()
    assert after is not None
    assert sampler.peak - before >= 15 * MIB
    assert after - before < 4 * MIB  # the tensor's memory went back


@needs_glibc
def test_heap_counts_tensors_of_other_threads() -> None:
    """What the profiler's events cannot see: memory a worker thread allocates (as gloo does for its scratch)."""
    before = heap_in_use()
    holder = []
    worker = threading.Thread(target=lambda: holder.append(torch.ones(8 * MIB // 4)))
    worker.start()
    worker.join()
    now = heap_in_use()
    assert before is not None and now is not None
    assert now - before >= 7 * MIB
    holder.clear()


def test_run_figures_take_the_largest_peak_and_the_median_steady_state() -> None:
    """A sampled peak can only be missed (the largest rank's), a steady reading inflated on one rank by a buffer
    torch has not released yet (the median rank's); the profiler's events only inflate (the smallest rank's)."""
    from _fsdp_bench.heap import HEAP_METHOD_PREFIX
    from _fsdp_bench.results import _rank_summary

    heap, profiler = HEAP_METHOD_PREFIX + " (main arena + mmap)", "torch profiler CPU allocator events"
    readings = [370_000, 790_000, 366_000, 367_000, None]  # one rank inflated, one without a figure
    assert _rank_summary(readings, heap) == 790_000
    assert _rank_summary(readings, heap, steady=True) == 367_000
    assert _rank_summary(readings, profiler) == _rank_summary(readings, profiler, steady=True) == 366_000
    assert _rank_summary([None], heap, steady=True) is None
