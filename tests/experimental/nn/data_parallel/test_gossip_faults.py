# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo and the gossip graphs under unusual but valid use, and arguments that cannot work.

* A parameter group at lr 0 (frozen, or a warm-up from 0) stays as it is through slow momentum (it turned NaN).
* A backward that raised (a caught OOM) does not switch off the intra-node gradient averaging of later ones.
* Graph arguments out of range (peers_per_itr, rank) raise a clear error naming the allowed values.
* Ranks whose backwards reach different parameters average their gradients as torch DDP with
  ``find_unused_parameters=True`` does (they were mixed up, or gloo aborted).
* Parameter groups added after slow momentum was set up raise instead of being silently shrunk.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import warnings
from typing import Any, Dict, List, Optional, Tuple, Type, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import GraphManager
from fairscale.experimental.nn.data_parallel.gossip._node_collectives import average_gradients_in_node
from fairscale.experimental.nn.data_parallel.gossip._slow_momentum import SlowMomentum
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError

TIMEOUT = 60.0


def _rank_data(rank: int) -> torch.Tensor:
    """Different data on each rank, so that averaging across ranks changes something."""
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(100 + rank))


# ---- a parameter group at lr 0


def _train_lr_zero(rank: int, world_size: int, freeze_by_lr: bool, memory_efficient: bool) -> Dict[str, Any]:
    """Four updates (two slow-momentum steps) of a two-layer model, layer 0 frozen.

    Layer 0 is frozen by an lr of 0 in its own group (``freeze_by_lr``), or, for the reference, by leaving it out of
    the optimizer (SlowMo only updates the optimizer's parameters).
    """
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model = gossip.SlowMoDistributedDataParallel(
        module, nprocs_per_node=1, slowmo_frequency=2, slowmo_momentum=0.5, slowmo_memory_efficient=memory_efficient
    )
    groups: List[Dict[str, Any]] = [{"params": list(module[1].parameters()), "lr": 0.1}]
    if freeze_by_lr:
        groups.insert(0, {"params": list(module[0].parameters()), "lr": 0.0})
    optimizer = torch.optim.SGD(groups)
    initial = [p.detach().clone() for p in module[0].parameters()]
    x = _rank_data(rank)
    for _ in range(4):
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
    return {
        "initial": initial,
        "frozen": [p.detach().clone() for p in module[0].parameters()],
        "trained": [p.detach().clone() for p in module[1].parameters()],
    }


def _lr_zero_world(rank: int, world_size: int) -> None:
    # Memory-efficient (sharded, averaging inside the slow step) and not: the lr-0 group stays exactly as it was.
    for memory_efficient in (True, False):
        run = _train_lr_zero(rank, world_size, freeze_by_lr=True, memory_efficient=memory_efficient)
        for p, p0 in zip(run["frozen"], run["initial"]):
            if not (torch.isfinite(p).all() and torch.equal(p, p0)):
                raise AssertionError(f"rank {rank}: the lr-0 group changed: {p0.tolist()} -> {p.tolist()}")
        for p in run["trained"]:
            if not torch.isfinite(p).all():
                raise AssertionError(f"rank {rank}: the lr-0.1 group is not finite: {p.tolist()}")
    # The other group trains as it does without the lr-0 group in the optimizer (not sharded: the shard boundaries
    # then differ between the two runs).
    reference = _train_lr_zero(rank, world_size, freeze_by_lr=False, memory_efficient=False)
    for p, ref in zip(run["trained"], reference["trained"]):
        if not torch.allclose(p, ref, rtol=1e-6, atol=1e-7):
            raise AssertionError(
                f"rank {rank}: the lr-0.1 group {p.tolist()} differs from the reference {ref.tolist()}"
            )
    # The other group did train (the check above is not between two untouched copies).
    torch.manual_seed(0)
    untrained = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))[1]
    if all(torch.equal(p, q) for p, q in zip(run["trained"], untrained.parameters())):
        raise AssertionError("the lr-0.1 group did not move")


