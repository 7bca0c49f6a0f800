# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The checks of caller input in the SlowMo/gossip modules raise clear exceptions, also under ``python -O``.

Upstream fairscale checked these with bare ``assert``; here each raises ``FairscaleValueError``,
``FairscaleTypeError`` or ``FairscaleRuntimeError`` (also ``AssertionError``s, so upstream-style callers keep
working) with a message that says what to change. Checks that fire before any process group is needed are
triggered in this process; the others in real gloo worlds started by the test engine (module-level bodies, so the
file also passes with ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import os
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple, Type, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import GraphManager, SlowMoBaseAlgorithm
from fairscale.experimental.nn.data_parallel.gossip._slow_momentum import SlowMomentum
from fairscale.experimental.nn.data_parallel.gossip.gossiper import Gossiper
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

GOSSIPERS: List[Type[Gossiper]] = [gossip.PushSum, gossip.PushPull]


def _raises(cls: Type[Exception], match: str) -> Any:
    """``pytest.raises(cls, match=match)`` for one of the Fairscale*Error classes (checked to be an AssertionError)."""
    assert issubclass(cls, AssertionError), cls
    return pytest.raises(cls, match=match)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


def _no_process_group() -> None:
    assert not dist.is_initialized(), "these checks must run without a default process group"


# ---- SlowMoDistributedDataParallel, no process group needed


@pytest.mark.parametrize("value", ["1", "true"])
def test_slowmo_rejects_nccl_blocking_wait(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", value)
    with _raises(FairscaleRuntimeError, f"NCCL_BLOCKING_WAIT is '{value}'.*unset it or set it to 0"):
        gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, process_rank=0, process_world_size=1)


@pytest.mark.parametrize("nprocs_per_node", [0, -2])
def test_slowmo_rejects_nprocs_per_node_below_one(nprocs_per_node: int) -> None:
    with _raises(FairscaleValueError, f"nprocs_per_node must be at least 1, got {nprocs_per_node}"):
        gossip.SlowMoDistributedDataParallel(
            _model(), nprocs_per_node=nprocs_per_node, process_rank=0, process_world_size=1
        )


@pytest.mark.parametrize("rank, world_size", [(None, None), (0, None), (None, 2)])
def test_slowmo_needs_rank_and_world_size_without_process_group(rank: Optional[int], world_size: Optional[int]) -> None:
    _no_process_group()
    with _raises(FairscaleRuntimeError, "torch.distributed is not initialised; call .*init_process_group"):
        gossip.SlowMoDistributedDataParallel(
            _model(), nprocs_per_node=1, process_rank=rank, process_world_size=world_size
        )


def test_slowmo_rejects_world_size_not_multiple_of_nprocs_per_node() -> None:
    _no_process_group()  # the check comes before any process group is created
    with _raises(FairscaleValueError, "world size 6 is not a multiple of nprocs_per_node 4; pass nprocs_per_node"):
        gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=4, process_rank=0, process_world_size=6)


# ---- SlowMomentum (perform_slowmo hands it the caller's optimizer), no process group needed


def _slow_momentum() -> SlowMomentum:
    return SlowMomentum(
        enabled=True,
        momentum=0.5,
        lr=1.0,
        memory_efficient=False,
        num_shards=1,
        process_rank=0,
        process_world_size=1,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_slow_momentum_needs_fp32_optimizer_parameters(dtype: torch.dtype) -> None:
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3, dtype=dtype))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    slow_momentum = _slow_momentum()
    for _ in range(2):  # a rejected optimizer leaves the buffers uninitialised: the next call checks again
        with _raises(FairscaleTypeError, f"SlowMo needs fp32 optimizer parameters, got {dtype};"):
            slow_momentum.init_buffers(optimizer)
        assert not slow_momentum.initialized


def test_slow_momentum_needs_one_device() -> None:
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3, device="meta"))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    slow_momentum = _slow_momentum()
    with _raises(FairscaleValueError, "SlowMo needs all optimizer parameters on one device, got cpu, meta"):
        slow_momentum.init_buffers(optimizer)
    assert not slow_momentum.initialized


# ---- graphs and gossipers, no process group needed


