# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel with more than one backward per optimizer step, outside ``no_sync()``.

torch's DDP reduces every backward and its gradients add up: after ``forward, backward, forward, backward`` a step
uses the sum over the backwards of the rank-averaged gradients. Upstream fairscale (and this package before) mixed
the first reduction's result into the second one (divided by the world size again, or not reduced at all), silently.
An evaluation forward between a training forward and its backward cancelled that backward's reduction. Each case
trains 2 gloo ranks and compares the parameters after the step with a plain model whose gradients are averaged by
hand, backward by backward.
"""

import copy
from typing import List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 120.0
BUCKETS = [0, 2**20]  # unbucketed reductions, and one bucket per owner


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(i: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * i + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _reference_step(ref: nn.Module, opt: torch.optim.Optimizer, batches: List[torch.Tensor]) -> None:
    """What DDP computes: each backward's gradient averaged over the ranks, summed over the backwards."""
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for x in batches:
        grads = torch.autograd.grad(_loss(ref, x), list(ref.parameters()))
        for t, g in zip(total, grads):
            dist.all_reduce(g)
            t.add_(g / dist.get_world_size())
    for p, t in zip(ref.parameters(), total):
        p.grad = t
    opt.step()
    opt.zero_grad()


def _gap(model: nn.Module, ref: nn.Module) -> float:
    return max((p - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))


def _pattern_body(rank: int, world_size: int, pattern: str, bucket: int, zero: str) -> List[float]:
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    gaps = []
    reduces = []
    for step in range(3):
        x1, x2, x3 = (_batch(3 * step + i, rank) for i in range(3))
        with collectives.count_collectives() as counter:
            if pattern == "accumulate":  # forward, backward, forward, backward
                _loss(sdp, x1).backward()
                _loss(sdp, x2).backward()
                batches = [x1, x2]
            elif pattern == "two_forwards":  # forward, forward, backward, backward (DDP refuses this one)
                first, second = _loss(sdp, x1), _loss(sdp, x2)
                first.backward()
                second.backward()
                batches = [x1, x2]
            elif pattern == "retain_graph":  # the same graph twice
                loss = _loss(sdp, x1)
                loss.backward(retain_graph=True)
                loss.backward()
                batches = [x1, x1]
            else:  # "three": three forward/backward pairs
                _loss(sdp, x1).backward()
                _loss(sdp, x2).backward()
                _loss(sdp, x3).backward()
                batches = [x1, x2, x3]
        reduces.append(float(counter.count("reduce")))
        opt.step()
        if zero == "optimizer":
            opt.zero_grad()  # releases the gradients (set_to_none)
        elif zero == "zeros":
            opt.zero_grad(set_to_none=False)
        else:
            sdp.zero_grad()
        _reference_step(ref, ref_opt, batches)
        gaps.append(_gap(model, ref))
    return gaps + reduces


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
@pytest.mark.parametrize(
    "pattern,zero",
    [
        ("accumulate", "optimizer"),
        ("accumulate", "zeros"),
        ("two_forwards", "wrapper"),
        ("retain_graph", "optimizer"),
        ("three", "zeros"),
    ],
)
def test_backwards_add_up_like_ddp(pattern: str, zero: str, bucket: int) -> None:
    results = run_distributed(_pattern_body, 2, pattern, bucket, zero, timeout=TIMEOUT)
    for gaps_and_counts in results:
        gaps, reduces = gaps_and_counts[:3], gaps_and_counts[3:]
        assert max(gaps) < 1e-6, gaps
        # Every backward outside no_sync() reduces (4 parameters, or 1 bucket per owner rank).
        per_backward = 4 if bucket == 0 else 2
        backwards = 3 if pattern == "three" else 2
        assert reduces == [float(backwards * per_backward)] * 3, reduces


def _eval_between_body(rank: int, world_size: int, auto_refresh: bool, bucket: int) -> float:
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket, auto_refresh_trainable=auto_refresh)
    for step in range(2):
        x = _batch(step, rank)
        loss = _loss(sdp, x)  # training forward
        sdp.eval()
        with torch.no_grad():
            sdp(x)  # an evaluation (logging) before the backward
        sdp.train()
        loss.backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ref_opt, [x])
    return _gap(model, ref)


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
@pytest.mark.parametrize("auto_refresh", [True, False], ids=["auto_refresh", "manual_refresh"])
def test_eval_forward_before_backward_keeps_the_reduction(auto_refresh: bool, bucket: int) -> None:
    gaps = run_distributed(_eval_between_body, 2, auto_refresh, bucket, timeout=TIMEOUT)
    assert max(gaps) < 1e-6, gaps


