# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's setup steps of the fair_dev test helpers: make_cudnn_deterministic turns TF32 off, test_runner seeds
1357, dist_init sets RANK and WORLD_SIZE."""

import functools
import os
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

from fairscale.fair_dev.testing.engine import run_ranks
from fairscale.fair_dev.testing.testing import dist_init, make_cudnn_deterministic, teardown, test_runner


@pytest.fixture(autouse=True)
def restore_backend_flags() -> Iterator[None]:
    # The helpers flip process-wide flags; keep other tests unaffected.
    cudnn = torch.backends.cudnn
    saved = (cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_make_cudnn_deterministic_turns_tf32_off() -> None:
    # Before, TF32 stayed on (cuDNN's default): float32 convolutions of deterministic parity tests ran in TF32 on
    # Ampere and newer GPUs, where upstream's ran in float32.
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    make_cudnn_deterministic()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32


def _draw(rank: int, out: List[Any]) -> None:
    out.append((rank, torch.rand(3)))


def test_test_runner_deterministic_seeds_as_upstream() -> None:
    # Before, seed 0: tests comparing against values drawn after upstream's torch.manual_seed(1357) saw other numbers.
    seen: List[Any] = []
    torch.manual_seed(123)
    test_runner(2, _draw, True, seen)
    torch.manual_seed(1357)
    expected = torch.rand(3)
    assert seen[0][0] == 2 and torch.equal(seen[0][1], expected)
    assert not torch.backends.cudnn.allow_tf32


def _init_and_read_env(store: str, rank: int) -> Tuple[bool, Optional[str], Optional[str]]:
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    ok = dist_init(rank, 2, store)
    env = (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"))
    teardown()
    return ok, env[0], env[1]


def test_dist_init_sets_rank_and_world_size(tmp_path: Any) -> None:
    # Upstream sets both; code run after dist_init that read them got a KeyError.
    results = run_ranks(functools.partial(_init_and_read_env, str(tmp_path / "store")), 2, timeout=120)
    assert results == [(True, "0", "2"), (True, "1", "2")]