@pytest.mark.parametrize("graph_cls", [gossip.RingGraph, gossip.NPeerDynamicDirectedExponentialGraph])
@pytest.mark.parametrize("peers_per_itr", [0, -1])
def test_graph_rejects_peers_per_itr_below_one(graph_cls: Type[GraphManager], peers_per_itr: int) -> None:
    _no_process_group()  # the check comes before any edge (and its process group) is made
    with _raises(FairscaleValueError, f"{graph_cls.__name__}: peers_per_itr must be at least 1, got {peers_per_itr}"):
        graph_cls(0, 2, peers_per_itr=peers_per_itr)


@pytest.mark.parametrize(
    "graph_cls",
    [
        gossip.RingGraph,
        gossip.NPeerDynamicDirectedExponentialGraph,
        gossip.DynamicDirectedExponentialGraph,
        gossip.DynamicDirectedLinearGraph,
        gossip.DynamicBipartiteExponentialGraph,
        gossip.DynamicBipartiteLinearGraph,
    ],
)
def test_graph_needs_two_nodes(graph_cls: Type[GraphManager]) -> None:
    # Upstream: "math domain error" or an IndexError from building the graph.
    _no_process_group()
    with _raises(FairscaleValueError, f"{graph_cls.__name__}: a gossip graph needs at least 2 nodes, got world_size 1"):
        graph_cls(0, 1)


