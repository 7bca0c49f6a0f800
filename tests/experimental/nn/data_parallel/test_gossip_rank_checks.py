# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo refuses rank numbers and gossip graphs that belong to another process, and hands the gossip thread's
errors to the main thread.

* A ``process_rank`` that is distinct and in range but not the process's own rank: the slow-momentum shard owner
  was then not the rank that received its reduce, and the slow momentum was silently lost.
* A ``graph`` (or ``mixing``) built for another rank: accepted, then the gossip thread died at its first round and
  both ranks waited 300 s for "Gossip flag timeout". Now refused at construction, on every rank.
* Any other exception in the gossip thread (which went to stderr only) is raised in the main thread at its next
  wait for a round, or at construction when the thread fails to start.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import time
from typing import Dict, List, Union

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import SlowMoBaseAlgorithm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

TIMEOUT = 60.0


def _scalar_model() -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


# ---- process_rank


def _train_slow_momentum(rank: int, process_rank: int) -> List[float]:
    """Two updates of LocalSGD with slow momentum 0.5 at every update, on one shard (rank 0 owns it)."""
    model = gossip.SlowMoDistributedDataParallel(
        _scalar_model(),
        nprocs_per_node=1,
        process_rank=process_rank,
        process_world_size=2,
        localsgd_frequency=1,
        slowmo_frequency=1,
        slowmo_momentum=0.5,
        slowmo_num_shards=1,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model._init_global_momentum_buffers(optimizer)
    weights = []
    for _ in range(2):
        optimizer.zero_grad()
        (model(torch.ones(1, 1)) * (rank + 1)).sum().backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
        weights.append(model.module.weight.item())
    return weights


def _process_rank_world(rank: int, world_size: int) -> None:
    # Swapped ranks: the same error on every rank, naming the first process whose number is not its own.
    with pytest.raises(RanksDisagreeError, match="process_rank values are \\[1, 0\\], but the process of rank 0"):
        _train_slow_momentum(rank, process_rank=1 - rank)
    # Their own ranks: the slow momentum works, as torch's SGD with momentum 0.5 on the mean gradient (1.5).
    reference = _scalar_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.5)
    expected = []
    for _ in range(2):
        optimizer.zero_grad()
        (reference(torch.ones(1, 1)) * 1.5).sum().backward()
        optimizer.step()
        expected.append(reference.weight.item())
    assert _train_slow_momentum(rank, process_rank=rank) == pytest.approx(expected)


def test_slowmo_process_rank_must_be_the_process_own_rank() -> None:
    run_distributed(_process_rank_world, 2, timeout=TIMEOUT)


# ---- graphs built for another rank


def _sgp(rank: int, **kwargs: object) -> gossip.SlowMoDistributedDataParallel:
    return gossip.SlowMoDistributedDataParallel(
        _scalar_model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0, **kwargs
    )


def _graph_world(rank: int, world_size: int) -> None:
    started = time.monotonic()
    # Rank 0's graph on every rank (the usual mistake): rank 1 raises its error, rank 0 one naming rank 1.
    graph = gossip.RingGraph(0, world_size)
    if rank == 1:
        with pytest.raises(FairscaleValueError, match="the graph was built for rank 0 of 2 nodes .* this process is "):
            _sgp(rank, graph=graph)
    else:
        with pytest.raises(RanksDisagreeError, match="global rank 1 refused its arguments .*the graph was built for"):
            _sgp(rank, graph=graph)
    # Each rank given the other's graph, or a mixing over the other's graph: both refuse their own.
    with pytest.raises(FairscaleValueError, match=f"the graph was built for rank {1 - rank} of 2 nodes"):
        _sgp(rank, graph=gossip.RingGraph(1 - rank, world_size))
    own = gossip.RingGraph(rank, world_size)
    other_mixing = gossip.UniformMixing(gossip.RingGraph(1 - rank, world_size), torch.device("cpu"))
    with pytest.raises(FairscaleValueError, match=f"the mixing's graph was built for rank {1 - rank}"):
        _sgp(rank, graph=own, mixing=other_mixing)
    with pytest.raises(FairscaleTypeError, match="graph must be a GraphManager, got str"):
        _sgp(rank, graph="ring")
    assert time.monotonic() - started < 30  # no wait for the gossip timeout (300 s)
    # The own graph gossips: both ranks average their weights (1 and 2).
    model = _sgp(rank, graph=own, mixing=gossip.UniformMixing(own, torch.device("cpu")))
    with torch.no_grad():
        model.module.weight.fill_(rank + 1.0)
    model.perform_slowmo(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.module.weight.item() == pytest.approx(1.5)


def test_slowmo_graph_must_be_built_for_this_process() -> None:
    run_distributed(_graph_world, 2, timeout=TIMEOUT)


# ---- exceptions in the gossip thread


class FailingMixing(gossip.UniformMixing):
    """Uniform mixing that raises once ``fail`` is set (a user mixing with a bug)."""

    fail = False

    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[Union[str, int], torch.Tensor]:
        if self.fail:
            raise ValueError("mixing weights are broken")
        return super().get_mixing_weights(residual_adjusted)


def _thread_error_world(rank: int, world_size: int) -> None:
    graph = gossip.RingGraph(rank, world_size)
    mixing = FailingMixing(graph, torch.device("cpu"))
    model = _sgp(rank, graph=graph, mixing=mixing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.perform_slowmo(optimizer)  # a good round first
    mixing.fail = True
    started = time.monotonic()
    for _ in range(2):  # raised at once, and again at every later round (the thread has ended)
        with pytest.raises(FairscaleRuntimeError, match="gossip thread failed with ValueError: mixing weights") as info:
            model.perform_slowmo(optimizer)
        assert isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - started < 30  # before: "Gossip flag timeout" after 300 s
    # A thread that fails to start: raised by the constructor (before: "Gossip thread did not start" after 300 s).
    failing_from_start = FailingMixing(graph, torch.device("cpu"))
    failing_from_start.fail = True
    with pytest.raises(FairscaleRuntimeError, match="gossip thread failed with ValueError"):
        _sgp(rank, graph=graph, mixing=failing_from_start)
    assert time.monotonic() - started < 30


def test_slowmo_gossip_thread_errors_reach_the_main_thread() -> None:
    run_distributed(_thread_error_world, 2, timeout=TIMEOUT)
