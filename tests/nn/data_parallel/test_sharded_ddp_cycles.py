# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel and OSS are freed by reference counting, not left to the cycle collector.

The wrapper used to sit in a reference cycle (wrapper -> gradient reducer -> the wrapper's bound
``_describe_reduction`` -> wrapper). Only the cycle collector freed it, and at interpreter exit that came after
``destroy_process_group()``: the wrapper's process group and buckets were then torn down during finalization, where
gloo aborted the process now and then (``terminate called without an active exception``). These tests drop the
objects with the collector off and check weak references to them.
A subprocess exit test was dropped: gloo's exit aborts now and then without any fairscale object alive too, so it
could only be flaky.
"""

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not inside a rank
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.fair_dev.testing.testing_memory import alive_without_cycle_collector
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 60.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, buffer: int, case: str) -> Dict[str, Any]:
    """A few steps of ShardedDataParallel + OSS; returns the objects to drop (the caller's only references)."""
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer, reduce_fp16=case == "fp16")
    for step in range(2):
        if case == "no_sync":
            with sdp.no_sync():
                sdp(_batch(step, rank)).sum().backward()
            sdp.reduce()
        else:
            sdp(_batch(step, rank)).sum().backward()
        oss.step()
        sdp.zero_grad()
    if case == "refresh":
        model[0].weight.requires_grad_(False)  # rebuilds hooks and buckets at the next forward
        sdp(_batch(2, rank)).sum().backward()
        oss.step()
        sdp.eval()
        sdp(_batch(3, rank))
    return {"wrapper": sdp, "reducer": sdp._reducer, "optimizer": oss, "inner optimizer": oss.optim, "model": model}


def _freed_body(rank: int, world_size: int, buffer: int, case: str) -> List[str]:
    return alive_without_cycle_collector(_train(rank, buffer, case))


@pytest.mark.parametrize(
    "buffer,case",
    [(2**20, "plain"), (0, "plain"), (0, "fp16"), (2**20, "no_sync"), (2**20, "refresh")],
    ids=["buckets", "no buckets", "reduce_fp16", "no_sync and reduce", "freeze and eval"],
)
def test_dropped_wrapper_and_optimizer_are_freed_without_the_cycle_collector(buffer: int, case: str) -> None:
    alive = run_distributed(_freed_body, 2, buffer, case, timeout=TIMEOUT)
    assert alive == [[], []], f"still alive after del with gc disabled (rank 0, rank 1): {alive}"


def _hooks(param: torch.Tensor) -> int:
    # torch keeps the post-accumulate-grad hooks in this dict (None before the first one is registered).
    return len(getattr(param, "_post_accumulate_grad_hooks", None) or {})


def _rewrap_body(rank: int, world_size: int) -> List[int]:
    """Wrap the same model three times, dropping each wrapper: only the live wrapper's hooks stay on the
    parameters, and the model then trains plainly with no hook left."""
    model = _mlp()
    counts = []
    for step in range(3):
        oss = OSS(model.parameters(), lr=0.1)
        sdp = ShardedDataParallel(model, oss)
        sdp(_batch(step, rank)).sum().backward()
        oss.step()
        counts.append(sum(_hooks(p) for p in model.parameters()))
        del sdp, oss
    counts.append(sum(_hooks(p) for p in model.parameters()))
    model(_batch(3, rank)).sum().backward()
    return counts


def test_dropped_wrapper_takes_its_hooks_off_the_parameters() -> None:
    params = len(list(_mlp().parameters()))
    for counts in run_distributed(_rewrap_body, 2, timeout=TIMEOUT):
        assert counts == [params, params, params, 0], counts


def test_deep_copy_still_works_and_describes_the_copy() -> None:
    # The reducer holds the wrapper's method weakly now; a deep copy (one process, no group) must still work, as
    # with the strong method before, and the copy's reducer must describe the copy, not the original.
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss)
    sdp(_batch(0, 0)).sum().backward()
    oss.step()
    clone = copy.deepcopy(sdp)
    describe = clone._reducer._describe()
    assert describe is not None and describe.__self__ is clone
    assert describe() == sdp._describe_reduction()
