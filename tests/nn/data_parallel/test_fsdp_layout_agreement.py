# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Ranks whose FSDP instances hold different parameters or collective settings: one clear error on every rank.

Before the first-forward check described them, each of these cases ended in a gloo abort of the whole process
(SIGABRT: another hidden size, ``flatten_parameters``, ``mixed_precision``, ``fp32_reduce_scatter``), a hang
(``reshard_after_forward`` or the prefetch flags on a nested instance) or, with the same number of elements in other
shapes, in silently wrong training; a layer frozen on one rank only hung or aborted too. The check rides in the root's existing first-forward gather: the control case
counts the collectives.
"""

import functools
from typing import Any, Dict, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import hybrid_groups

WORLD = 2
# Every world here either trains a few steps or raises at the first forward: a hang is the failure mode.
TIMEOUT = 60.0


class _Block(nn.Module):
    """A linear layer and one extra parameter of the given shape (what differs between ranks in some cases)."""

    def __init__(self, shape: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(*shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.extra.mean()


def _net(inner: Dict[str, Any], root: Dict[str, Any], shape: Optional[Any] = None) -> FSDP:
    """input linear, a nested FSDP block (``inner`` kwargs, extra parameter of ``shape``), a head."""
    torch.manual_seed(0)
    block = FSDP(_Block(shape or (8, 12)), **inner)
    return FSDP(nn.Sequential(nn.Linear(4, 8), block, nn.Linear(8, 2)), **root)


def _step(model: FSDP) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()


def _expect_disagreement(inner: Dict[str, Any], root: Dict[str, Any], *needles: str, shape: Any = None) -> None:
    model = _net(inner, root, shape)
    for attempt in range(2):  # a retry raises again (the check is not skipped the second time, so no hang either)
        with pytest.raises(RanksDisagreeError) as info:
            _step(model)
        msg = str(info.value)
        for needle in ("differs between global rank 0 and global rank 1", "on every rank") + needles:
            assert needle in msg, f"attempt {attempt}: {needle!r} not in: {msg}"


def _per_rank(name: str, values: Any) -> Dict[str, Any]:
    return {name: values[dist.get_rank()]}


def _case_setting(where: str, name: str, values: Any, common: Optional[Dict[str, Any]] = None) -> None:
    kwargs = dict(common or {}, **_per_rank(name, values))
    inner, root = (kwargs, {}) if where == "inner" else ({}, kwargs)
    path = "1" if where == "inner" else "<root>"
    _expect_disagreement(inner, root, f"instance at {path}", f"{name}: {values[0]} vs {values[1]}")


def _case_hidden_size() -> None:
    shape = (8, 12) if dist.get_rank() == 0 else (8, 16)
    _expect_disagreement({}, {}, "instance at 1", "(8, 12)", "(8, 16)", shape=shape)


def _case_same_numel_other_shapes() -> None:
    # 8 x 12 and 12 x 8: the flat parameters have the same size, so the collectives would succeed and train garbage.
    shape = (8, 12) if dist.get_rank() == 0 else (12, 8)
    _expect_disagreement({}, {}, "instance at 1", "original shapes", shape=shape)


def _case_frozen_on_one_rank() -> None:
    # The nested block frozen on rank 1 only: its gradient would be reduce-scattered on rank 0 alone (a hang until
    # the timeout, or a gloo abort when the next collective meets it).
    torch.manual_seed(0)
    block = _Block((8, 12))
    if dist.get_rank() == 1:
        block.requires_grad_(False)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), FSDP(block), nn.Linear(8, 2)))
    with pytest.raises(RanksDisagreeError, match=r"instance at 1 .*requires_grad True vs False \(frozen on one rank"):
        _step(model)


def _case_same_everything_trains() -> None:
    model = _net({"flatten_parameters": False, "mixed_precision": True}, {"mixed_precision": True})
    with count_collectives() as counter:
        _step(model)
    # The layouts travel in the one object gather the first forward already made: no collective more.
    assert counter.count("all_gather_object", phase="init") == 1, counter.summary()
    _step(model)


def _case_rank_local_instances_may_differ() -> None:
    # Upstream's MoE experts: an instance sharded over a one-rank group never meets the others' in a collective.
    solo = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
    shape = (8, 12) if dist.get_rank() == 0 else (8, 16)
    model = _net({"process_group": solo, "flatten_parameters": dist.get_rank() == 0}, {}, shape)
    for _ in range(2):
        _step(model)


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("hidden size", _case_hidden_size),
            ("same numel, other shapes", _case_same_numel_other_shapes),
            ("flatten_parameters", functools.partial(_case_setting, "inner", "flatten_parameters", (True, False))),
            ("mixed_precision", functools.partial(_case_setting, "root", "mixed_precision", (False, True))),
            (
                "fp32_reduce_scatter",
                functools.partial(
                    _case_setting, "inner", "fp32_reduce_scatter", (True, False), {"mixed_precision": True}
                ),
            ),
            (
                "reshard_after_forward",
                functools.partial(_case_setting, "inner", "reshard_after_forward", (True, False)),
            ),
            ("bucket_cap_mb", functools.partial(_case_setting, "root", "bucket_cap_mb", (0, 25))),
            ("backward_prefetch", functools.partial(_case_setting, "inner", "backward_prefetch", (True, False))),
            ("forward_prefetch", functools.partial(_case_setting, "root", "forward_prefetch", (True, False))),
            ("frozen on one rank", _case_frozen_on_one_rank),
            ("same settings: trains, no extra collective", _case_same_everything_trains),
            ("rank-local instances may differ", _case_rank_local_instances_may_differ),
        ]
    )


def test_ranks_with_different_layouts_raise_the_same_error() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)


def _hybrid_body(rank: int, world_size: int) -> None:
    # Two "nodes" of two ranks: each node agrees with itself, but the second node's replicas have another hidden
    # size. Only a gather over the whole world sees it (the shard groups alone would not); before, the replicate
    # all-reduce of shards of other sizes aborted gloo.
    shard, replicate = hybrid_groups(2)
    kwargs = {"process_group": shard, "replicate_process_group": replicate}
    shape = (8, 12) if rank < 2 else (8, 16)
    model = _net(dict(kwargs), dict(kwargs), shape)
    with pytest.raises(RanksDisagreeError, match=r"instance at 1 differs between global rank 0 and global rank 2"):
        _step(model)


def test_hybrid_replicas_with_different_layouts_raise_the_same_error() -> None:
    run_distributed(_hybrid_body, 4, timeout=TIMEOUT)
