# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's slow-momentum buffers laid out lazily (the documented use: no private call before training).

``perform_slowmo`` lays them out at its first call, after a first local step, when LocalSGD's replicas differ. They
were taken from each rank's own parameters: with ``slowmo_memory_efficient=False`` every rank then stepped from its
own start, and the replicas drifted apart at every slow-momentum step, silently (a fuzz of SlowMo, session 45). They
start from the replicas' average now: the replicas stay equal, and both modes give the same parameters (the
memory-efficient mode averages inside its step, the other in LocalSGD's all-reduce).

Two gloo processes as two nodes, each with its own data, as in data-parallel training.
"""

import functools
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.fair_dev.testing.engine import run_cases, run_distributed

TIMEOUT = 60.0
UPDATES = 4


def _train(rank: int, memory_efficient: bool) -> List[torch.Tensor]:
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        nprocs_per_node=1,
        localsgd_frequency=1,  # the replicas averaged at every update
        slowmo_frequency=2,
        slowmo_momentum=0.5,
        slowmo_memory_efficient=memory_efficient,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for update in range(UPDATES):
        g = torch.Generator().manual_seed(10 * update + rank)
        F.mse_loss(model(torch.randn(4, 3, generator=g)), torch.randn(4, 2, generator=g)).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.perform_slowmo(optimizer)
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        replicas = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(replicas, mine)  # every rank sees every replica and fails alike
        for other in replicas[1:]:
            torch.testing.assert_close(other, replicas[0], rtol=0, atol=0, msg=f"replicas differ after {update + 1}")
    return [p.detach().clone() for p in model.parameters()]


def _case_modes_agree(rank: int) -> None:
    efficient, plain = _train(rank, True), _train(rank, False)
    for a, b in zip(efficient, plain):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _case_replicas_stay_equal(rank: int, memory_efficient: bool) -> None:
    _train(rank, memory_efficient)


def _world(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("replicas equal, memory efficient", functools.partial(_case_replicas_stay_equal, rank, True)),
            ("replicas equal, not memory efficient", functools.partial(_case_replicas_stay_equal, rank, False)),
            ("both modes agree", functools.partial(_case_modes_agree, rank)),
        ]
    )


def test_lazily_laid_out_slow_momentum() -> None:
    run_distributed(_world, 2, timeout=TIMEOUT)
