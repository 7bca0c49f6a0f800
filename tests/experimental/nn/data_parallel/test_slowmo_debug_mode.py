# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo under PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

The checker wraps every process group and, before each collective, async ones included, waits on a barrier of the
group's members. SGP's push-sum gossip used to start its async sends on every rank first and then receive: under
the checker each send waited for a peer that was itself waiting on its own send, and training hung in the first
gossip round (until the gossip groups time out, 30 minutes by default with gloo). These worlds train the same model
with the checker on and off and require the same result, with a world timeout so that a regression fails in a
minute instead of hanging.
"""

import functools
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.fair_dev.testing.engine import init_gloo_world, run_ranks

TIMEOUT = 60.0  # seconds per world; the fixed gossip takes a few
STEPS, BATCH = 4, 3

SGP = gossip.SlowMoBaseAlgorithm.SGP
LOCALSGD = gossip.SlowMoBaseAlgorithm.LOCALSGD
# name: (world size, SlowMo arguments, graph class or None for SlowMo's default)
SETTINGS: Dict[str, Tuple[int, Dict[str, Any], Any]] = {
    # A two-rank ring: each rank's out-edge is the other's in-edge.
    "sgp_push_sum": (2, dict(nprocs_per_node=1, slowmo_base_algorithm=SGP, slowmo_frequency=2), None),
    # A three-rank cycle (distances 1 and 2): an odd cycle, which no two-colouring of senders and receivers breaks.
    "sgp_push_sum_three_ranks": (3, dict(nprocs_per_node=1, slowmo_base_algorithm=SGP, slowmo_frequency=2), None),
    # Two nodes of two processes: gossip between the node masters, gradients averaged and parameters broadcast
    # inside each node, slow momentum sharded over the world.
    "sgp_push_sum_two_nodes": (4, dict(nprocs_per_node=2, slowmo_base_algorithm=SGP, slowmo_frequency=2), None),
    # Push-pull on a bipartite graph (blocking exchanges, passive ranks receive first).
    "sgp_push_pull": (
        2,
        dict(nprocs_per_node=1, slowmo_base_algorithm=SGP, push_sum=False, slowmo_frequency=2),
        gossip.DynamicBipartiteExponentialGraph,
    ),
    "localsgd": (2, dict(nprocs_per_node=1, slowmo_base_algorithm=LOCALSGD, localsgd_frequency=2), None),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm's running statistics are buffers, so the buffer broadcast before each forward is checked too.
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _wrapped_backends(groups: List[Any]) -> List[str]:
    """Type names of the CPU backends of the groups this rank belongs to (the checker is ``_ProcessGroupWrapper``)."""
    names = set()
    for pg in groups:
        if isinstance(pg, dist.ProcessGroup):  # dist.new_group gives non-members a placeholder
            names.add(type(pg._get_backend(torch.device("cpu"))).__name__)
    return sorted(names)


def _train(directory: str, detail: bool, setting: str, rank: int) -> Tuple[Dict[str, Tensor], List[str]]:
    world_size, kwargs, graph_cls = SETTINGS[setting]
    # Set explicitly both ways, before any group exists (torch reads the level when it creates a group): a run of
    # the suite with TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment must still have a reference without it.
    init_gloo_world(directory, rank, world_size, dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    net = _net()
    with torch.no_grad():  # different parameters on every rank, so that gossip and averaging have work to do
        for p in net.parameters():
            p.add_(0.1 * rank)
    extra: Dict[str, Any] = {}
    nppn = kwargs["nprocs_per_node"]
    if graph_cls is not None:
        extra["graph"] = graph_cls(rank // nppn, world_size // nppn, nppn, rank % nppn)
    model = gossip.SlowMoDistributedDataParallel(net, **kwargs, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        model.perform_slowmo(opt)
    groups: List[Any] = [dist.group.WORLD, model.global_group, model.master_group, model.local_node_group]
    if model._sgp is not None:
        groups += [edge.process_group for book in model._sgp.graph.phone_book for edge in book]
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return state, _wrapped_backends(groups)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_slowmo_trains_the_same_under_the_collective_checker(tmp_path: Any, setting: str) -> None:
    world_size = SETTINGS[setting][0]
    runs = {}
    for detail in (False, True):
        directory = tmp_path / ("detail" if detail else "off")
        directory.mkdir()
        body = functools.partial(_train, str(directory), detail, setting)
        runs[detail] = run_ranks(body, world_size, timeout=TIMEOUT)
    for rank in range(world_size):
        (reference, plain), (checked, wrapped) = runs[False][rank], runs[True][rank]
        # The checker really wrapped every group, and the reference ran without it.
        assert wrapped == ["_ProcessGroupWrapper"], f"rank {rank}: {wrapped}"
        assert plain == ["ProcessGroupGloo"], f"rank {rank}: {plain}"
        assert reference.keys() == checked.keys()
        for key, value in reference.items():
            # The same collectives with the same operands, summed in the same order: equal to the bit.
            torch.testing.assert_close(checked[key], value, rtol=0, atol=0, msg=f"rank {rank}: {key}")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
