# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""torch ``DistributedDataParallel`` around a plain module that holds FSDP instances (found in session 28).

DDP given an FSDP instance itself is refused in its constructor (test_fsdp_misuse.py). Given a plain module that
holds one, DDP's constructor broadcast rank 0's shards over the other ranks' and its backward mixed the gradients of
different shards: training went on, silently wrong (as upstream). Now the root's first forward inside DDP raises on
every rank when DDP syncs FSDP parameters, even with DDP's ranks each holding another shard index (DDP across
"nodes" around FSDP within a "node": a hand-made hybrid sharding, which trained wrong too) and with DDP of one rank
(wrong too). DDP told to ignore the FSDP parameters stays allowed and trains as plain DDP over the whole world does.

One world of 4 ranks: FSDP groups {0, 1} and {2, 3}, DDP groups {0, 2} and {1, 3}.
"""

import functools
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 4
TIMEOUT = 120.0
STEPS = 3


def _plain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def _reference() -> List[torch.Tensor]:
    """One process: the mean over the 4 ranks' losses, which is what DDP's averaged gradients train."""
    model = _plain()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optim.zero_grad()
        (sum(model(_batch(step, r)).pow(2).mean() for r in range(WORLD)) / WORLD).backward()
        optim.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(ddp: DDP, rank: int) -> None:
    optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        optim.zero_grad()
        ddp(_batch(step, rank)).pow(2).mean().backward()
        optim.step()


def _full_params(model: nn.Sequential) -> List[torch.Tensor]:
    inner = model[0]
    with inner.summon_full_params():
        first = [p.detach().clone() for p in inner.module.parameters()]
    return first + [p.detach().clone() for p in model[2].parameters()]


def _assert_trains_as_ddp_over_the_world(model: nn.Sequential) -> None:
    for got, want in zip(_full_params(model), _reference()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _with_fsdp(group: Any) -> nn.Sequential:
    model = _plain()
    model[0] = FSDP(model[0], process_group=group)
    return model


def _case_same_group_is_refused(rank: int, groups: dict) -> None:
    model = _with_fsdp(dist.group.WORLD)
    ddp = DDP(model)
    for _ in range(2):  # refused at every forward, not only the first
        with pytest.raises(
            TypeError, match=r"DistributedDataParallel wraps a module that holds FullyShardedDataParallel"
        ):
            ddp(_batch(0, rank))


def _case_hybrid_and_one_rank_groups_are_refused(rank: int, groups: dict) -> None:
    # DDP across the "nodes" ({0, 2}, {1, 3}) around FSDP within each ({0, 1}, {2, 3}): each DDP rank holds another
    # shard index, and yet DDP's hooks reduce the full gradient before FSDP reduce-scatters it (the weights ended
    # 0.03 off plain DDP's after 3 steps when this was allowed).
    ddp = DDP(_with_fsdp(groups["fsdp"]), process_group=groups["ddp"])
    with pytest.raises(TypeError, match=r"wraps a module that holds .* use FSDP's hybrid sharding"):
        ddp(_batch(0, rank))
    # A DDP group of one rank around an FSDP group of one: wrong too (the weights ended 0.05 off when allowed).
    ddp = DDP(_with_fsdp(groups["self"]), process_group=groups["self"])
    with pytest.raises(TypeError, match=r"wrong even in a group of one rank"):
        ddp(_batch(0, rank))


class _Ignoring(nn.Sequential):
    """DDP leaves out the parameters its module names here (torch's documented hook): FSDP reduces those."""

    _ddp_params_and_buffers_to_ignore = ["0._fsdp_wrapped_module.flat_param_0"]


def _case_ignored_fsdp_parameters_train(rank: int, groups: dict) -> None:
    model = _with_fsdp(dist.group.WORLD)
    model.__class__ = _Ignoring
    assert set(_Ignoring._ddp_params_and_buffers_to_ignore) <= {n for n, _ in model.named_parameters()}
    _train(DDP(model), rank)
    _assert_trains_as_ddp_over_the_world(model)


def _body(rank: int, world_size: int) -> None:
    # Every rank creates every group, in the same order.
    fsdp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    own = [dist.new_group([r]) for r in range(world_size)]
    groups = {"fsdp": fsdp_groups[rank // 2], "ddp": ddp_groups[rank % 2], "self": own[rank]}
    run_cases(
        [
            ("same_group_is_refused", functools.partial(_case_same_group_is_refused, rank, groups)),
            (
                "hybrid_and_one_rank_groups_are_refused",
                functools.partial(_case_hybrid_and_one_rank_groups_are_refused, rank, groups),
            ),
            ("ignored_fsdp_parameters_train", functools.partial(_case_ignored_fsdp_parameters_train, rank, groups)),
        ]
    )


def test_ddp_around_a_module_holding_fsdp() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
