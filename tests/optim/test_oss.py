# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS (optimizer state sharding): partitioning, stepping, clipping, parity with unsharded training, checkpoints.

Real gloo worlds on CPU (CUDA/NCCL variants run where GPUs exist). The parity reference is DDP with the plain torch
optimizer, or the same computation on one process (the global batch), which is what DDP computes.
Bodies are module-level functions: the suite must also pass with ``FAIRSCALE_TEST_START_METHOD=spawn``.
"""

import copy
import math
import os
from typing import Any, Dict, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.optim import OSS

OPTIMS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}
TIMEOUT = 120.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _data(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _groups(model: nn.Module, two_groups: bool, lr_head: float = 0.05) -> Any:
    if not two_groups:
        return list(model.parameters())
    params = list(model.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "lr": lr_head}]


def _device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _average_grads(model: nn.Module, world_size: int) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, world_size: int, step: int, micro: int = 1) -> None:
    """One step of DDP's computation on one process: the mean of every rank's (micro-batch summed) loss."""
    opt.zero_grad()
    for rank in range(world_size):
        for m in range(micro):
            (_loss(model, _data(step, rank, m)) / world_size).backward()
    opt.step()


def _assert_same_params(a: nn.Module, b: nn.Module, msg: str, atol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach().cpu(), pb.detach().cpu(), atol=atol, rtol=1e-5, msg=f"{msg}: {name}")


# ------------------------------------------------------------------------------------------------------------------
# One rank


def _single_rank_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("create", _case_create),
            ("state_dict", _case_state_dict_single),
            ("lr_scheduler", _case_lr_scheduler),
            ("step_with_kwargs", _case_step_with_kwargs),
            ("step_with_extra_inner_key", _case_extra_inner_key),
            ("step_without_closure", _case_step_without_closure),
            ("implicit_local_state_dict", _case_implicit_local_state_dict),
        ]
    )


def _case_create() -> None:
    o = OSS([torch.rand(1, requires_grad=True)], lr=0.1)
    assert o.world_size == 1 and o.rank == 0 and o.global_rank == 0
    # The arguments given, then the wrapped optimizer's own defaults (upstream: the arguments only; torch's
    # OneCycleLR and CyclicLR read momentum or betas there).
    assert o.defaults["lr"] == 0.1 and o.defaults["momentum"] == 0 and list(o.defaults)[0] == "lr"
    assert set(o.param_groups[0]) >= {"params", "lr", "momentum", "dampening", "nesterov", "weight_decay"}
    with pytest.raises(ValueError, match="empty parameter list"):
        OSS([], lr=0.1)


def _case_state_dict_single() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert x == torch.tensor([0.9]), x
    assert o.optim.state[x]["momentum_buffer"] == torch.tensor([1.0])
    o.zero_grad()
    o.consolidate_state_dict()
    state_dict = o.state_dict()
    assert set(state_dict) == {"state", "param_groups"} and list(state_dict["state"]) == [0]
    assert state_dict["param_groups"][0]["lr"] == 0.1 and state_dict["param_groups"][0]["params"] == [0]
    # Reload into an OSS built with another lr: the saved one wins, and the momentum continues.
    o = OSS([x], lr=0.01)
    o.load_state_dict(copy.deepcopy(state_dict))
    assert o.param_groups[0]["lr"] == 0.1 and o.optim.param_groups[0]["lr"] == 0.1
    x.backward()
    o.step()
    assert x == torch.tensor([0.71]), x
    assert o.optim.state[x]["momentum_buffer"] == torch.tensor([1.9])
    assert o.param_groups[0]["params"][0].device == x.device
    # A plain torch optimizer loads it too.
    sgd = torch.optim.SGD([torch.tensor([1.0], requires_grad=True)], lr=0.5, momentum=0.9)
    sgd.load_state_dict(copy.deepcopy(state_dict))
    assert sgd.param_groups[0]["lr"] == 0.1


def _case_lr_scheduler() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    x2 = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], lr=0.01)
    o2 = torch.optim.SGD([x2], lr=0.01)
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1)
    for _ in range(5):
        x.backward()
        o.zero_grad()
        o.step()
        s.step()
        x2.backward()
        o2.zero_grad()
        o2.step()
        s2.step()
        assert x == x2 and o.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


class _SGDWithStepKWArg(torch.optim.SGD):
    def step(self, closure: Any = None, kwarg: Any = None) -> Any:  # type: ignore[override]
        super().step()
        kwarg.append(5)
        return None


class _SGDWithNewKey(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        super().step()
        self.param_groups[0]["new_key"] = 0.1
        return None


class _SGDWithoutClosure(torch.optim.SGD):
    def step(self) -> Any:  # type: ignore[override]
        return super().step()


def _case_step_with_kwargs() -> None:
    kwarg: List[int] = []
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], _SGDWithStepKWArg, lr=0.1)
    x.backward()
    o.step(0, kwarg=kwarg)
    assert kwarg == [5] and x == torch.tensor([0.9])


def _case_extra_inner_key() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], _SGDWithNewKey, lr=0.1)
    x.backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1 and x == torch.tensor([0.9])


def _case_step_without_closure() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], _SGDWithoutClosure, lr=0.1)
    x.backward()
    o.step()
    assert x == torch.tensor([0.9])


def _case_implicit_local_state_dict() -> None:
    o = OSS([torch.tensor([1.0], requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        o.state_dict()


def test_single_rank() -> None:
    run_distributed(_single_rank_body, 1, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Partitioning


def _partition_body(rank: int, world_size: int) -> None:
    sizes = [4, 10, 3, 7]
    params = [torch.zeros(n, requires_grad=(i != 1)) for i, n in enumerate(sizes)]
    extra = [torch.zeros(1, requires_grad=True), torch.zeros(6, requires_grad=True)]
    o = OSS([{"params": params}, {"params": extra, "lr": 0.5}], lr=0.1)
    numels = [[[p.numel() for p in g["params"]] for g in rank_groups] for rank_groups in o.partition_parameters()]
    assert numels == [[[4, 7], []], [[10, 3], [1, 6]]], numels
    # This rank's partition is the inner optimizer's own groups.
    assert all(a is b for a, b in zip(o.partition_parameters()[rank], o.optim.param_groups))
    assert len(o.optim.param_groups) == 2
    assert {o._param_to_rank[p] for p in params} == {0, 1}
    assert o._param_to_index[id(extra[1])] == 5
    per_device = o._per_device_params[torch.device("cpu")]
    assert [[p.numel() for p in owned] for owned in per_device] == [[4, 7], [1, 3, 6, 10]]
    # One broadcast bucket per owner; the frozen parameter is not in any.
    assert {r: b.buffer.numel() for r, b in o.buckets[torch.device("cpu")].items()} == {0: 11, 1: 10}


def test_partition_worked_example() -> None:
    run_distributed(_partition_body, 2, timeout=TIMEOUT)


def _world4_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("sharding", lambda: _case_sharding(world_size)),
            ("empty_shard", lambda: _case_empty_shard(rank)),
            ("add_param_group", lambda: _case_add_param_group(world_size)),
            ("clip_norm_uses_world_group", lambda: _case_clip_world_group(rank)),
            ("multiple_groups", lambda: _case_multiple_groups(rank, world_size)),
        ]
    )


def _case_sharding(world_size: int) -> None:
    sizes = [9, 7, 5, 3]
    params = [torch.rand(s, 1, requires_grad=True) for s in sizes * world_size]
    o = OSS(params, lr=0.1)
    assert sum(p.numel() for p in o.optim.param_groups[0]["params"]) == 24


def _case_empty_shard(rank: int) -> None:
    model = nn.Linear(1, 1)  # two parameters for four ranks: two ranks own nothing
    o = OSS(model.parameters(), lr=0.1)
    model(torch.ones(1, 1) * (rank + 1)).sum().backward()
    o.step()
    weights = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(weights, model.weight.detach().view(1).contiguous())
    assert all(torch.equal(w, weights[0]) for w in weights)


def _case_add_param_group(world_size: int) -> None:
    params = [torch.rand(s, 1, requires_grad=True) for s in [5, 5, 5, 5] * world_size]
    o = OSS(params[:-world_size], lr=0.1)
    o.add_param_group({"params": params[-world_size:]})
    assert sum(p.numel() for g in o.optim.param_groups for p in g["params"]) == 20
    assert len(o.optim.param_groups) == 2 and len(o.param_groups) == 2
    # Pathological: a first, big, frozen parameter counts as 1, later groups still balance.
    big = torch.rand(100, 1, requires_grad=False)
    o = OSS([big] + [torch.rand(5, 1, requires_grad=True) for _ in range(world_size - 1)], lr=0.1)
    o.add_param_group({"params": [torch.rand(5, 1, requires_grad=True) for _ in range(world_size)]})
    assert len(o.optim.param_groups) == 2 and len(o.param_groups) == 2


def _case_clip_world_group(rank: int) -> None:
    # Two disjoint OSS groups: the norm is still reduced over the world (upstream's model-parallel semantics).
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    p = torch.zeros(2, requires_grad=True)
    o = OSS([p], lr=0.1, group=group)
    owner = o._param_to_rank[p]
    p.grad = torch.full((2,), 2.0 if rank < 2 else 20.0)
    norm = o.clip_grad_norm(1e6)
    # Owners are one rank per group: the world norm combines 2*sqrt(2) and 20*sqrt(2).
    assert owner == 0
    torch.testing.assert_close(norm, torch.tensor(math.sqrt(8 + 800)))


def _case_multiple_groups(rank: int, world_size: int) -> None:
    sub_ranks = [0, 2]
    sub = dist.new_group(sub_ranks)
    if rank not in sub_ranks:
        return
    model = _model()
    # broadcast_buffer_size: deprecated upstream, accepted and ignored.
    o = OSS(model.parameters(), torch.optim.Adam, lr=0.01, group=sub, broadcast_buffer_size=2**20)
    assert o.world_size == 2 and o._local_to_global_rank == sub_ranks
    for step in range(3):
        o.zero_grad()
        _loss(model, _data(step, rank)).backward()  # different data per rank: stepping alone would diverge
        o.step()
        for p in model.parameters():
            gathered = [torch.empty_like(p) for _ in sub_ranks]
            dist.all_gather(gathered, p.detach().contiguous(), group=sub)
            # Trainable params come from their owner; all ranks agree.
            assert torch.equal(gathered[0], gathered[1])


def test_world_of_four() -> None:
    run_distributed(_world4_body, 4, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Stepping: exact values, communication, fp16 broadcast, clipping


def _step_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("exact_step", lambda: _case_exact_step(rank, world_size)),
            ("closure", lambda: _case_closure(rank, world_size)),
            ("zero_grad", lambda: _case_zero_grad(rank)),
            ("broadcast_fp16", lambda: _case_broadcast_fp16(rank, world_size)),
            ("clip_grad_norm", lambda: _case_clip_grad_norm(rank, world_size)),
            ("refresh_trainable", lambda: _case_refresh_trainable(rank, world_size)),
            ("reproducibility,fp32", lambda: _case_reproducibility(rank, world_size, False)),
            ("reproducibility,broadcast_fp16", lambda: _case_reproducibility(rank, world_size, True)),
            ("add_param_group_state_dict", lambda: _case_add_param_group_state_dict(rank, world_size)),
            ("non_parameter_state_keys", lambda: _case_non_parameter_state(rank, world_size)),
        ]
    )


def _case_exact_step(rank: int, world_size: int) -> None:
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(2.0)
    o = OSS(model.parameters(), lr=0.1)
    model(torch.tensor([[float(rank + 1)]])).backward()
    _average_grads(model, world_size)
    with count_collectives() as counter:
        o.step()
    # One broadcast per owner with trainable parameters, nothing else.
    assert counter.count() == counter.count("broadcast") == 2, counter.summary()
    # Averaged gradients: weight (1 + 2) / 2 = 1.5, bias 1.
    assert model.weight.item() == pytest.approx(0.85) and model.bias.item() == pytest.approx(1.9)


def _case_closure(rank: int, world_size: int) -> None:
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(2.0)
    o = OSS(model.parameters(), lr=0.1)

    def closure() -> torch.Tensor:
        o.zero_grad()
        loss = (model(torch.tensor([[1.0]])) - torch.tensor([[2.0]])).abs().sum()
        loss.backward()
        return loss

    loss = o.step(closure=closure)
    assert loss == torch.tensor(1.0)
    assert model.weight.item() == pytest.approx(0.9) and model.bias.item() == pytest.approx(1.9)


def _case_zero_grad(rank: int) -> None:
    model = nn.Linear(2, 3)
    o = OSS(model.parameters(), lr=0.1)
    model(torch.rand(4, 2)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    o.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def _case_broadcast_fp16(rank: int, world_size: int) -> None:
    model = _model()
    o = OSS(model.parameters(), torch.optim.SGD, lr=0.1, broadcast_fp16=True)
    _loss(model, _data(0, rank)).backward()
    _average_grads(model, world_size)
    o.step()
    for p in model.parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, p.half().float()), "every trainable parameter is rounded to fp16 by the broadcast"
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert all(b.buffer.dtype == torch.float32 for per in o.buckets.values() for b in per.values())
    # The parameters still are views of the (fp32) buckets: the next step broadcasts them.
    bucket = o.buckets[torch.device("cpu")][o.rank]
    assert any(p.data_ptr() == bucket.buffer.data_ptr() for p in model.parameters())


def _case_clip_grad_norm(rank: int, world_size: int) -> None:
    for norm_type in (1.0, 2.0, math.inf):
        model = _model()
        ref = copy.deepcopy(model)
        o = OSS(model.parameters(), lr=0.1)
        # No gradient yet: the norm is 0 and nothing is cached (upstream cached the owned list at first use).
        assert o.clip_grad_norm(1.0, norm_type=norm_type) == 0
        for m in (model, ref):
            _loss(m, _data(1, rank)).backward()
            _average_grads(m, world_size)
        max_norm = 0.05
        total = o.clip_grad_norm(max_norm, norm_type=norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        torch.testing.assert_close(total, expected, msg=f"norm {norm_type}")
        assert total > max_norm
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            if o._param_to_rank[p] == rank:
                torch.testing.assert_close(p.grad, p_ref.grad, msg="owned grads are clipped")
                assert torch.linalg.vector_norm(p.grad, norm_type) <= max_norm + 1e-6
            else:
                assert not torch.allclose(p.grad, p_ref.grad), "non-owned grads are left alone"


def _case_refresh_trainable(rank: int, world_size: int) -> None:
    """A parameter frozen when OSS was built is not broadcast until refresh_trainable()."""
    model = _model()
    first = next(model.parameters())
    first.requires_grad_(False)
    o = OSS(model.parameters(), lr=0.1)
    assert all(first.data_ptr() != b.buffer.data_ptr() for b in o.buckets[torch.device("cpu")].values())
    first.requires_grad_(True)
    o.refresh_trainable()
    _loss(model, _data(0, rank)).backward()
    _average_grads(model, world_size)
    before = first.detach().clone()
    o.step()
    gathered = [torch.empty_like(first) for _ in range(world_size)]
    dist.all_gather(gathered, first.detach().contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered) and not torch.equal(gathered[0], before)


def _train_losses(model: nn.Module, oss: OSS, rank: int, world_size: int, steps: range) -> List[float]:
    losses = []
    for step in steps:
        oss.zero_grad()
        loss = _loss(model, _data(step, rank))
        loss.backward()
        _average_grads(model, world_size)
        oss.step()
        losses.append(loss.item())
    return losses


def _case_reproducibility(rank: int, world_size: int, fp16: bool) -> None:
    """Save optimizer + model, train, restore both, train again: the same losses (and fp32 buckets)."""
    model = _model()
    oss = OSS(model.parameters(), torch.optim.RMSprop, lr=0.01, broadcast_fp16=fp16)
    _train_losses(model, oss, rank, world_size, range(1))
    optim_state = copy.deepcopy(oss.state_dict(all_ranks=True))
    model_state = copy.deepcopy(model.state_dict())
    first = _train_losses(model, oss, rank, world_size, range(1, 3))
    model.load_state_dict(model_state)
    oss.load_state_dict(copy.deepcopy(optim_state))
    second = _train_losses(model, oss, rank, world_size, range(1, 3))
    assert first == pytest.approx(second, abs=1e-7), (first, second)
    assert all(b.buffer.dtype == torch.float32 for per in oss.buckets.values() for b in per.values())


def _case_add_param_group_state_dict(rank: int, world_size: int) -> None:
    """A group added after construction is saved and restored (into an OSS with absurd hyper-parameters)."""

    def build(lr: float, lr_head: float) -> Any:
        model = _model()
        params = list(model.parameters())
        oss = OSS(params[:4], torch.optim.SGD, lr=lr, momentum=0.9)
        oss.add_param_group({"params": params[4:], "lr": lr_head})
        return model, oss

    model, oss = build(0.1, 0.05)
    _train_losses(model, oss, rank, world_size, range(2))
    state = oss.state_dict(all_ranks=True)
    assert [g["lr"] for g in state["param_groups"]] == [0.1, 0.05] and sorted(state["state"]) == list(range(6))
    twin, twin_oss = build(1e6, 1e6)
    twin.load_state_dict(model.state_dict())
    twin_oss.load_state_dict(copy.deepcopy(state))
    _train_losses(model, oss, rank, world_size, range(2, 4))
    _train_losses(twin, twin_oss, rank, world_size, range(2, 4))
    _assert_same_params(model, twin, "reloaded twin")


def _case_non_parameter_state(rank: int, world_size: int) -> None:
    """A wrapper's entry in OSS.state (AdaScale keeps "adascale" there) is saved after the sorted parameter keys
    and loaded back into OSS.state (upstream raised TypeError sorting int and str keys together)."""
    model = _model()
    oss = OSS(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    oss.state["wrapper"] = {"scale": 2.0}
    _train_losses(model, oss, rank, world_size, range(1))
    state = oss.state_dict(all_ranks=True)
    assert list(state["state"]) == list(range(6)) + ["wrapper"]
    other = OSS(_model().parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    other.load_state_dict(copy.deepcopy(state))
    assert dict(other.state) == {"wrapper": {"scale": 2.0}}


def test_step_features() -> None:
    run_distributed(_step_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Parity with DDP + the plain optimizer


def _parity_case(rank: int, world_size: int, device: torch.device, name: str, two_groups: bool, micro: int) -> None:
    optim_cls, kwargs = OPTIMS[name]
    model = _model().to(device)
    ref_model = copy.deepcopy(model)
    oss = OSS(_groups(model, two_groups), optim_cls, **kwargs)
    ddp_oss = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ref = DDP(ref_model, device_ids=[device.index] if device.type == "cuda" else None)
    ref_opt = optim_cls(_groups(ref_model, two_groups), **kwargs)
    for step in range(3):
        for net, opt in ((ddp_oss, oss), (ref, ref_opt)):
            opt.zero_grad()
            for m in range(micro):
                ctx = net.no_sync() if m < micro - 1 else _nullcontext()
                with ctx:
                    _loss(net, _data(step, rank, m).to(device)).backward()
            opt.step()
        _assert_same_params(model, ref_model, f"{name} step {step}")


def _freeze_case(rank: int, world_size: int, name: str) -> None:
    """Freeze a parameter after the first step and unfreeze it after the second; reference on one process."""
    optim_cls, kwargs = OPTIMS[name]
    model = _model()
    ref_model = copy.deepcopy(model)
    oss = OSS(model.parameters(), optim_cls, **kwargs)
    ref_opt = optim_cls(ref_model.parameters(), **kwargs)
    for step in range(4):
        if step in (1, 2):
            trainable = step != 1
            for m in (model, ref_model):
                list(m.parameters())[2].requires_grad_(trainable)
            oss.refresh_trainable()
        oss.zero_grad()
        _loss(model, _data(step, rank)).backward()
        _average_grads(model, world_size)
        oss.step()
        _reference_step(ref_model, ref_opt, world_size, step)
        _assert_same_params(model, ref_model, f"{name} freeze step {step}")


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _parity_body(rank: int, world_size: int, device_type: str) -> None:
    device = _device(device_type, rank)
    cases = []
    # The whole matrix at world size 2; elsewhere the richest combination (two groups, accumulation) per optimizer.
    full = world_size == 2
    for name in OPTIMS:
        for two_groups in (False, True) if full else (True,):
            for micro in (1, 2) if full else (2,):
                label = f"{name},groups={2 if two_groups else 1},micro={micro}"
                cases.append(
                    (label, lambda n=name, g=two_groups, m=micro: _parity_case(rank, world_size, device, n, g, m))
                )
        if device_type == "cpu" and (full or name == "adamw"):
            cases.append((f"{name},freeze/unfreeze", lambda n=name: _freeze_case(rank, world_size, n)))
    run_cases(cases)


PARITY_WORLDS = [("cpu", 1), ("cpu", 2), ("cpu", 4), ("cuda", 1), ("cuda", 2)]


@pytest.mark.parametrize("device_type,world_size", PARITY_WORLDS, ids=[f"{d}-ws{w}" for d, w in PARITY_WORLDS])
def test_parity_with_ddp(device_type: str, world_size: int) -> None:
    """OSS + DDP trains exactly like DDP + the plain optimizer (SGD, Adam, AdamW; groups; no_sync accumulation)."""
    run_distributed(_parity_body, world_size, device_type, device=device_type, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints


def _train_oss(model: nn.Module, oss: OSS, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        oss.zero_grad()
        _loss(model, _data(step, rank)).backward()
        _average_grads(model, world_size)
        oss.step()


def _continue_reference(checkpoint: Dict[str, Any], world_size: int, steps: range) -> nn.Module:
    ref = _model()
    ref.load_state_dict(checkpoint["model"])
    opt = torch.optim.Adam(_groups(ref, True), lr=0.01)
    opt.load_state_dict(copy.deepcopy(checkpoint["optim"]))
    for step in steps:
        _reference_step(ref, opt, world_size, step)
    return ref


def _save_body(rank: int, world_size: int, path: str) -> None:
    model = _model()
    oss = OSS(_groups(model, True), torch.optim.Adam, lr=0.01)
    _train_oss(model, oss, rank, world_size, range(3))
    recipient = 1
    with count_collectives() as counter:
        oss.consolidate_state_dict(recipient_rank=recipient)
    # One object broadcast per non-recipient rank.
    assert counter.count("broadcast_object") == world_size - 1, counter.summary()
    if rank != recipient:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            oss.state_dict()
    else:
        state = oss.state_dict()
        assert sorted(state["state"]) == list(range(6))
        assert [g["params"] for g in state["param_groups"]] == [[0, 1, 2, 3], [4, 5]]
        assert state["param_groups"][1]["lr"] == 0.05
        assert all(t.device.type == "cpu" for s in state["state"].values() for t in s.values())
        torch.save({"model": model.state_dict(), "optim": state}, path)
    everywhere = oss.state_dict(all_ranks=True)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    for key, value in saved["optim"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(everywhere["state"][key][name], tensor), (key, name)
    # Snapshot semantics: stepping on does not change a consolidated dict.
    _train_oss(model, oss, rank, world_size, range(3, 4))
    for key, value in saved["optim"]["state"].items():
        assert torch.equal(everywhere["state"][key]["exp_avg"], value["exp_avg"]), key


def _load_body(rank: int, world_size: int, path: str) -> None:
    checkpoint = torch.load(path, weights_only=False)
    model = _model()
    model.load_state_dict(checkpoint["model"])
    # Absurd hyper-parameters: the checkpoint's replace them.
    oss = OSS(_groups(model, True, lr_head=1e3), torch.optim.Adam, lr=1e3)
    loaded = copy.deepcopy(checkpoint["optim"])
    oss.load_state_dict(loaded)
    assert [g["lr"] for g in oss.param_groups] == [0.01, 0.05]
    assert [g["lr"] for g in oss.optim.param_groups] == [0.01, 0.05]
    # Only the owned state is kept here, and (as upstream) the others' entries are emptied in the input dict.
    owned = {oss._param_to_index[id(p)] for g in oss.optim.param_groups for p in g["params"]}
    assert {k for k, v in loaded["state"].items() if v} == owned
    assert len(oss.optim.state) == len(owned)
    _train_oss(model, oss, rank, world_size, range(3, 5))
    ref = _continue_reference(checkpoint, world_size, range(3, 5))
    _assert_same_params(model, ref, f"after loading at world size {world_size}", atol=1e-5)
    # Round trip: the state saved now matches the reference optimizer's.
    oss.consolidate_state_dict(recipient_rank=0)
    if rank == 0:
        state = oss.state_dict()
        assert sorted(state["state"]) == list(range(6))


def test_checkpoint_across_world_sizes(tmp_path: Any) -> None:
    """Consolidate + save at world size 2; load and continue at 2, 1 and 4, like a plain optimizer would."""
    path = os.path.join(str(tmp_path), "oss.pt")
    run_distributed(_save_body, 2, path, timeout=TIMEOUT)
    for world_size in (2, 1, 4):
        run_distributed(_load_body, world_size, path, timeout=TIMEOUT)


def _snapshot(oss: OSS) -> Any:
    inner = {id(p): {k: v.clone() for k, v in s.items()} for p, s in oss.optim.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in oss.param_groups]
    inner_groups = [{k: v for k, v in g.items() if k != "params"} for g in oss.optim.param_groups]
    return inner, groups, inner_groups


def _same_snapshot(a: Any, b: Any) -> bool:
    if a[1:] != b[1:] or a[0].keys() != b[0].keys():
        return False
    return all(torch.equal(a[0][k][n], b[0][k][n]) for k in a[0] for n in a[0][k])


def _bad_input_body(rank: int, world_size: int) -> None:
    model = _model()
    oss = OSS(_groups(model, True), torch.optim.Adam, lr=0.01)
    _train_oss(model, oss, rank, world_size, range(2))
    good = oss.state_dict(all_ranks=True)
    shard = oss.optim.state_dict()
    missing_group = copy.deepcopy(good)
    missing_group["param_groups"] = missing_group["param_groups"][:1]
    bad_shape = copy.deepcopy(good)
    bad_shape["state"][0]["exp_avg"] = torch.zeros(7, 7)
    # A (1, n) moment for an (m, n) weight: a factored statistic's shape, but Adam's exp_avg is per element (the
    # next step would read and write out of bounds).
    factored_moment = copy.deepcopy(good)
    factored_moment["state"][0]["exp_avg"] = torch.zeros(1, 4)
    larger_unknown = copy.deepcopy(good)
    larger_unknown["state"][1]["extra_statistic"] = torch.zeros(7)
    unknown = copy.deepcopy(good)
    unknown["state"][17] = {}
    bad_group_size = copy.deepcopy(good)
    bad_group_size["param_groups"][1]["params"] = [4]
    # Indices as text (a dict through JSON): kept as a wrapper's entries, every parameter's state dropped (session 45).
    text_keys = copy.deepcopy(good)
    text_keys["state"] = {str(k): v for k, v in text_keys["state"].items()}
    cases = [
        ("unconsolidated shard", shard, ValueError, "consolidate_state_dict"),
        ("missing param group", missing_group, ValueError, "1 parameter groups but this optimizer has 2"),
        ("mismatched shapes", bad_shape, ValueError, "shape"),
        ("per-element moment of another shape", factored_moment, ValueError, r"\(1, 4\), but .*\(6, 4\)"),
        ("statistic larger than its parameter", larger_unknown, ValueError, "'extra_statistic' of parameter 1"),
        ("unknown parameter", unknown, ValueError, "parameter 17"),
        ("group size", bad_group_size, ValueError, "group 1"),
        ("indices as text", text_keys, ValueError, r"string '0', a parameter index as text.*int\(key\)"),
        ("no state key", {"param_groups": good["param_groups"]}, ValueError, "state"),
        ("not a dict", [1, 2], TypeError, "mapping"),
    ]
    before = _snapshot(oss)
    for name, bad, error, match in cases:
        pristine = copy.deepcopy(bad)
        with pytest.raises(error, match=match):
            oss.load_state_dict(bad)
        assert _same_snapshot(before, _snapshot(oss)), f"{name}: a failed load changed the optimizer"
        if isinstance(bad, dict) and "state" in bad:
            assert bad["state"].keys() == pristine["state"].keys(), f"{name}: the input dict was changed"
            assert all(bool(v) == bool(pristine["state"][k]) for k, v in bad["state"].items())
    # The optimizer still works and still loads a good dict.
    oss.load_state_dict(copy.deepcopy(good))
    _train_oss(model, oss, rank, world_size, range(2, 3))


def test_bad_checkpoints_leave_optimizer_unchanged() -> None:
    run_distributed(_bad_input_body, 2, timeout=TIMEOUT)


def _force_broadcast_object_body(rank: int, world_size: int) -> None:
    model = _model()
    oss = OSS(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, force_broadcast_object=True)
    _train_oss(model, oss, rank, world_size, range(2))
    with count_collectives() as counter:
        state = oss.state_dict(all_ranks=True)
    assert counter.count("broadcast_object") == 0 and counter.count("broadcast") == 2 * world_size
    plain = OSS(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    plain.load_state_dict(copy.deepcopy(state))
    assert sorted(state["state"]) == list(range(6))


def test_force_broadcast_object() -> None:
    run_distributed(_force_broadcast_object_body, 2, timeout=TIMEOUT)


def _empty_first_group_body(rank: int, world_size: int) -> None:
    """An empty first parameter group, which torch's optimizers accept: every step() raised IndexError (it read the
    first group's first parameter to detect a device change; found by a review)."""
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    oss = OSS([{"params": [], "lr": 0.3}, {"params": list(model.parameters())}], optim=torch.optim.SGD, lr=0.05)
    ref_opt = torch.optim.SGD([{"params": [], "lr": 0.3}, {"params": list(ref.parameters())}], lr=0.05)
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)]
    for step in range(2):
        oss.zero_grad()
        model(batches[rank] * (step + 1)).sum().backward()
        for p in model.parameters():  # average as DDP would
            dist.all_reduce(p.grad)
            p.grad /= world_size
        oss.step()
        ref_opt.zero_grad()
        (sum(ref(b * (step + 1)).sum() for b in batches) / world_size).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_empty_first_group() -> None:
    run_distributed(_empty_first_group_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Accelerator only


def _device_change_body(rank: int, world_size: int) -> None:
    """Parameters moved to the accelerator after OSS was built: the next step re-allocates the buckets there."""
    model = nn.Linear(2, 2)
    oss = OSS(model.parameters(), lr=0.1)
    assert oss._default_device.type == "cpu"
    device = torch.device("cuda", rank)
    model.to(device)
    model(torch.rand(3, 2, device=device)).sum().backward()
    before = model.weight.detach().clone()
    oss.step()
    assert oss._default_device.type == "cuda"
    assert all(b.buffer.device.type == "cuda" for per in oss.buckets.values() for b in per.values())
    assert not torch.equal(model.weight.detach(), before)


def test_device_change() -> None:
    run_distributed(_device_change_body, 1, device="cuda", timeout=240.0)
