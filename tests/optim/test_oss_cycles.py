# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS is freed by reference counting once dropped, whatever it went through: no reference cycle runs through it.

An optimizer left to the cycle collector keeps its process group, buckets and shard state until the collector
runs, possibly at interpreter exit after ``destroy_process_group()``, where gloo may abort the process (see
tests/nn/data_parallel/test_sharded_ddp_cycles.py, which covers OSS together with ShardedDataParallel).
"""

from typing import Any, Dict, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not inside a rank
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.fair_dev.testing.testing_memory import alive_without_cycle_collector
from fairscale.optim import OSS

TIMEOUT = 60.0


def _use(rank: int, case: str) -> Dict[str, Any]:
    """OSS through steps and the given features; returns the objects to drop (the caller's only references)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    oss = OSS(model[0].parameters(), lr=0.1, momentum=0.9, broadcast_fp16=case == "fp16")
    objects: Dict[str, Any] = {"optimizer": oss, "inner optimizer": oss.optim}
    if case == "features":
        oss.add_param_group({"params": model[2].parameters(), "lr": 0.05})
        objects["scheduler"] = torch.optim.lr_scheduler.StepLR(oss, step_size=1, gamma=0.5)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).sum().backward()
        if case == "features":
            oss.clip_grad_norm(0.5)
        oss.step()
        if "scheduler" in objects:
            objects["scheduler"].step()
        oss.zero_grad()
    if case == "features":
        oss.consolidate_state_dict(recipient_rank=-1)
        oss.load_state_dict(oss.state_dict())
        model[0].weight.requires_grad_(False)
        oss.refresh_trainable()
        model(torch.randn(3, 4)).sum().backward()
        oss.step()
    return objects


def _freed_body(rank: int, world_size: int, case: str) -> List[str]:
    return alive_without_cycle_collector(_use(rank, case))


@pytest.mark.parametrize("case", ["plain", "fp16", "features"])
def test_dropped_optimizer_is_freed_without_the_cycle_collector(case: str) -> None:
    alive = run_distributed(_freed_body, 2, case, timeout=TIMEOUT)
    assert alive == [[], []], f"still alive after del with gc disabled (rank 0, rank 1): {alive}"
