# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The box decomposition behind the zero-copy DCP save (``_fsdp/dcp_views.py``), without processes.

Every contiguous flat range of a row-major tensor is cut into at most ``2 * ndim - 1`` boxes that tile it exactly,
in flat order, and each box is a contiguous run of the flat tensor (so a view of a flat shard is the box).
"""

import itertools
import random
from typing import Tuple

import pytest
import torch

from fairscale.nn.data_parallel._fsdp.dcp_views import flat_boxes

SHAPES = [(7,), (1,), (3, 4), (4, 1), (1, 5), (2, 3, 4), (5, 1, 3), (3, 2, 1, 4), (2, 3, 4, 5)]


def _check(shape: Tuple[int, ...], a: int, b: int) -> None:
    numel = int(torch.Size(shape).numel())
    full = torch.arange(numel).view(shape)
    covered = torch.zeros(numel, dtype=torch.int64)
    position = a
    boxes = flat_boxes(shape, a, b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, a, b, boxes)
    for offsets, sizes, start in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert tuple(box.shape) == tuple(sizes) and box.numel() > 0, (shape, a, b, offsets, sizes)
        # contiguous in the flat order, starting where the previous box ended
        assert start == position and torch.equal(box.reshape(-1), torch.arange(start, start + box.numel()))
        assert torch.equal(full.reshape(-1)[start : start + box.numel()].view(sizes), box)  # the view is the box
        covered[box.reshape(-1)] += 1
        position += box.numel()
    assert position == b, (shape, a, b, boxes)
    expected = torch.zeros(numel, dtype=torch.int64)
    expected[a:b] = 1
    assert torch.equal(covered, expected), (shape, a, b)  # exactly [a, b), each element once


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_range_tiles_exactly(shape: Tuple[int, ...]) -> None:
    numel = int(torch.Size(shape).numel())
    for a, b in itertools.combinations_with_replacement(range(numel + 1), 2):
        _check(shape, a, b)


def test_shard_ranges_tile_the_tensor() -> None:
    """The ranges W equal shards cut out of a tensor (the last one padded) tile it with no element twice."""
    random.seed(0)
    for shape in [(37, 11), (5, 7, 13), (129,), (3, 5, 2, 7)]:
        numel = int(torch.Size(shape).numel())
        for world in (1, 2, 3, 4, 7, 8):
            shard = -(-numel // world)
            offset = random.randint(0, shard)  # the tensor starts somewhere inside a flat parameter
            covered = torch.zeros(numel, dtype=torch.int64)
            for r in range(world + 1):
                lo, hi = max(r * shard - offset, 0), min((r + 1) * shard - offset, numel)
                for offsets, sizes, _ in flat_boxes(shape, lo, hi) if lo < hi else []:
                    index = torch.arange(numel).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    covered[index.reshape(-1)] += 1
            assert torch.equal(covered, torch.ones(numel, dtype=torch.int64)), (shape, world)


def test_scalar_and_empty() -> None:
    assert flat_boxes((), 0, 1) == [((), (), 0)]
    assert flat_boxes((3, 4), 5, 5) == []
    assert flat_boxes((0, 4), 0, 0) == []


def test_out_of_range_raises() -> None:
    with pytest.raises(ValueError, match="not inside"):
        flat_boxes((3, 4), 2, 13)
    with pytest.raises(ValueError, match="not inside"):
        flat_boxes((3,), 2, 1)