def _slowmo_sgp_on_one_process(rank: int, world_size: int) -> None:
    """SGP on one node of one process: upstream built a gossip graph of one node and failed ("math domain error");
    now, as upstream did for one node of several processes, the base algorithm is off and training runs."""
    model = gossip.SlowMoDistributedDataParallel(
        _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    assert not model.sgp and not model.localsgd
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = _model()
    reference.load_state_dict(model.module.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(4, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        model.perform_slowmo(optimizer)
        reference(torch.ones(4, 2)).sum().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for p, q in zip(model.module.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_slowmo_sgp_on_one_process_trains_locally() -> None:
    run_distributed(_slowmo_sgp_on_one_process, 1)


@pytest.mark.parametrize("gossiper_cls", GOSSIPERS)
@pytest.mark.parametrize("rank, world_size", [(None, None), (0, None), (None, 2)])
def test_gossiper_needs_rank_and_world_size_without_process_group(
    gossiper_cls: Type[Gossiper], rank: Optional[int], world_size: Optional[int]
) -> None:
    _no_process_group()
    # A graph needs a process group; this check comes first, so the graph is never looked at.
    graph = cast(GraphManager, None)
    with _raises(FairscaleRuntimeError, f"{gossiper_cls.__name__}: .*torch.distributed is not initialised"):
        gossiper_cls(torch.zeros(3), graph, rank=rank, world_size=world_size)


@pytest.mark.parametrize("gossiper_cls", GOSSIPERS)
def test_gossiper_graph_must_be_a_graph_manager(gossiper_cls: Type[Gossiper]) -> None:
    not_a_graph = cast(GraphManager, {"rank": 0})
    with _raises(FairscaleTypeError, f"{gossiper_cls.__name__}: graph must be a GraphManager, got dict"):
        gossiper_cls(torch.zeros(3), not_a_graph, rank=0, world_size=1)


# ---- gossipers in a gloo world of two (a graph's edges are process groups)


def _ring_gossiper(
    rank: int,
    world_size: int,
    gossiper_cls: Type[Gossiper] = gossip.PushSum,
    gossiper_rank: Optional[int] = None,
    mixing: Any = None,
) -> Gossiper:
    """A gossiper on this world's ring graph (told ``gossiper_rank`` as its rank, default the real one)."""
    graph = gossip.RingGraph(rank, world_size)
    gossiper_rank = rank if gossiper_rank is None else gossiper_rank
    return gossiper_cls(
        torch.zeros(3), graph, device=torch.device("cpu"), mixing=mixing, rank=gossiper_rank, world_size=world_size
    )


def _gossiper_default_backend(rank: int, world_size: int) -> None:
    graph = gossip.RingGraph(rank, world_size)
    with _raises(FairscaleRuntimeError, "'gloo' backend; pass rank= .* and world_size="):
        gossip.PushSum(torch.zeros(3), graph)


def test_gossiper_rejects_rank_from_default_backend() -> None:
    run_distributed(_gossiper_default_backend, 2)


def _gossiper_mixing_type(rank: int, world_size: int) -> None:
    with _raises(FairscaleTypeError, "PushSum: mixing must be a MixingManager, got str"):
        _ring_gossiper(rank, world_size, mixing="uniform")


def test_gossiper_mixing_must_be_a_mixing_manager() -> None:
    run_distributed(_gossiper_mixing_type, 2)


def _gossiper_rotate_static(rank: int, world_size: int) -> None:
    gossiper = _ring_gossiper(rank, world_size)
    gossiper.refresh_peers_(rotate=False)  # fine: a static graph just keeps its edges
    with _raises(FairscaleValueError, "cannot rotate the static graph RingGraph; pass rotate=False"):
        gossiper.refresh_peers_(rotate=True)


def test_gossiper_cannot_rotate_static_graph() -> None:
    run_distributed(_gossiper_rotate_static, 2)


def _gossiper_message_device(rank: int, world_size: int, gossiper_cls: Type[Gossiper]) -> None:
    gossiper = _ring_gossiper(rank, world_size, gossiper_cls)
    with _raises(FairscaleValueError, f"{gossiper_cls.__name__}.mix: the message is on meta .* device is cpu"):
        gossiper.mix(torch.zeros(3, device="meta"), torch.ones(1))


@pytest.mark.parametrize("gossiper_cls", GOSSIPERS)
def test_gossiper_mix_rejects_message_on_other_device(gossiper_cls: Type[Gossiper]) -> None:
    run_distributed(_gossiper_message_device, 2, gossiper_cls)


def _push_sum_wrong_rank(rank: int, world_size: int) -> None:
    # The ring graph is built for this rank, the gossiper is told the other one.
    gossiper = _ring_gossiper(rank, world_size, gossiper_rank=1 - rank)
    edge = f"Edge\\({rank} -> {1 - rank}\\)"
    with _raises(FairscaleValueError, f"rank {1 - rank} is not the source of its out edge {edge}; pass the process"):
        gossiper.mix(torch.zeros(3), torch.ones(1))


def test_push_sum_rank_must_match_graph() -> None:
    run_distributed(_push_sum_wrong_rank, 2)


# ---- SlowMoDistributedDataParallel in gloo worlds


def _slowmo_unknown_algorithm(rank: int, world_size: int) -> None:
    # One node of two processes (no master group), and two nodes of one: there an unknown value ran neither base
    # algorithm and the ranks never synchronised (upstream checked it on one node only).
    for nprocs_per_node in (2, 1):
        with _raises(
            FairscaleValueError, "unknown slowmo_base_algorithm 'local_sgd'; pass SlowMoBaseAlgorithm.LOCALSGD"
        ):
            gossip.SlowMoDistributedDataParallel(
                _model(), nprocs_per_node=nprocs_per_node, slowmo_base_algorithm=cast(SlowMoBaseAlgorithm, "local_sgd")
            )


def _slowmo_bad_counts(rank: int, world_size: int) -> None:
    # slowmo_num_shards=-1 looped without end at the first slow-momentum step; 0 there, and the frequencies 0,
    # divided by zero; a negative localsgd_frequency averaged every update.
    for name, value in [("slowmo_num_shards", -1), ("slowmo_num_shards", 0), ("slowmo_frequency", 0)] + [
        ("localsgd_frequency", 0),
        ("localsgd_frequency", -1),
    ]:
        with _raises(FairscaleValueError, f"{name} must be a positive integer, got {value}"):
            gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, slowmo_lr=0.5, **{name: value})
    # A count the configuration never reads is still accepted (slow momentum off: no shards, no slowmo steps).
    gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, slowmo_momentum=0.0, slowmo_num_shards=0)


def test_slowmo_rejects_bad_counts() -> None:
    run_distributed(_slowmo_bad_counts, 2)


def _slowmo_push_pull_needs_bipartite_graph(rank: int, world_size: int) -> None:
    # Every rank of the default exponential graph sends first: all of them blocked (300 s, then "Gossip flag timeout").
    with _raises(FairscaleValueError, "push_sum=False \\(PushPull\\) needs a bipartite graph"):
        gossip.SlowMoDistributedDataParallel(
            _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, push_sum=False
        )


def test_slowmo_push_pull_needs_bipartite_graph() -> None:
    run_distributed(_slowmo_push_pull_needs_bipartite_graph, 2, timeout=60)


def test_slowmo_rejects_unknown_base_algorithm() -> None:
    run_distributed(_slowmo_unknown_algorithm, 2)


def _slowmo_ranks_disagree(rank: int, world_size: int, what: str) -> None:
    """Another model or other settings on one rank: the same RanksDisagreeError on every rank at construction, before
    any group is created (gloo aborted the process at the first collective, or group creation waited)."""
    model = nn.Sequential(nn.Linear(2, 3 + (rank if what == "model" else 0)), nn.Linear(3, 1))
    if what == "buffers" and rank == 1:
        model.register_buffer("extra", torch.zeros(2))
    kwargs: Dict[str, Any] = {"nprocs_per_node": 2 - (rank if what == "nprocs_per_node" else 0)}
    if what == "frequency":
        kwargs["localsgd_frequency"] = 3 + rank
    # The next three ran silently apart (slowmo_lr) or waited in different collectives (averaging through the master
    # group on one rank only; overlap refused on one rank only).
    if what == "slowmo_lr":
        kwargs["slowmo_lr"] = 1.0 + rank
    if what in ("average", "overlap"):
        kwargs.update(nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP)
        kwargs["slowmo_sgp_average_params" if what == "average" else "overlap"] = rank == 0
    expected = {"model": "entry 1: ", "buffers": "entry 1: "}.get(what, "entry 0: ")
    with pytest.raises(RanksDisagreeError, match=f"SlowMoDistributedDataParallel: the settings.*{expected}"):
        gossip.SlowMoDistributedDataParallel(model, **kwargs)
    # Nothing is left half-built between the ranks: the same model on every rank still works.
    gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=2)(torch.ones(1, 2)).sum().backward()


@pytest.mark.parametrize(
    "what", ["model", "buffers", "nprocs_per_node", "frequency", "slowmo_lr", "average", "overlap"]
)
def test_slowmo_ranks_must_agree(what: str) -> None:
    run_distributed(_slowmo_ranks_disagree, 2, what)


def _slowmo_lr_not_a_number(rank: int, world_size: int) -> None:
    """A string slowmo_lr on one rank: float() of it raised there alone, before the agreement all-gather, and the
    other rank waited in it. Now both ranks raise the same disagreement; a string on every rank is a TypeError."""
    with pytest.raises(RanksDisagreeError, match="the settings .*slowmo_lr.*entry 0: "):
        gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, slowmo_lr=cast(float, "x") if rank else 0.5)
    with _raises(FairscaleTypeError, "slowmo_lr must be a real number, got 'x'"):
        gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, slowmo_lr=cast(float, "x"))


