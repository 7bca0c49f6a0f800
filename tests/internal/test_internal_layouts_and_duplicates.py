# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ReduceScatterBucketer takes chunks of any layout on both of its paths (bucketed and direct), and
get_process_group_cached takes a rank list with duplicates (its key already merges them)."""

from typing import Dict

import torch
import torch.distributed as dist

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.parallel import get_process_group_cached
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer


def _chunks(rank: int, ws: int) -> list:
    # Transposed (non-contiguous) chunks: rank r's chunk for destination d is (base + 100 d) * (r + 1), transposed.
    return [((torch.arange(6.0).view(2, 3) + 100 * d) * (rank + 1)).t() for d in range(ws)]


def _layout_body(rank: int, ws: int) -> None:
    expected = ((torch.arange(6.0).view(2, 3) + 100 * rank) * sum(r + 1 for r in range(ws))).t()
    for cap in (1, 0):  # 0: every input goes out directly, which refused non-contiguous chunks
        for overlap in (False, True):
            got: Dict[str, torch.Tensor] = {}
            bucketer = ReduceScatterBucketer(bucket_cap_mb=cap, overlap=overlap)
            bucketer.reduce_scatter_async(_chunks(rank, ws), None, lambda t: got.__setitem__("x", t.clone()))
            bucketer.flush()
            assert got["x"].shape == expected.shape and torch.equal(got["x"], expected), (cap, overlap)
    ranks = list(range(ws)) + [ws - 1]  # a duplicate: torch's new_group refuses [0, 1, 1]
    group = get_process_group_cached(ranks=ranks)
    assert group is get_process_group_cached(ranks=list(range(ws)))
    assert dist.get_world_size(group) == ws


def test_any_chunk_layout_and_duplicate_ranks() -> None:
    run_distributed(_layout_body, 2, timeout=60)
