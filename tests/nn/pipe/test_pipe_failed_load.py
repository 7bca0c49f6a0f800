# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A failed ``load_state_dict`` leaves Pipe and AsyncPipe as they were (session 37). torch's load copies every entry
that fits before raising about the others; AsyncPipe lists every entry twice (``<i>.*`` and ``partition.<i>.*``), so
even the entry the error named was overwritten through its twin."""

import copy
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.pipe import AsyncPipe, Pipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _check_failed_load_changes_nothing(pipe: Any, bad_key: str) -> None:
    before: Dict[str, torch.Tensor] = copy.deepcopy(pipe.state_dict())
    assert bad_key in before, list(before)
    shifted = {k: v + 1 for k, v in before.items()}
    shifted[bad_key] = torch.zeros(7)
    with pytest.raises(RuntimeError, match="size mismatch"):
        pipe.load_state_dict(shifted)
    after = pipe.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])
    ]
    good = {k: v + 1 for k, v in before.items()}
    pipe.load_state_dict(good)  # a good load still goes through
    assert all(torch.equal(pipe.state_dict()[k], good[k]) for k in good)


def test_pipe_failed_load_changes_nothing() -> None:
    pipe = Pipe(_model(), balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    _check_failed_load_changes_nothing(pipe, "partitions.1.2.weight")


def _async_body(rank: int, world_size: int) -> None:
    pipe = AsyncPipe(_model(), [3], group=dist.group.WORLD)
    _check_failed_load_changes_nothing(pipe, "partition.0.weight")
    # The two names of one entry with different values (a dict edited by hand or merged from two checkpoints): torch
    # loaded whichever came last, silently (session 38).
    before = copy.deepcopy(pipe.state_dict())
    disagreeing = {k: v + 1 for k, v in before.items()}
    disagreeing["0.2.weight"] = disagreeing["0.2.weight"] + 5
    with pytest.raises(RuntimeError, match="'partition.2.weight' and '0.2.weight' name the same entry"):
        pipe.load_state_dict(disagreeing)
    assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    # Twins that agree load, NaNs included (a NaN is not equal to itself): copies made apart, and a dict over the
    # model's own tensors (those are not compared at all).
    copies = {k: v.clone() for k, v in before.items()}
    for key in ("0.1.running_mean", "partition.1.running_mean"):
        copies[key][0] = float("nan")
    pipe.load_state_dict(copies)
    assert torch.isnan(pipe.state_dict()["0.1.running_mean"][0])
    pipe.load_state_dict(pipe.state_dict())


def test_async_pipe_failed_load_changes_nothing() -> None:
    run_distributed(_async_body, 1, timeout=60.0)