def test_slowmo_lr_must_be_a_number_on_every_rank() -> None:
    run_distributed(_slowmo_lr_not_a_number, 2, timeout=60)


def _slowmo_process_ranks(rank: int, world_size: int) -> None:
    """Two ranks given the same process_rank (or one outside the world) built node groups and masters that did not
    match: the same error on every rank now, from the agreement gather, before any group is created."""
    for ranks, problem in [((0, 0), "0 is given to several ranks"), ((0, 2), "2 is not a rank")]:
        with pytest.raises(
            RanksDisagreeError, match=f"process_rank values are \\[{ranks[0]}, {ranks[1]}\\], but {problem}"
        ):
            gossip.SlowMoDistributedDataParallel(
                _model(), nprocs_per_node=1, process_rank=ranks[rank], process_world_size=world_size
            )
    # The ranks' own ranks are accepted (other distinct ones are refused: test_gossip_rank_checks.py).
    gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, process_rank=rank, process_world_size=2)


def test_slowmo_process_ranks_must_be_distinct() -> None:
    run_distributed(_slowmo_process_ranks, 2, timeout=60)


def _slowmo_overlap(rank: int, world_size: int) -> None:
    with _raises(FairscaleValueError, "overlapping SGP communication is not supported; pass overlap=False"):
        gossip.SlowMoDistributedDataParallel(
            _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, overlap=True
        )


def test_slowmo_rejects_overlap() -> None:
    run_distributed(_slowmo_overlap, 2)


def _slowmo_ps_weight_without_sgp(rank: int, world_size: int) -> None:
    model = gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1)
    assert not model.is_sgp_ps_numerator  # the other SGP properties answer for a LocalSGD model
    with _raises(FairscaleRuntimeError, "ps_weight only exists with the SGP base algorithm"):
        _ = model.ps_weight


def test_slowmo_ps_weight_needs_sgp() -> None:
    run_distributed(_slowmo_ps_weight_without_sgp, 1)