def _no_sync_after_reduced_body(rank: int, world_size: int, bucket: int) -> float:
    """A reduced backward, then one inside ``no_sync()``, then the step: as with DDP, each owner steps with the
    average of the first backward plus its own local gradient of the second (nothing is set aside inside no_sync)."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    x1, x2 = _batch(0, rank), _batch(1, rank)
    _loss(sdp, x1).backward()
    with sdp.no_sync():
        _loss(sdp, x2).backward()
    opt.step()
    owner = opt._param_to_rank
    params = list(ref.parameters())
    first = torch.autograd.grad(_loss(ref, x1), params)
    second = torch.autograd.grad(_loss(ref, x2), params)
    with torch.no_grad():
        for p, mine, g1, g2 in zip(params, model.parameters(), first, second):
            dist.all_reduce(g1)
            local = g2.clone() if owner[mine] == rank else torch.zeros_like(g2)
            dist.all_reduce(local)  # the owner's own local gradient, on every rank
            p.sub_(0.1 * (g1 / world_size + local))
    return _gap(model, ref)


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
def test_no_sync_backward_after_a_reduced_one(bucket: int) -> None:
    gaps = run_distributed(_no_sync_after_reduced_body, 2, bucket, timeout=TIMEOUT)
    assert max(gaps) < 1e-6, gaps


def _grad_between_body(rank: int, world_size: int, bucket: int) -> float:
    """``autograd.grad`` (a gradient penalty's first part) between two backwards leaves .grad alone."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    x1, x2 = _batch(0, rank), _batch(1, rank)
    _loss(sdp, x1).backward()
    torch.autograd.grad(_loss(sdp, x2), list(model.parameters()))
    _loss(sdp, x2).backward()
    opt.step()
    _reference_step(ref, ref_opt, [x1, x2])
    return _gap(model, ref)


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
def test_autograd_grad_between_backwards(bucket: int) -> None:
    gaps = run_distributed(_grad_between_body, 2, bucket, timeout=TIMEOUT)
    assert max(gaps) < 1e-6, gaps


def _rebuild_then_window_body(rank: int, world_size: int, trigger: str) -> float:
    model = _model()
    ref = copy.deepcopy(model)
    first = list(model[0].parameters()) if trigger == "add_param_group" else list(model.parameters())
    opt = OSS(first, optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(list(ref.parameters())[: len(first)], lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=2**20)
    gap = 0.0
    for step in range(3):
        if step == 1 and trigger == "add_param_group":
            opt.add_param_group({"params": list(model[2].parameters())})
            ref_opt.add_param_group({"params": list(ref[2].parameters())})
        opt.zero_grad(set_to_none=False)  # p.grad.zero_() on the bucket views
        if step == 1 and trigger == "eval":  # an evaluation forward between steps rebuilds the buckets
            sdp.eval()
            with torch.no_grad():
                sdp(_batch(99, rank))
            sdp.train()
        x1, x2 = _batch(2 * step, rank), _batch(2 * step + 1, rank)
        with sdp.no_sync():
            _loss(sdp, x1).backward()
        _loss(sdp, x2).backward()
        opt.step()
        _reference_step(ref, ref_opt, [x1, x2])
        gap = max(gap, _gap(model, ref))
    return gap


@pytest.mark.parametrize("trigger", ["eval", "add_param_group"])
def test_no_sync_window_after_a_bucket_rebuild_with_zeroed_gradients(trigger: str) -> None:
    """Found by a fuzz of SDP training loops (session 42): after a bucket rebuild (an eval() forward between steps,
    add_param_group), gradients zeroed in place by the optimizer no longer moved the bucket's version, so the next
    reduced backward added the no_sync() window's unreduced gradients to the reduced ones (10-30 % off, silently)."""
    gaps = run_distributed(_rebuild_then_window_body, 2, trigger, timeout=TIMEOUT)
    assert max(gaps) < 1e-6, gaps


def _refresh_between_body(rank: int, world_size: int) -> float:
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, opt, auto_refresh_trainable=False)
    gap = 0.0
    for step in range(2):
        x = _batch(step, rank)
        loss = _loss(sdp, x)
        sdp.refresh_trainable()  # e.g. a callback between the forward and the backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ref_opt, [x])
        gap = max(gap, _gap(model, ref))
    # reduce() inside no_sync() reduced part of the gradients wrong, silently: refused, on every rank alike.
    with sdp.no_sync():
        _loss(sdp, _batch(9, rank)).backward()
        with pytest.raises(RuntimeError, match=r"reduce\(\) inside no_sync\(\): leave the no_sync\(\) context first"):
            sdp.reduce()
    sdp.reduce()
    return gap


def test_refresh_between_forward_and_backward_and_reduce_inside_no_sync() -> None:
    """Found by a fuzz of SDP training loops (session 42): refresh_trainable() between a forward and its backward
    dropped that backward's reduction (each owner stepped with its own gradient), and reduce() inside no_sync() gave
    wrong gradients; both silently."""
    gaps = run_distributed(_refresh_between_body, 2, timeout=TIMEOUT)
    assert max(gaps) < 1e-6, gaps
