# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of the small multi-process runner used by the fairscale.internal tests."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from _mp import run_world


def _ok(rank: int, ws: int) -> None:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == ws * (ws - 1) / 2


def test_world_runs_all_ranks() -> None:
    run_world(_ok, 3)


def _raise_on_rank_1(rank: int, ws: int) -> None:
    if rank == 1:
        raise KeyError("broken on purpose")
    dist.barrier()  # the others wait for rank 1 forever: the runner must end them


def test_failing_rank_is_reported_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)^\[rank 1\] Traceback.*KeyError: 'broken on purpose'"):
        run_world(_raise_on_rank_1, 3, timeout=30)
    assert time.monotonic() - start < 15


def _hang(rank: int, ws: int) -> None:
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def test_hanging_world_times_out() -> None:
    with pytest.raises(RuntimeError, match=r"timed out; ranks \[0, 1\] did not finish"):
        run_world(_hang, 2, timeout=2)


def _skip_on_rank_0(rank: int, ws: int) -> None:
    if rank == 0:
        pytest.skip("nothing to do here")
    dist.barrier()


def test_skip_in_rank_skips() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"\[rank 0\] nothing to do here"):
        run_world(_skip_on_rank_0, 2, timeout=30)


def _die(rank: int, ws: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_dead_rank_is_reported() -> None:
    with pytest.raises(RuntimeError, match=r"\[rank 1\] process died without reporting \(exit code 3\)"):
        run_world(_die, 2, timeout=30)
