# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo over a model's life: failed backwards in eval mode, dtype changes, parameters returned as outputs,
``channels_last`` weights, deep copies and ``meta`` modules.

* A backward that raised in ``eval()`` mode does not switch off the intra-node gradient averaging of later ones.
* SGP refuses to gossip parameters whose dtype changed after wrapping (it rounded them to the old dtype silently).
* A parameter returned in the output keeps at most one SlowMo hook, does not keep a dropped wrapper alive, and is
  not averaged in plain backwards after the wrapper is gone.
* The slow-momentum step works on ``channels_last`` parameters (it raised, and a retry halved every parameter).
* ``copy.deepcopy`` of a LocalSGD wrapper gives a working copy sharing the groups; SGP refuses with a clear error.
* SGP around a ``meta`` module is refused at construction with a clear error on every rank.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import copy
import gc
import warnings
import weakref
from typing import Any, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_gossip_faults import _FailOnce, _Net

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import SlowMoBaseAlgorithm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

TIMEOUT = 60.0


def _rank_data(rank: int, step: int = 0) -> torch.Tensor:
    """Different data on each rank, so that averaging across ranks changes something."""
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(100 + 10 * step + rank))


def _averaged(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """The reference: ``t`` averaged over the ranks by hand."""
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world_size


# ---- a backward that raised in eval mode


def _eval_failed_backward_world(rank: int, world_size: int) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = _Net()
    reference = copy.deepcopy(net)
    model = gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=2, slowmo_momentum=0.0)
    model.eval()  # fine-tuning with frozen statistics: grad enabled, eval mode
    x = _rank_data(rank)
    _FailOnce.fail = True
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for step in range(2):  # the loop skipped the failed batch; the next ones must be averaged
        model.zero_grad()
        model(x).pow(2).sum().backward()
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            assert q.grad is not None and p.grad is not None, name
            expected = _averaged(q.grad, world_size)
            if not torch.allclose(p.grad, expected, rtol=1e-6, atol=1e-7):
                raise AssertionError(f"rank {rank} step {step} {name}: {p.grad.tolist()} != {expected.tolist()}")


def test_failed_backward_in_eval_mode_does_not_stop_gradient_averaging() -> None:
    run_distributed(_eval_failed_backward_world, 2, timeout=TIMEOUT)


# ---- SGP after a dtype change


def _sgp_dtype_change_world(rank: int, world_size: int) -> None:
    warnings.simplefilter("ignore")
    net = nn.Linear(1, 1, bias=False)
    model = gossip.SlowMoDistributedDataParallel(
        net, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0
    )
    model.double()
    with torch.no_grad():
        net.weight.fill_(1.0 + (1e-12 if rank == 0 else 3e-12))
    before = net.weight.detach().clone()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    # Gossiped in float32, the low bits were lost and the ranks never agreed: refused, on every rank, unchanged.
    with pytest.raises(FairscaleRuntimeError, match="'weight' is now torch.float64 on cpu, but SGP gossips"):
        model.perform_slowmo(optimizer)
    assert net.weight.dtype == torch.float64 and torch.equal(net.weight.detach(), before)
    # Back in the dtype of the wrapping, gossip goes on: the plain average of the two ranks.
    model.float()
    with torch.no_grad():
        net.weight.fill_(float(rank + 1))
    model.perform_slowmo(torch.optim.SGD(net.parameters(), lr=0.0))
    assert net.weight.item() == pytest.approx(1.5)


def test_sgp_refuses_parameters_converted_after_wrapping() -> None:
    run_distributed(_sgp_dtype_change_world, 2, timeout=TIMEOUT)


def _sgp_float64_world(rank: int, world_size: int) -> None:
    # A model in float64 when wrapped gossips in float64 (the reference: the two ranks' values averaged exactly).
    warnings.simplefilter("ignore")
    net = nn.Linear(1, 1, bias=False).double()
    model = gossip.SlowMoDistributedDataParallel(
        net, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0
    )
    with torch.no_grad():
        net.weight.fill_(1.0 + (1e-12 if rank == 0 else 3e-12))
    expected = _averaged(net.weight, world_size)
    model.perform_slowmo(torch.optim.SGD(net.parameters(), lr=0.0))
    assert torch.allclose(net.weight.detach(), expected, rtol=0, atol=1e-15), (net.weight.item() - 1, expected - 1)


def test_sgp_gossips_a_float64_model_in_float64() -> None:
    run_distributed(_sgp_float64_world, 2, timeout=TIMEOUT)


# ---- a parameter returned in the output


