# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``hybrid.check_grid`` on hand-made views: the layouts it accepts and the message of each it refuses.

The distributed tests (test_fsdp_hybrid.py) show that every rank raises the error; here every rule is exercised on
its own, without processes, including layouts that real ``new_group`` calls make awkward to build.
"""

from typing import List, Optional, Sequence, Tuple

import pytest

from fairscale.nn.data_parallel._fsdp.hybrid import HybridView, check_grid


def views(
    shards: Sequence[Tuple[int, ...]], replicas: Sequence[Tuple[int, ...]], path: str = ""
) -> List[List[HybridView]]:
    """Every rank's view of one instance, from the shard groups and replicate groups of a layout."""
    world = sum(len(s) for s in shards)
    out: List[List[HybridView]] = []
    for rank in range(world):
        shard = next(s for s in shards if rank in s)
        replicate = next(r for r in replicas if rank in r)
        problem: Optional[str] = None
        out.append([(path, shard, replicate, shard.index(rank), problem)])
    return out


def test_grids_that_tile_the_world_pass() -> None:
    check_grid(views([(0, 1), (2, 3)], [(0, 2), (1, 3)]), 4)
    check_grid(views([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]), 4)  # one node: plain full sharding
    check_grid(views([(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)]), 4)  # one rank per node: DDP
    check_grid(views([(0, 1), (2, 3), (4, 5)], [(0, 2, 4), (1, 3, 5)]), 6)
    check_grid([[], []], 2)  # no hybrid instance at all


def test_replicate_group_joining_different_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="hold shard 0 and 1"):
        check_grid(views([(0, 1), (2, 3)], [(0, 3), (1, 2)]), 4)


def test_groups_that_do_not_tile_the_world_are_refused() -> None:
    with pytest.raises(ValueError, match="does not tile the world of 4 ranks"):
        check_grid(views([(0, 1), (2, 3)], [(0,), (1,), (2,), (3,)]), 4)  # 2 x 1 ranks for a world of 4
    bad = views([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    with pytest.raises(ValueError, match=r"ranks \[4, 5, 6, 7\] have no replicate_process_group"):
        check_grid(bad, 8)  # four of eight ranks did not report
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] have no replicate_process_group"):
        check_grid(bad[:2] + [[], []], 4)


def test_members_that_disagree_on_a_group_are_refused() -> None:
    bad = views([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    bad[1] = [("", (1, 2), (1, 3), 0, None)]  # rank 1 believes its shard group is {1, 2}
    with pytest.raises(ValueError, match="process_group is"):
        check_grid(bad, 4)
    bad = views([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    bad[2] = [("", (2, 3), (2, 3), 0, None)]  # rank 2 believes its replicate group is {2, 3}
    with pytest.raises(ValueError, match="replicate_process_group is|share"):
        check_grid(bad, 4)


def test_unequal_sizes_are_refused() -> None:
    bad = views([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    bad[3] = [("", (3,), (1, 3), 0, None)]
    with pytest.raises(ValueError, match="all must be equal"):
        check_grid(bad, 4)


def test_a_problem_seen_by_one_rank_is_raised_with_its_text() -> None:
    bad = views([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    bad[3] = [("", (2, 3), (), 1, "rank 3 is not a member of the replicate_process_group it was given")]
    with pytest.raises(ValueError, match="rank 3 is not a member"):
        check_grid(bad, 4)


def test_each_instance_is_checked_and_named() -> None:
    good = views([(0, 1), (2, 3)], [(0, 2), (1, 3)], path="blocks.0")
    bad = views([(0, 1), (2, 3)], [(0, 3), (1, 2)], path="blocks.1")
    both = [g + b for g, b in zip(good, bad)]
    with pytest.raises(ValueError, match="instance blocks.1"):
        check_grid(both, 4)