def _slowmo_load_state_dict_without_ps_weight(rank: int, world_size: int) -> None:
    inner = _model()
    model = gossip.SlowMoDistributedDataParallel(
        inner, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    state = model.state_dict()
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    state["module.0.weight"] = torch.full_like(state["module.0.weight"], 7.0)
    state["ps_weight"] = None
    with _raises(FairscaleValueError, "load_state_dict: the state dict's 'ps_weight' is None"):
        model.load_state_dict(state)
    for k, v in inner.state_dict().items():  # checked before loading: a failed load changes nothing
        assert torch.equal(v, before[k]), k


def test_slowmo_load_state_dict_rejects_missing_ps_weight() -> None:
    run_distributed(_slowmo_load_state_dict_without_ps_weight, 2)


def _slowmo_failed_load_changes_nothing(rank: int, world_size: int) -> None:
    """Dicts that do not fit (a missing SGP entry, a ps_weight of another size, a module entry of another shape listed
    after one that fits): the same error as before, and no value of the module or the SGP state changes."""
    inner = _model()
    model = gossip.SlowMoDistributedDataParallel(
        inner, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    spoiled: List[Tuple[Any, str]] = []
    for what in ("absent", "ps_size", "shape", "ps_meta", "numerator"):
        state = {k: torch.full_like(v, 7.0) if isinstance(v, torch.Tensor) else v for k, v in before.items()}
        if what == "absent":
            del state["is_sgp_ps_numerator"]
            spoiled.append((state, "lacks \\['is_sgp_ps_numerator'\\]"))
        elif what == "ps_size":
            state["ps_weight"] = torch.ones(2)
            spoiled.append((state, "'ps_weight' is not a 1-element tensor"))
        elif what == "ps_meta":  # failed in the copy, after the module was loaded
            state["ps_weight"] = torch.ones(1, device="meta")
            spoiled.append((state, "'ps_weight' is not a 1-element tensor with data"))
        elif what == "numerator":  # bool() failed after the module and ps_weight were loaded
            state["is_sgp_ps_numerator"] = torch.tensor([True, False])
            spoiled.append((state, "'is_sgp_ps_numerator' is not a bool"))
        else:
            state["module.1.weight"] = torch.ones(2, 3)  # 0.weight and 0.bias fit and come first
            spoiled.append((state, "size mismatch for module.1.weight"))
    for state, match in spoiled:
        with pytest.raises((KeyError, ValueError, RuntimeError), match=match):
            model.load_state_dict(state)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k], (match, k)


def test_slowmo_failed_load_changes_nothing() -> None:
    run_distributed(_slowmo_failed_load_changes_nothing, 2)


def _slowmo_as_a_submodule_saves_under_its_prefix(rank: int, world_size: int) -> None:
    """Two SGP models in one parent: their SGP entries went to the same top-level keys (one overwrote the other) and
    the parent's dict did not load back ("Unexpected key(s) ps_weight")."""
    parent = nn.ModuleDict(
        {
            name: gossip.SlowMoDistributedDataParallel(
                _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
            )
            for name in ("a", "b")
        }
    )
    parent["b"]._sgp.ps_weight.fill_(0.25)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in parent.state_dict().items()}
    assert {k for k in state if "ps" in k} == {
        "a.ps_weight",
        "a.is_sgp_ps_numerator",
        "b.ps_weight",
        "b.is_sgp_ps_numerator",
    }
    assert state["a.ps_weight"].item() == 1.0 and state["b.ps_weight"].item() == 0.25
    parent["a"]._sgp.ps_weight.fill_(3.0)
    parent.load_state_dict(state)
    assert parent["a"]._sgp.ps_weight.item() == 1.0 and parent["b"]._sgp.ps_weight.item() == 0.25


def test_slowmo_as_a_submodule_saves_under_its_prefix() -> None:
    run_distributed(_slowmo_as_a_submodule_saves_under_its_prefix, 2)