def test_slowmo_lr_zero_group_keeps_its_parameters() -> None:
    run_distributed(_lr_zero_world, 2, timeout=TIMEOUT)


def test_slow_momentum_lr_zero_keeps_momentum_buffer() -> None:
    """Directly on SlowMomentum (one process, not sharded): the lr-0 slice of the momentum buffer is kept."""
    frozen, trained = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([{"params": [frozen], "lr": 0.0}, {"params": [trained], "lr": 0.5}])
    slow_momentum = SlowMomentum(
        enabled=True, momentum=0.5, lr=1.0, memory_efficient=False, num_shards=1, process_rank=0, process_world_size=1
    )
    slow_momentum.init_buffers(optimizer)
    buffer = slow_momentum.global_momentum_buffer
    if buffer is None:
        raise AssertionError("no momentum buffer")
    buffer[:2].fill_(7.0)  # as if left by earlier steps at a positive lr
    with torch.no_grad():
        frozen.copy_(torch.tensor([2.0, 3.0]))  # moved by the base algorithm's averaging, say
        trained.sub_(0.5)
    slow_momentum.step(optimizer)
    if not torch.equal(frozen.detach(), torch.tensor([2.0, 3.0])) or not torch.equal(buffer[:2], torch.full((2,), 7.0)):
        raise AssertionError(f"lr-0 group: params {frozen.tolist()}, momentum {buffer[:2].tolist()}")
    # u = (1 - 0.5) / 0.5 = 1, x = old - lr * u = 1 - 0.5 = 0.5 (the slow lr is 1: the averaged value, as upstream).
    if not torch.equal(trained.detach(), torch.full((3,), 0.5)) or not torch.equal(buffer[2:], torch.ones(3)):
        raise AssertionError(f"lr-0.5 group: params {trained.tolist()}, momentum {buffer[2:].tolist()}")


# ---- a backward that raised


class _FailOnce(torch.autograd.Function):
    """Identity whose first backward in a process raises (as a caught CUDA OOM in backward would)."""

    fail = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.fail:
            _FailOnce.fail = False
            raise RuntimeError("simulated out of memory in backward")
        return grad


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_FailOnce.apply(self.a(x)))


def _node_of_two(net_class: Type[nn.Module]) -> Tuple[nn.Module, nn.Module, nn.Module]:
    """A ``net_class`` model, an equal reference, and SlowMo around the model on one node of two processes (the
    gradients are averaged inside the node after every backward)."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = net_class()
    reference = net_class()
    reference.load_state_dict(net.state_dict())
    return net, reference, gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=2, slowmo_momentum=0.0)


def _failed_backward_world(rank: int, world_size: int) -> None:
    net, reference, model = _node_of_two(_Net)
    x = _rank_data(rank)
    _FailOnce.fail = True
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        model(x).pow(2).sum().backward()
    model.zero_grad()
    model(x).pow(2).sum().backward()  # the training loop skipped the failed batch; this one must be averaged
    # Reference: this rank's own gradient, averaged over the ranks by hand.
    reference(x).pow(2).sum().backward()
    for name, p in net.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        if p.grad is None or expected is None:
            raise AssertionError(f"{name}: no gradient")
        expected = expected.clone()
        dist.all_reduce(expected)
        expected /= world_size
        if not torch.allclose(p.grad, expected, rtol=1e-6, atol=1e-7):
            raise AssertionError(
                f"rank {rank} {name}: gradient {p.grad.tolist()} is not the average {expected.tolist()}"
            )


def test_failed_backward_does_not_stop_intra_node_gradient_averaging() -> None:
    run_distributed(_failed_backward_world, 2, timeout=TIMEOUT)


# ---- ranks whose backwards reach different parameters


class _Branches(nn.Module):
    """Two branches of the same shapes (a rank uses one of them) and one that no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 3)
        self.branches = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return self.branches[branch](self.trunk(x))


