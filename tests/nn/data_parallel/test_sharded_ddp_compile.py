# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``torch.compile`` of a ShardedDataParallel model on a real gloo world.

Traced, SDP's first-forward preparation re-pointed the parameters into OSS's broadcast buckets only inside the
captured graph: after the first step the ranks' parameters differed by 1e-2 and drifted further, silently. The
preparation now runs outside the compiler and the wrapped module is compiled; the run equals the uncompiled one and
the ranks stay identical.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS


def _train(compiled: bool, rank: int) -> List[Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    model = ShardedDataParallel(net, optimizer)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        run(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _body(rank: int, world_size: int) -> None:
    expected = _train(False, rank)
    torch._dynamo.reset()
    got = _train(True, rank)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
        others = [torch.empty_like(a) for _ in range(world_size)]
        dist.all_gather(others, a)
        assert all(torch.equal(o, a) for o in others), "the ranks' replicas differ"


def test_compiled_sharded_ddp_trains_as_uncompiled() -> None:
    run_distributed(_body, 2, timeout=240.0)
