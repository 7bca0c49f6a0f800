# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Model/pipeline/data-parallel group layout: the ``(dp, pp, mp)`` row-major grid, getters, errors.

Real gloo worlds of 1, 2 and 4 ranks (upstream's tests ran no world at all without GPUs), plus upstream's
``test_adjacency`` with a mocked ``torch.distributed`` for a 1024-rank layout.
"""

from collections import defaultdict
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from fairscale.fair_dev.testing.engine import run_cases, run_distributed, run_ranks
from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn.model_parallel import initialize as mpu


def _expected_groups(world: int, mp: int, pp: int, rank: int) -> Dict[str, List[int]]:
    """The groups of ``rank`` computed from the grid formula r = i*pp*mp + j*mp + k."""
    i, rest = divmod(rank, pp * mp)
    j, k = divmod(rest, mp)
    dp = world // (pp * mp)
    return {
        "mp": [i * pp * mp + j * mp + kk for kk in range(mp)],
        "pp": [i * pp * mp + jj * mp + k for jj in range(pp)],
        "dp": [ii * pp * mp + j * mp + k for ii in range(dp)],
    }


def _check_layout(rank: int, world: int, requested_mp: int, pp: int) -> None:
    assert not mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(requested_mp, pp)
    try:
        assert mpu.model_parallel_is_initialized()
        mp = min(requested_mp, world)
        groups = _expected_groups(world, mp, pp, rank)
        assert mpu.get_model_parallel_world_size() == mp
        assert mpu.get_model_parallel_rank() == rank % mp
        assert mpu.get_model_parallel_src_rank() == rank - rank % mp
        assert mpu.get_data_parallel_world_size() == world // (mp * pp)
        assert mpu.get_data_parallel_rank() == rank // (pp * mp)
        assert mpu.get_pipeline_parallel_ranks() == groups["pp"]
        assert list(collectives.group_ranks(mpu.get_model_parallel_group())) == groups["mp"]
        assert list(collectives.group_ranks(mpu.get_data_parallel_group())) == groups["dp"]
        assert list(collectives.group_ranks(mpu.get_pipeline_parallel_group())) == groups["pp"]
        # The groups communicate among exactly those ranks.
        for name, getter in (("mp", mpu.get_model_parallel_group), ("dp", mpu.get_data_parallel_group)):
            t = torch.tensor([float(rank)])
            collectives.all_reduce(t, group=getter())
            assert t.item() == float(sum(groups[name])), name
    finally:
        mpu.destroy_model_parallel()
    assert not mpu.model_parallel_is_initialized()


def _check_errors(rank: int, world: int) -> None:
    with pytest.raises(AssertionError, match="model parallel group is not initialized"):
        mpu.get_model_parallel_group()
    with pytest.raises(AssertionError, match="data parallel group is not initialized"):
        mpu.get_data_parallel_rank()
    with pytest.raises(AssertionError, match="pipeline parallel group is not initialized"):
        mpu.get_pipeline_parallel_ranks()
    if world == 4:
        with pytest.raises(AssertionError, match="4 is not divisible by 3"):
            mpu.initialize_model_parallel(3)
        with pytest.raises(AssertionError, match="4 is not divisible by 6"):
            mpu.initialize_model_parallel(2, 3)
    mpu.initialize_model_parallel(1)
    try:
        with pytest.raises(AssertionError, match="data parallel group is already initialized"):
            mpu.initialize_model_parallel(1)
    finally:
        mpu.destroy_model_parallel()


def _check_failed_call_leaves_nothing(rank: int, world: int) -> None:
    # A backend that cannot make groups failed after the data-parallel group was set: a retry then said "data
    # parallel group is already initialized" while model_parallel_is_initialized() said False.
    with pytest.raises(Exception, match="foo"):
        mpu.initialize_model_parallel(1, model_parallel_backend="foo")
    assert not mpu.model_parallel_is_initialized() and mpu._DATA_PARALLEL_GROUP is None
    # Integers of numpy's (a size read from a config array) are whole numbers, as upstream took them.
    mpu.initialize_model_parallel(np.int64(world), np.int64(1))
    try:
        assert mpu.get_model_parallel_world_size() == world
    finally:
        mpu.destroy_model_parallel()


def _check_layers_of_other_groups_are_refused(rank: int, world: int) -> None:
    # A layer built before destroy_model_parallel() + initialize_model_parallel(another size) ran on with its old
    # partition against the new group (width 4 for out_features=8), silently.
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

    mpu.initialize_model_parallel(world)
    try:
        layer = ColumnParallelLinear(4, 8, gather_output=True)
        row = RowParallelLinear(8, 4)
        assert layer(torch.ones(2, 4)).shape == (2, 8)
    finally:
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(world)  # the same groups again: the layer still fits
    try:
        assert layer(torch.ones(2, 4)).shape == (2, 8)
    finally:
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1)
    try:
        if world > 1:
            with pytest.raises(RuntimeError, match=rf"built for a model-parallel group of {world} rank"):
                layer(torch.ones(2, 4))
            # get_master_weight() too (it returned this rank's partition, or a gather over other ranks)
            for each in (layer, row):
                with pytest.raises(RuntimeError, match=rf"built for a model-parallel group of {world} rank"):
                    each.get_master_weight()
        assert ColumnParallelLinear(4, 8, gather_output=True)(torch.ones(2, 4)).shape == (2, 8)
    finally:
        mpu.destroy_model_parallel()
    # With the groups gone, a load of another shape still says torch's "size mismatch" (the hint reads the size the
    # layer was built for; it asked the groups, and failed with "not initialized": found by the session's review).
    with pytest.raises(RuntimeError, match=rf"size mismatch for weight(.|\n)*partition \({8 // world}, 4\)"):
        layer.load_state_dict({"weight": torch.ones(3, 4), "bias": torch.ones(8 // world)})


def _layouts_body(rank: int, world_size: int) -> None:
    configs = [(m, p) for m in (1, 2, 4, 8) for p in (1, 2, 4) if m * p <= 4 * world_size]
    cases = []
    for requested_mp, pp in configs:
        if world_size % (min(requested_mp, world_size) * pp) == 0:
            cases.append(
                (f"mp={requested_mp},pp={pp}", lambda m=requested_mp, p=pp: _check_layout(rank, world_size, m, p))
            )
    cases.append(("errors", lambda: _check_errors(rank, world_size)))
    cases.append(("failed call leaves nothing", lambda: _check_failed_call_leaves_nothing(rank, world_size)))
    cases.append(("layers of other groups", lambda: _check_layers_of_other_groups_are_refused(rank, world_size)))
    run_cases(cases)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_initialize_model_parallel(world_size: int) -> None:
    run_distributed(_layouts_body, world_size)


def _case_other_sizes(rank: int) -> None:
    # Rank 0 asks for model parallel size 1, the other rank for 2: before, the ranks created other groups and
    # new_group() waited forever (the group timeout did not end it).
    with collectives.count_collectives() as counter:
        with pytest.raises(RanksDisagreeError, match=r"initialize_model_parallel: .* differ between ranks"):
            mpu.initialize_model_parallel(1 if rank == 0 else 2)
    assert not mpu.model_parallel_is_initialized()
    # Compared through the rendezvous store, not a collective: an NCCL group's object gather would run on the
    # current CUDA device, cuda:0 on every rank of Llama's code, which calls this before selecting its GPU.
    assert counter.count() == 0, counter


def _case_an_invalid_size_on_one_rank(rank: int) -> None:
    # Before: rank 0 raised its ValueError alone and rank 1 waited in the comparison for it.
    with pytest.raises(RanksDisagreeError, match=r"entry 0: 2 vs '1.5'"):
        mpu.initialize_model_parallel(1.5 if rank == 1 else 2)
    assert not mpu.model_parallel_is_initialized()


def _case_initialized_on_some_ranks(rank: int) -> None:
    mpu.initialize_model_parallel(2)
    if rank == 0:
        mpu.destroy_model_parallel()  # local: rank 0 alone forgets its groups
    try:
        # Before: rank 1 raised "already initialized" while rank 0 went on creating groups and waited forever.
        with pytest.raises(RanksDisagreeError, match=r"groups already initialized\) differ between ranks"):
            mpu.initialize_model_parallel(2)
    finally:
        mpu.destroy_model_parallel()


def _disagreement_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("other sizes", lambda: _case_other_sizes(rank)),
            ("an invalid size on one rank", lambda: _case_an_invalid_size_on_one_rank(rank)),
            ("initialized on some ranks", lambda: _case_initialized_on_some_ranks(rank)),
            ("the same arguments still work", lambda: _check_layout(rank, world_size, 2, 1)),
        ]
    )


def test_ranks_that_disagree_raise_the_same_error() -> None:
    run_distributed(_disagreement_body, 2, timeout=60)


_SHORT_TIMEOUT_S = 3.0


def _group_timeout_body(directory: str, rank: int) -> List[float]:
    import atexit
    import os
    import time

    from fairscale.fair_dev.testing.engine import init_gloo_world

    init_gloo_world(directory, rank, 2, timeout_s=_SHORT_TIMEOUT_S)
    mpu.initialize_model_parallel(2)
    flag = os.path.join(directory, "rank0-done")
    if rank == 1:  # alive, never joining rank 0's collective
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return []
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError):
            collectives.all_reduce(torch.ones(1), group=mpu.get_model_parallel_group())
    finally:
        open(flag, "w").close()
    atexit.register(os._exit, 0)  # gloo aborts at exit when a group whose collective timed out is torn down
    return [time.monotonic() - start]


def test_groups_inherit_the_default_groups_timeout(tmp_path: Any) -> None:
    """The groups took torch's default (30 minutes for gloo), not ``init_process_group(timeout=...)``: a rank that
    skipped a collective kept the others waiting until its process ended (found by a fuzz)."""
    import functools

    (waited,) = run_ranks(functools.partial(_group_timeout_body, str(tmp_path)), 2, timeout=40.0)[0]
    assert _SHORT_TIMEOUT_S * 0.5 <= waited < _SHORT_TIMEOUT_S + 4.0, waited


class _MockDistributed:
    """A stand-in for ``torch.distributed`` that records the rank lists of ``new_group``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.groups: List[List[int]] = []

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: Any = None) -> int:
        return self.world_size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def new_group(self, args: List[int], backend: Any = None) -> Any:
        self.groups.append(list(args))
        return ()


