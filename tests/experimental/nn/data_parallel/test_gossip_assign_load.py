# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``SlowMoDistributedDataParallel.load_state_dict(..., assign=True)`` assigns, as ``nn.Module``'s does.

Before, ``assign`` was accepted and dropped: the values were copied, so a model built on the ``meta`` device
"loaded" and stayed ``meta`` (no weights at all). Now the dict's tensors take the parameters' and buffers' places
(the buffers broadcast before each forward are the new ones); with SGP each must keep its dtype and device, or the
load is refused before anything changes.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

from typing import Dict

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import SlowMoBaseAlgorithm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.errors import FairscaleValueError

TIMEOUT = 60.0


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))


def _checkpoint() -> Dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = _net().state_dict()
    state["1.running_mean"] = torch.arange(3.0)  # buffers with values of their own
    return {k: v.clone() for k, v in state.items()}


def _meta_world(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        inner = _net()
    model = gossip.SlowMoDistributedDataParallel(inner, nprocs_per_node=1)
    state = {"module." + k: v for k, v in _checkpoint().items()}
    model.load_state_dict(state, assign=True)
    # The reference: plain nn.Module built on meta, loaded the same way.
    with torch.device("meta"):
        reference = _net()
    reference.load_state_dict(_checkpoint(), assign=True)
    for (name, value), (_, expected) in zip(model.module.state_dict().items(), reference.state_dict().items()):
        assert not value.is_meta, name
        assert torch.equal(value, expected), name
        assert value.data_ptr() == state["module." + name].data_ptr(), name  # assigned, not copied
    # The broadcast before the forward uses the assigned buffers (the meta ones could not be broadcast), and the
    # model trains like the reference.
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(x), reference(x))
    assert torch.equal(model.module[1].running_mean, reference[1].running_mean)
    # As a submodule of a parent loaded with assign=True, too.
    with torch.device("meta"):
        parent = nn.Sequential(gossip.SlowMoDistributedDataParallel(_net(), nprocs_per_node=1))
    parent.load_state_dict({"0.module." + k: v for k, v in _checkpoint().items()}, assign=True)
    assert torch.allclose(parent(x), reference(x))


def test_slowmo_assign_load_fills_a_meta_model() -> None:
    run_distributed(_meta_world, 2, timeout=TIMEOUT)


def _sgp_world(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        nn.Linear(1, 1, bias=False), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    state = model.state_dict()
    state["module.weight"] = torch.full((1, 1), rank + 1.0)
    model.load_state_dict(state, assign=True)
    assert model.module.weight.data_ptr() == state["module.weight"].data_ptr()
    # Gossip goes on with the assigned parameter: the ranks' 1 and 2 are averaged.
    model.perform_slowmo(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.module.weight.item() == pytest.approx(1.5)
    # Another dtype is refused before anything changes (the gossip buffers were laid out for float32).
    before = model.module.weight.detach().clone()
    state = model.state_dict()
    state["module.weight"] = torch.zeros(1, 1, dtype=torch.float64)
    with pytest.raises(FairscaleValueError, match="'module.weight' is torch.float64 on cpu, but with SGP each"):
        model.load_state_dict(state, assign=True)
    assert model.module.weight.dtype == torch.float32 and torch.equal(model.module.weight, before)
    # Without assign the same dict is copied (converted), as nn.Module does.
    model.load_state_dict(state)
    assert model.module.weight.dtype == torch.float32 and model.module.weight.item() == 0.0


def test_slowmo_sgp_assign_load_keeps_dtype() -> None:
    run_distributed(_sgp_world, 2, timeout=TIMEOUT)
