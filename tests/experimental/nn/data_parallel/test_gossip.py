# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo in real gloo worlds: upstream's ten settings against single-process references (full-batch SGD with
momentum for the frequency-1 settings, the explicit slow-momentum update for the others, a manual average for
plain LocalSGD, DDP-like intra-node averaging for one node), then SGP gossip at world size 4 against upstream's
verified values, the phone books of every topology and the mixing weights."""

import copy
import logging
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip.utils import MultiProcessAdapter
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives

STEPS = 4
BATCH = 4  # per rank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


def _data(step: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world_size * BATCH, 2, generator=g), torch.randn(world_size * BATCH, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _check_close(model: nn.Module, ref: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=atol, msg=f"{what}: {name}")


def _run_setting(rank: int, world_size: int, settings: Dict[str, Any], checker: str, device: str = "cpu") -> None:
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    base = Net().to(dev)
    model = gossip.SlowMoDistributedDataParallel(
        copy.deepcopy(base),
        comm_device=dev,
        process_rank=rank,
        process_world_size=world_size,
        **settings,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    model._init_global_momentum_buffers(optimizer)
    lr, momentum = settings.get("slowmo_lr", 1.0), settings.get("slowmo_momentum", 0.5)
    freq = settings.get("slowmo_frequency", 48)
    # References: one model on the full batch, or (plain LocalSGD) one model per rank averaged by hand.
    refs = [copy.deepcopy(base) for _ in range(world_size if checker == "localsgd" else 1)]
    ref_opts = [
        torch.optim.SGD(
            r.parameters(), lr=lr if checker == "freq1" else 1.0, momentum=momentum if checker == "freq1" else 0
        )
        for r in refs
    ]
    slow_opt = torch.optim.SGD(refs[0].parameters(), lr=lr, momentum=momentum)
    old = [p.detach().clone() for p in refs[0].parameters()]
    for step in range(STEPS):
        x, y = (t.to(dev) for t in _data(step, world_size))
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        optimizer.zero_grad()
        _loss(model, x[mine], y[mine]).backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
        for i, (ref, opt) in enumerate(zip(refs, ref_opts)):
            rows = slice(i * BATCH, (i + 1) * BATCH) if checker == "localsgd" else slice(None)
            opt.zero_grad()
            _loss(ref, x[rows], y[rows]).backward()
            opt.step()
        if checker == "localsgd" and (step + 1) % settings["localsgd_frequency"] == 0:
            with torch.no_grad():
                for ps in zip(*(r.parameters() for r in refs)):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
        if checker == "slowmo" and (step + 1) % freq == 0:
            with torch.no_grad():
                for p, o in zip(refs[0].parameters(), old):
                    p.grad = o - p.detach()
                    p.copy_(o)
            slow_opt.step()
            old = [p.detach().clone() for p in refs[0].parameters()]
        ref = refs[rank] if checker == "localsgd" else refs[0]
        _check_close(model.module, ref, 1e-6, f"step {step}")


SETTINGS: List[Tuple[str, Dict[str, Any], str]] = [
    (
        "nccl_backend_device_ids_torch_device_list",
        dict(nprocs_per_node=1, localsgd_frequency=1, slowmo_momentum=0.0, slowmo_frequency=1),
        "freq1",
    ),
    (
        "nccl_backend_2_proc_1_node",  # one node: base algorithm off, gradients averaged in the node (like DDP)
        dict(nprocs_per_node=2, localsgd_frequency=100, slowmo_frequency=1, slowmo_momentum=0.5),
        "freq1",
    ),
    (
        "localsgd_slowmo_freq_1",
        dict(nprocs_per_node=1, localsgd_frequency=1, slowmo_momentum=0.5, slowmo_frequency=1),
        "freq1",
    ),
    (
        "sgp_slowmo_freq_1",
        dict(
            nprocs_per_node=1,
            slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP,
            slowmo_momentum=0.5,
            slowmo_frequency=1,
            slowmo_memory_efficient=False,
        ),
        "freq1",
    ),
    ("localsgd_slowmo", dict(nprocs_per_node=1, localsgd_frequency=1, slowmo_frequency=2), "slowmo"),
    (
        "localsgd_slowmo_no_sharding",
        dict(nprocs_per_node=1, localsgd_frequency=1, slowmo_frequency=2, slowmo_memory_efficient=False),
        "slowmo",
    ),
    (
        "sgp_slowmo",
        dict(nprocs_per_node=1, slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP, slowmo_frequency=2),
        "slowmo",
    ),
    (
        "sgp_slowmo_no_sharding",
        dict(
            nprocs_per_node=1,
            slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP,
            slowmo_frequency=2,
            slowmo_memory_efficient=False,
        ),
        "slowmo",
    ),
    (
        "slowmo_small_worldsize",
        dict(nprocs_per_node=1, localsgd_frequency=1, slowmo_frequency=2, slowmo_num_shards=1),
        "slowmo",
    ),
    ("localsgd_freq2", dict(nprocs_per_node=1, localsgd_frequency=2, slowmo_momentum=0.0), "localsgd"),
]


def _check_communication_cadence(rank: int, world_size: int) -> None:
    """LocalSGD at frequency 2 all-reduces the parameters on every second update only, once per dtype."""
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        Net(), nprocs_per_node=1, localsgd_frequency=2, slowmo_momentum=0.0, broadcast_buffers=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(4):
        x, y = _data(step, world_size)
        _loss(model, x, y).backward()
        optimizer.step()
        with count_collectives() as counter:
            model.perform_slowmo(optimizer)
        counts.append(counter.count("all_reduce"))
    assert counts == [0, 1, 0, 1], counts


def _check_state_dict_and_errors(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    sgp = gossip.SlowMoDistributedDataParallel(
        Net(), nprocs_per_node=1, slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP
    )
    state = sgp.state_dict()
    assert state["is_sgp_ps_numerator"] is False and torch.equal(state["ps_weight"], torch.ones(1))
    assert all(k.startswith("module.") for k in state if k not in ("ps_weight", "is_sgp_ps_numerator"))
    sgp.load_state_dict(state)
    assert "ps_weight" in state  # the caller's dict is not consumed
    with pytest.raises(KeyError, match="lacks \\['ps_weight'\\]"):
        sgp.load_state_dict({k: v for k, v in state.items() if k != "ps_weight"})
    sgp.eval()
    assert not sgp.gossip_enable
    sgp.train()
    assert sgp.gossip_enable
    with pytest.raises(AssertionError):
        gossip.SlowMoDistributedDataParallel(Net(), nprocs_per_node=0)
    with pytest.raises(AssertionError):
        gossip.SlowMoDistributedDataParallel(
            Net(), nprocs_per_node=1, slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP, overlap=True
        )


def _world2(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Callable[[], None]]] = [
        (name, lambda s=settings, c=checker: _run_setting(rank, world_size, s, c))
        for name, settings, checker in SETTINGS
    ]
    cases.append(("communication_cadence", lambda: _check_communication_cadence(rank, world_size)))
    cases.append(("state_dict_and_errors", lambda: _check_state_dict_and_errors(rank, world_size)))
    run_cases(cases)


def test_settings() -> None:
    run_distributed(_world2, 2)


def _world2_cuda(rank: int, world_size: int) -> None:
    run_cases(
        (name, lambda s=settings, c=checker: _run_setting(rank, world_size, s, c, "cuda"))
        for name, settings, checker in SETTINGS
        if _is_localsgd(settings)
    )


def _is_localsgd(settings: Dict[str, Any]) -> bool:
    return (
        settings.get("slowmo_base_algorithm", gossip.SlowMoBaseAlgorithm.LOCALSGD)
        == gossip.SlowMoBaseAlgorithm.LOCALSGD
    )


def test_settings_cuda() -> None:
    """The LocalSGD settings on CUDA/NCCL (skips without two GPUs)."""
    run_distributed(_world2_cuda, 2, device="cuda")


def _world4(rank: int, world_size: int) -> None:
    # Phone books (dest of each of rank 0's edges); duplicates kept as upstream.
    books = {
        gossip.DynamicDirectedExponentialGraph: [1, 3, 2, 2],
        gossip.NPeerDynamicDirectedExponentialGraph: [1, 2],
        gossip.DynamicBipartiteExponentialGraph: [1, 3, 3, 1],
        gossip.DynamicDirectedLinearGraph: [1, 3, 3, 1],
        gossip.RingGraph: [1, 3],
    }
    for cls, expected in books.items():
        graph = cls(rank, world_size)
        assert [e.dest for e in graph.phone_book[0]] == expected, cls.__name__
    graph = gossip.NPeerDynamicDirectedExponentialGraph(rank, world_size)
    mixing = gossip.UniformMixing(graph, torch.device("cpu"))
    plain = {k: float(v) for k, v in mixing.get_mixing_weights(residual_adjusted=False).items()}
    adjusted = {k: float(v) for k, v in mixing.get_mixing_weights().items()}
    peer = (rank + 1) % world_size
    assert plain == {"lo": 0.5, "uniform": 0.5, peer: 0.5} and adjusted == {"lo": 0.5, "uniform": 1.0, peer: 1.0}

    # SGP gossip with one scalar weight equal to the rank, slow momentum off (upstream's verified values).
    module = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(float(rank))
    model = gossip.SlowMoDistributedDataParallel(
        module,
        nprocs_per_node=1,
        slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP,
        slowmo_momentum=0.0,
        broadcast_buffers=False,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.perform_slowmo(optimizer)
    assert float(module.weight) == [1.5, 0.5, 1.5, 2.5][rank]
    model.perform_slowmo(optimizer)
    assert float(module.weight) == 1.5 and float(model.ps_weight) == 1.0


def test_sgp_world_of_four_and_topologies() -> None:
    run_distributed(_world4, 4)


def test_multi_process_adapter_prefixes_and_extra_is_optional(caplog: Any) -> None:
    """``MultiProcessAdapter(logger)`` works on every supported Python (3.9's LoggerAdapter required ``extra``)."""
    logger = logging.getLogger("fairscale.test.multi_process_adapter")
    with caplog.at_level(logging.INFO, logger=logger.name):
        MultiProcessAdapter(logger, {"process_num": 3}).info("hello")
        MultiProcessAdapter(logger).info("no extra")
    assert [r.getMessage() for r in caplog.records] == ["process: 3 hello", "process: None no extra"]