def _different_branches_world(rank: int, world_size: int) -> None:
    net, reference, model = _node_of_two(_Branches)
    ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    x = _rank_data(rank)
    for step in range(2):  # the second backward accumulates onto the first's averaged gradients
        with count_collectives() as counter:
            model(x, rank).pow(2).sum().backward()
        # One all-reduce per dtype, as for ranks whose backwards reach the same parameters.
        if counter.count("all_reduce") != 1:
            raise AssertionError(f"step {step}: {counter.count('all_reduce')} all-reduces, expected 1")
        ddp(x, rank).pow(2).sum().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"rank {rank} {name}: gradient {p.grad} where DDP has {q.grad}")
        if p.grad is not None and not torch.allclose(p.grad, cast(torch.Tensor, q.grad), rtol=1e-6, atol=1e-7):
            raise AssertionError(f"rank {rank} {name}: gradient {p.grad.tolist()} is not DDP's {q.grad}")
    if net.unused.weight.grad is not None or net.branches[1 - rank].weight.grad is None:
        raise AssertionError(f"rank {rank}: the unused branch got a gradient, or the other rank's branch none")


def test_ranks_reaching_different_parameters_average_like_ddp() -> None:
    """Upstream reduced only the gradients present: here two buffers of the same size, so each rank's branch
    gradient was added to the other branch's (silently wrong); with another size gloo aborted the process."""
    run_distributed(_different_branches_world, 2, timeout=TIMEOUT)


def _gradient_dtypes_world(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    params = [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(2, dtype=torch.complex64))]
    kept_in_fp32 = hasattr(params[0], "grad_dtype")  # torch's per-parameter gradient dtype (recent releases)
    if kept_in_fp32:
        params[0].grad_dtype = torch.float32
    # Rank 0 holds both gradients, rank 1 neither: rank 1 receives the averages.
    if rank == 0:
        params[0].grad = torch.tensor([1.0 + 1e-3, 3.0], dtype=torch.float32 if kept_in_fp32 else torch.bfloat16)
        params[1].grad = torch.tensor([2 + 2j, 4j], dtype=torch.complex64)
    average_gradients_in_node(params, world_size, group)
    expected_real = torch.tensor([1.0 + 1e-3, 3.0], dtype=params[0].grad.dtype if params[0].grad is not None else None)
    got = [p.grad for p in params]
    if got[0] is None or got[1] is None:
        raise AssertionError(f"rank {rank}: a gradient reached on rank 0 is None here: {got}")
    # Not rounded to bf16 where the gradients are fp32 (1.0005 has no bf16 value).
    if not torch.equal(got[0], expected_real / 2):
        raise AssertionError(f"rank {rank}: {got[0]} ({got[0].dtype}) is not {expected_real / 2}")
    if not torch.equal(got[1], torch.tensor([1 + 1j, 2j], dtype=torch.complex64)):
        raise AssertionError(f"rank {rank}: complex gradient {got[1]}")


def test_gradient_dtypes_and_complex_parameters_average_across_the_node() -> None:
    """Gradients keep their own dtype (fp32 gradients of bf16 parameters are not rounded to bf16 on the wire), and a
    rank without a complex parameter's gradient receives the average (its flags compared with 0: complex has no
    order)."""
    run_distributed(_gradient_dtypes_world, 2, timeout=TIMEOUT)


# ---- graph arguments, no process group needed (checked before any edge is made)


def _no_process_group() -> None:
    if dist.is_initialized():
        raise AssertionError("these checks must run without a default process group")