class _WithLogVar(nn.Module):
    """Returns a learned parameter with the prediction (learned uncertainty weighting)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.log_var = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> Any:
        return self.fc(x), self.log_var


def _leaf_output_world(rank: int, world_size: int) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = _WithLogVar()
    model = gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=2, slowmo_momentum=0.0)
    x = _rank_data(rank)
    scale = float(rank + 1)
    for _ in range(20):
        net.zero_grad()
        y, log_var = model(x)
        (y.sum() + scale * log_var.sum()).backward()
        # Averaged at every backward: (1 + 2) / 2.
        assert net.log_var.grad is not None and net.log_var.grad.item() == pytest.approx(1.5)
    # One hook at most (the last forward's), not one per forward.
    hooks = net.log_var._backward_hooks
    assert hooks is None or len(hooks) <= 1, len(hooks)
    # A dropped wrapper is freed, and the plain module's own backward is its own (no averaging any more).
    ref = weakref.ref(model)
    del model, y, log_var
    gc.collect()
    assert ref() is None, "the dropped wrapper is still alive"
    net.zero_grad()
    (net.log_var * scale).sum().backward()
    assert net.log_var.grad is not None and net.log_var.grad.item() == scale


def test_parameter_in_output_keeps_no_hooks_or_wrapper() -> None:
    run_distributed(_leaf_output_world, 2, timeout=TIMEOUT)


# ---- channels_last parameters


def _channels_last_world(rank: int, world_size: int, memory_efficient: bool) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 2)
    reference = copy.deepcopy(conv)  # contiguous, trained in plain PyTorch
    conv = conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    model = gossip.SlowMoDistributedDataParallel(
        conv,
        nprocs_per_node=1,
        slowmo_frequency=1,
        localsgd_frequency=1,
        slowmo_momentum=0.5,
        slowmo_lr=0.7,
        slowmo_memory_efficient=memory_efficient,
        slowmo_num_shards=2,  # the weight is split between the two owners
    )
    lr, beta, alpha = 0.1, 0.5, 0.7
    optimizer = torch.optim.SGD(conv.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    old = u = torch.zeros(0)
    for step in range(3):
        x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        model(x.to(memory_format=torch.channels_last)).pow(2).sum().backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
        # Reference, on the parameters as one flat vector: local step, exact average, slow-momentum update.
        ref_optimizer.zero_grad()
        reference(x).pow(2).sum().backward()
        ref_optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        if step == 0:
            # The buffers are laid out at the first perform_slowmo, from the replicas' average after the local step
            # (see test_slowmo_lazy_buffers.py).
            old = _averaged(flat, world_size)
            u = torch.zeros_like(flat)
        u = beta * u + (old - _averaged(flat, world_size)) / lr
        old = old - alpha * lr * u
        with torch.no_grad():
            offset = 0
            for p in reference.parameters():
                p.copy_(old[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        for (name, p), q in zip(conv.named_parameters(), reference.parameters()):
            if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"rank {rank} step {step} {name}: {(p - q).abs().max().item()}")
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # the layout is kept


@pytest.mark.parametrize("memory_efficient", [True, False])
def test_slow_momentum_on_channels_last_parameters(memory_efficient: bool) -> None:
    run_distributed(_channels_last_world, 2, memory_efficient, timeout=TIMEOUT)


# ---- deep copies


def _train(model: nn.Module, rank: int, steps: int) -> List[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        model(_rank_data(rank, step)).pow(2).sum().backward()
        optimizer.step()
        getattr(model, "perform_slowmo")(optimizer)
    return [p.detach().clone() for p in model.parameters()]


def _deepcopy_world(rank: int, world_size: int, nprocs_per_node: int) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        nn.Linear(2, 1), nprocs_per_node=nprocs_per_node, localsgd_frequency=1, slowmo_frequency=2
    )
    initial = [p.detach().clone() for p in model.parameters()]
    copied = copy.deepcopy(model)
    assert copied.global_group is model.global_group and copied.master_group is model.master_group
    assert copied.local_node_group is model.local_node_group
    assert all(p is not q for p, q in zip(copied.parameters(), model.parameters()))
    # The copy trains (its collectives on the shared groups) and leaves the original alone ...
    trained_copy = _train(copied, rank, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    # ... exactly as the original trains.
    trained = _train(model, rank, 3)
    for p, q in zip(trained_copy, trained):
        assert torch.equal(p, q), (p.tolist(), q.tolist())
    assert not all(torch.equal(p, q) for p, q in zip(trained, initial))


@pytest.mark.parametrize("nprocs_per_node", [1, 2])
def test_deepcopy_of_localsgd_model_shares_groups_and_trains(nprocs_per_node: int) -> None:
    run_distributed(_deepcopy_world, 2, nprocs_per_node, timeout=TIMEOUT)


def _deepcopy_sgp_world(rank: int, world_size: int) -> None:
    warnings.simplefilter("ignore")
    model = gossip.SlowMoDistributedDataParallel(
        nn.Linear(2, 1), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    with pytest.raises(FairscaleTypeError, match=r"SGP cannot be deep-copied.*copy\.deepcopy\(model\.module\)"):
        copy.deepcopy(model)
    inner = copy.deepcopy(model.module)  # what the message offers
    assert torch.equal(inner.weight, model.module.weight)


def test_deepcopy_of_sgp_model_is_refused_clearly() -> None:
    run_distributed(_deepcopy_sgp_world, 2, timeout=TIMEOUT)


# ---- SGP around a meta module


def _meta_sgp_world(rank: int, world_size: int) -> Optional[str]:
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        net = nn.Linear(2, 2)
    with pytest.raises(FairscaleValueError, match="SGP needs the module's parameters materialised"):
        gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP)
    # Refused before any group was created: the world goes on with a materialised model.
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(
        nn.Linear(2, 2), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP
    )
    with torch.no_grad():
        model.module.weight.fill_(float(rank))
    model.perform_slowmo(torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.allclose(model.module.weight, torch.full((2, 2), 0.5))
    return None


def test_sgp_around_meta_module_is_refused_clearly() -> None:
    run_distributed(_meta_sgp_world, 2, timeout=TIMEOUT)
