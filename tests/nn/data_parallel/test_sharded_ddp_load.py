# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel.load_state_dict is all or nothing (``nn.Module``'s copies what fits, then raises)."""

import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS


def _failed_load(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in sdp.state_dict().items()}
    spoiled = {k: torch.zeros_like(v) for k, v in before.items()}
    spoiled["module.2.bias"] = torch.zeros(3)  # the last entry: torch would have copied every other one first
    try:
        sdp.load_state_dict(spoiled)
    except RuntimeError as e:
        assert "size mismatch for module.2.bias" in str(e), e
    else:
        raise AssertionError("a dict of another shape loaded")
    for key, value in sdp.state_dict().items():
        assert torch.equal(value, before[key]), key
    spoiled["module.2.bias"] = torch.zeros(2)
    assert sdp.load_state_dict(spoiled).missing_keys == []
    assert all(not v.any() for v in sdp.state_dict().values())
    sdp(torch.ones(4, 3)).sum().backward()  # still trains


def test_failed_load_changes_nothing() -> None:
    run_distributed(_failed_load, 2)
