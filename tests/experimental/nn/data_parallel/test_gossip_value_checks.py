# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo and the gossip graphs refuse values that used to be accepted and then failed late or silently.

* ``slowmo_lr`` / ``slowmo_momentum`` of NaN, inf or below 0 (every parameter became NaN at the first slow-momentum
  step; torch's SGD, the slow step's reference, refuses negative ones).
* ``nprocs_per_node`` / ``process_world_size`` and the graphs' sizes that are not integers (a float or a string
  failed deep inside group creation, or in ``range()`` after the range checks let it through).
* Sparse gradients with ``nprocs_per_node > 1`` (torch's reshape error from the end of backward, naming nothing).

Checks that fire before any process group is needed run in this process; the others in gloo worlds started by the
test engine, with module-level bodies (so the file also passes with ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import math
from typing import Any, Dict, Type

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import GraphManager
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

TIMEOUT = 60.0


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


def _no_process_group() -> None:
    assert not dist.is_initialized(), "these checks must run without a default process group"


# ---- slowmo_lr / slowmo_momentum


@pytest.mark.parametrize(
    "name, value",
    [
        ("slowmo_lr", math.nan),
        ("slowmo_lr", math.inf),
        ("slowmo_lr", -1.0),
        ("slowmo_momentum", math.nan),
        ("slowmo_momentum", -math.inf),
        ("slowmo_momentum", -2.0),
    ],
)
def test_slowmo_rejects_non_finite_or_negative_lr_and_momentum(name: str, value: float) -> None:
    _no_process_group()  # refused before any group is created
    with pytest.raises(FairscaleValueError, match=f"{name} must be a finite number >= 0, got {value!r}"):
        gossip.SlowMoDistributedDataParallel(
            _model(), nprocs_per_node=1, process_rank=0, process_world_size=1, **{name: value}
        )


def _slow_step(rank: int, world_size: int, lr: float, momentum: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        nn.Linear(2, 1), nprocs_per_node=1, slowmo_lr=lr, slowmo_momentum=momentum, slowmo_frequency=1
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2) * (rank + 1)).sum().backward()
    optimizer.step()
    model.perform_slowmo(optimizer)
    return model.module.weight.detach().clone()


def _lr_and_momentum_world(rank: int, world_size: int) -> None:
    # The same NaN on every rank: each rank raises the value's own error (before: NaN weights after one step).
    with pytest.raises(FairscaleValueError, match="slowmo_lr must be a finite number >= 0, got nan"):
        _slow_step(rank, world_size, math.nan, 0.5)
    with pytest.raises(FairscaleValueError, match="slowmo_momentum must be a finite number >= 0, got -0.5"):
        _slow_step(rank, world_size, 1.0, -0.5)
    # The bounds themselves are accepted and give finite weights.
    for lr, momentum in [(0.0, 0.5), (1.5, 0.0)]:
        assert torch.isfinite(_slow_step(rank, world_size, lr, momentum)).all()


def test_slowmo_lr_and_momentum_checked_on_every_rank() -> None:
    run_distributed(_lr_and_momentum_world, 2, timeout=TIMEOUT)


# ---- integer sizes


@pytest.mark.parametrize("value", [2.0, 1.5, "2"])
def test_slowmo_nprocs_per_node_must_be_an_integer(value: Any) -> None:
    _no_process_group()
    with pytest.raises(FairscaleTypeError, match=f"nprocs_per_node must be an integer, got {value!r}"):
        gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=value, process_rank=0, process_world_size=2)


def _sizes_world(rank: int, world_size: int) -> None:
    # A float nprocs_per_node failed inside group creation, after the global group was made (a TypeError from
    # range()); a string one at "<" before the agreement check.
    for kwargs in (
        {"nprocs_per_node": 2.0},
        {"nprocs_per_node": "2"},
        {"nprocs_per_node": 1, "process_world_size": 2.0},
    ):
        if "process_world_size" in kwargs:
            kwargs["process_rank"] = rank
        name = "process_world_size" if "process_world_size" in kwargs else "nprocs_per_node"
        with pytest.raises(FairscaleTypeError, match=f"{name} must be an integer, got {kwargs[name]!r}"):
            gossip.SlowMoDistributedDataParallel(_model(), **kwargs)
    # A graph's peers_per_itr set later must be an integer too (1.0 passed the range check and broke the rotation).
    graph = gossip.RingGraph(rank, world_size)
    with pytest.raises(FairscaleTypeError, match="RingGraph: peers_per_itr must be an integer, got 1.0"):
        graph.peers_per_itr = 1.0  # type: ignore[assignment]


def test_slowmo_and_graph_sizes_must_be_integers_in_a_world() -> None:
    run_distributed(_sizes_world, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("graph_cls", [gossip.RingGraph, gossip.NPeerDynamicDirectedExponentialGraph])
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rank": 0, "world_size": 2.0}, "world_size"),
        ({"rank": "0", "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 2, "peers_per_itr": 1.0}, "peers_per_itr"),
        ({"rank": 0, "world_size": 2, "nprocs_per_node": 1.0}, "nprocs_per_node"),
        ({"rank": 0, "world_size": 2, "local_rank": True}, "local_rank"),
    ],
)
def test_graph_sizes_must_be_integers(graph_cls: Type[GraphManager], kwargs: Dict[str, Any], name: str) -> None:
    _no_process_group()  # refused before any edge (and its process group) is made
    with pytest.raises(FairscaleTypeError, match=f"{graph_cls.__name__}: {name} must be an integer"):
        graph_cls(**kwargs)


# ---- sparse gradients


class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 2, sparse=sparse)
        self.fc = nn.Linear(2, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def _sparse_world(rank: int, world_size: int) -> None:
    idx = torch.tensor([rank, 3])
    # Refused at construction, naming the module (before: torch's reshape error at the end of the first backward).
    with pytest.raises(FairscaleValueError, match="module 'emb' \\(Embedding with sparse=True\\) gets sparse"):
        gossip.SlowMoDistributedDataParallel(_Bag(sparse=True), nprocs_per_node=world_size)
    # Switched to sparse after construction: the backward raises on every rank, naming the parameter.
    net = _Bag(sparse=False)
    model = gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=world_size)
    net.emb.sparse = True
    with pytest.raises(FairscaleRuntimeError, match="parameter 'emb.weight' has a sparse gradient"):
        model(idx).sum().backward()
    # One process per node averages no gradients: sparse gradients are fine there, as in plain PyTorch.
    torch.manual_seed(0)
    net = _Bag(sparse=True)
    reference = _Bag(sparse=True)
    reference.load_state_dict(net.state_dict())
    gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=1)(idx).sum().backward()
    reference(idx).sum().backward()
    assert net.emb.weight.grad is not None and reference.emb.weight.grad is not None
    assert torch.equal(net.emb.weight.grad.to_dense(), reference.emb.weight.grad.to_dense())


def test_slowmo_sparse_gradients_in_a_node_raise_clearly() -> None:
    run_distributed(_sparse_world, 2, timeout=TIMEOUT)