@pytest.mark.parametrize(
    "graph_cls, world_size, peers_per_itr, allowed",
    [
        (gossip.RingGraph, 2, 3, "between 1 and 2"),  # the phone book repeats peers
        (gossip.RingGraph, 5, 3, "between 1 and 2"),
        (gossip.NPeerDynamicDirectedExponentialGraph, 2, 2, "between 1 and 1"),
        # distance 2 * 3 is the rank itself: torch rejected the group of one process twice.
        (gossip.NPeerDynamicDirectedExponentialGraph, 6, 2, r"one of \[1, 4, 5\]"),
        (gossip.DynamicDirectedExponentialGraph, 4, 5, "between 1 and 4"),
        (gossip.DynamicDirectedLinearGraph, 4, 5, "between 1 and 4"),
        (gossip.DynamicBipartiteLinearGraph, 4, 5, "between 1 and 4"),
    ],
)
def test_graph_rejects_too_many_peers_per_itr(
    graph_cls: Type[GraphManager], world_size: int, peers_per_itr: int, allowed: str
) -> None:
    _no_process_group()
    match = f"{graph_cls.__name__}: peers_per_itr must be {allowed} for world_size {world_size}, got {peers_per_itr}"
    with pytest.raises(FairscaleValueError, match=match):
        graph_cls(0, world_size, peers_per_itr=peers_per_itr)


@pytest.mark.parametrize("graph_cls", [gossip.DynamicBipartiteExponentialGraph, gossip.DynamicBipartiteLinearGraph])
def test_bipartite_graph_rejects_odd_world(graph_cls: Type[GraphManager]) -> None:
    # A passive rank of an odd world has no active neighbours on both sides: no peers at all (an IndexError later).
    _no_process_group()
    with pytest.raises(
        FairscaleValueError, match=f"{graph_cls.__name__}: this topology has no valid peers for world_size 3"
    ):
        graph_cls(0, 3)


@pytest.mark.parametrize("rank", [2, 5, -1])
@pytest.mark.parametrize("graph_cls", [gossip.RingGraph, gossip.NPeerDynamicDirectedExponentialGraph])
def test_graph_rejects_rank_outside_world(graph_cls: Type[GraphManager], rank: int) -> None:
    _no_process_group()
    with pytest.raises(
        FairscaleValueError, match=rf"{graph_cls.__name__}: rank must be in \[0, 1\] for world_size 2, got {rank}"
    ):
        graph_cls(rank, 2)


# ---- parameter groups added after slow momentum was set up


def _add_param_group_world(rank: int, world_size: int) -> Optional[str]:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    module = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    model = gossip.SlowMoDistributedDataParallel(
        module, nprocs_per_node=1, slowmo_frequency=1, localsgd_frequency=1, slowmo_momentum=0.5
    )
    optimizer = torch.optim.SGD(module["a"].parameters(), lr=0.1)
    model.perform_slowmo(optimizer)  # sets the slow momentum up over module a's parameters
    optimizer.add_param_group({"params": module["b"].parameters(), "lr": 0.1})
    before = module["b"].weight.detach().clone()
    with pytest.raises(FairscaleRuntimeError, match="Add all parameter groups before the first perform_slowmo"):
        model.perform_slowmo(optimizer)
    if not torch.equal(module["b"].weight, before):
        raise AssertionError(f"module b changed: {before.tolist()} -> {module['b'].weight.tolist()}")
    return None


def test_slowmo_rejects_param_group_added_after_setup() -> None:
    run_distributed(_add_param_group_world, 2, timeout=TIMEOUT)


def test_slow_momentum_step_rejects_changed_parameters() -> None:
    """Directly on SlowMomentum: another parameter list than the one the buffers were laid out over."""
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([a], lr=0.1)
    slow_momentum = SlowMomentum(
        enabled=True, momentum=0.5, lr=1.0, memory_efficient=False, num_shards=1, process_rank=0, process_world_size=1
    )
    slow_momentum.init_buffers(optimizer)
    slow_momentum.step(optimizer)  # the same parameters: fine
    optimizer.add_param_group({"params": [b], "lr": 0.1})
    with pytest.raises(FairscaleRuntimeError, match="set up for 1 optimizer parameters .* the optimizer now has 2"):
        slow_momentum.step(optimizer)