def _slowmo_non_strict_load(rank: int, world_size: int) -> None:
    """strict=False is honoured (upstream loaded strictly whatever it said): absent entries, the SGP ones too, are
    reported as missing keys and keep their values; unexpected ones are reported. strict=True still raises KeyError
    for absent SGP entries, as upstream."""
    model = gossip.SlowMoDistributedDataParallel(
        _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    model._sgp.ps_weight.fill_(0.5)
    state = {k: torch.full_like(v, 3.0) if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    for key in ("ps_weight", "is_sgp_ps_numerator", "module.1.bias"):
        del state[key]
    state["extra"] = torch.ones(1)
    with pytest.raises(KeyError, match="lacks \\['ps_weight', 'is_sgp_ps_numerator'\\].*or strict=False"):
        model.load_state_dict(state)
    result = model.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == ["is_sgp_ps_numerator", "module.1.bias", "ps_weight"]
    assert result.unexpected_keys == ["extra"]
    assert torch.equal(model.module[0].weight, torch.full_like(model.module[0].weight, 3.0))
    assert not torch.equal(model.module[1].bias, torch.full_like(model.module[1].bias, 3.0))
    assert model._sgp.ps_weight.item() == 0.5


def test_slowmo_load_state_dict_honours_strict_false() -> None:
    run_distributed(_slowmo_non_strict_load, 2)


def _slowmo_parent_load_reports_missing_sgp_entries(rank: int, world_size: int) -> None:
    """An SGP model inside a parent: a parent dict without its SGP entries loaded silently (ps_weight kept its value,
    nothing reported); now they are missing keys, so the parent's strict load raises and a non-strict one lists them."""
    parent = nn.ModuleDict(
        {
            "a": gossip.SlowMoDistributedDataParallel(
                _model(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
            )
        }
    )
    state = parent.state_dict()
    del state["a.ps_weight"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "a.ps_weight"'):
        parent.load_state_dict(state)
    result = parent.load_state_dict(state, strict=False)
    assert result.missing_keys == ["a.ps_weight"] and result.unexpected_keys == []


def test_slowmo_parent_load_reports_missing_sgp_entries() -> None:
    run_distributed(_slowmo_parent_load_reports_missing_sgp_entries, 2)


def _slowmo_fp32_params_sizes(rank: int, world_size: int) -> None:
    """fp32_params that do not match the parameters: upstream zipped them, so a short list left the last parameters
    without error feedback and a long flat tensor's tail was never used; a shape that broadcasts was mixed silently."""
    model = gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1, localsgd_frequency=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p.detach().clone() for p in model.parameters()]
    total = sum(p.numel() for p in params)
    cases: List[Tuple[Any, str]] = [
        (params[:-1], "fp32_params has 3 entries but the model has 4 parameters"),
        (params[:-1] + [params[-1].view(1, 1)], "fp32_params\\[3\\] is \\(1, 1\\), but parameter 3 has shape \\(1,\\)"),
        (
            {"p": torch.zeros(total + 1)},
            f"flat fp32_params has {total + 1} elements but the model's parameters have {total}",
        ),
        ("params", "fp32_params is a str"),
    ]
    for fp32, match in cases:
        with _raises(FairscaleValueError, match):
            model.perform_slowmo(optimizer, fp32_params=fp32)
    assert model.num_updates == 0  # refused before anything was communicated or counted
    flat = torch.cat([p.reshape(-1) for p in params])
    model.perform_slowmo(optimizer, fp32_params=flat)  # the right size works (one process: the average is itself)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_slowmo_fp32_params_must_match_the_parameters() -> None:
    run_distributed(_slowmo_fp32_params_sizes, 1)


def _slowmo_fp32_params_dict(rank: int, world_size: int, entries: int) -> None:
    model = gossip.SlowMoDistributedDataParallel(_model(), nprocs_per_node=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fp32 = {f"group{i}": [p.detach().clone() for p in model.parameters()] for i in range(entries)}
    with _raises(FairscaleValueError, f"fp32_params as a dict must have exactly one entry .*got {entries}"):
        model.perform_slowmo(optimizer, fp32_params=fp32)


@pytest.mark.parametrize("entries", [0, 2])
def test_slowmo_fp32_params_dict_needs_one_entry(entries: int) -> None:
    run_distributed(_slowmo_fp32_params_dict, 1, entries)


# ---- python -O


_UNDER_O = textwrap.dedent("""
    import sys

    import torch.nn as nn

    from fairscale.experimental.nn.data_parallel.gossip import SlowMoDistributedDataParallel
    from fairscale.internal.errors import FairscaleValueError

    if not sys.flags.optimize:
        raise SystemExit("the sample must run under python -O")
    try:
        SlowMoDistributedDataParallel(nn.Linear(2, 1), nprocs_per_node=4, process_rank=0, process_world_size=6)
    except FairscaleValueError as e:
        print("raised:", e)
    else:
        raise SystemExit("no exception under python -O")
    """)


@pytest.mark.skip_under_python_O
def test_check_raises_under_python_dash_o() -> None:
    env = dict(os.environ)
    env.pop("PYTHONOPTIMIZE", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-O", "-c", _UNDER_O], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "raised: SlowMoDistributedDataParallel: world size 6 is not a multiple of nprocs_per_node 4" in result.stdout