def test_adjacency(monkeypatch: Any) -> None:
    """Upstream's check at 1024 ranks: 256 contiguous MP groups of 4, 128 PP groups of 8, 32 DP groups of 32."""
    model_parallel_size, pipeline_length, data_parallel_size = 4, 8, 32
    mock = _MockDistributed(model_parallel_size * pipeline_length * data_parallel_size)
    monkeypatch.setattr(torch, "distributed", mock)
    try:
        mpu.initialize_model_parallel(model_parallel_size, pipeline_length)
    finally:
        mpu.destroy_model_parallel()
    by_size: Dict[int, List[List[int]]] = defaultdict(list)
    for ranks in mock.groups:
        by_size[len(ranks)].append(ranks)
    assert set(by_size) == {model_parallel_size, pipeline_length, data_parallel_size}
    assert len(by_size[model_parallel_size]) == pipeline_length * data_parallel_size
    assert len(by_size[data_parallel_size]) == model_parallel_size * pipeline_length
    assert len(by_size[pipeline_length]) == model_parallel_size * data_parallel_size
    for ranks in by_size[model_parallel_size]:
        assert ranks == list(range(ranks[0], ranks[0] + model_parallel_size))
    # Creation order: all DP groups, then all MP groups, then all PP groups.
    sizes = [len(r) for r in mock.groups]
    n_dp, n_mp = model_parallel_size * pipeline_length, pipeline_length * data_parallel_size
    assert sizes[:n_dp] == [data_parallel_size] * n_dp
    assert sizes[n_dp : n_dp + n_mp] == [model_parallel_size] * n_mp


def test_eight_rank_example() -> None:
    """The docstring's example, ws=8, mp=2, pp=2, from the grid formula."""
    assert _expected_groups(8, 2, 2, 5) == {"mp": [4, 5], "pp": [5, 7], "dp": [1, 5]}


def _fake_world_body(rank: int) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # torch's single-process stand-in for a world of 4 (tracing, tests): no other rank exists to compare with.
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mpu.initialize_model_parallel(2)
        return mpu.get_model_parallel_world_size()
    finally:
        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_the_fake_backend_skips_the_comparison() -> None:
    # The store comparison raised from torch's FakeStore ("Not implemented"); a store of one process would wait.
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    assert run_ranks(_fake_world_body, 1) == [2]
