# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A ShardedDataParallel that is still referenced leaves alone the backwards that are not its own.

Two Lightning fits of one model (``strategy="ddp_sharded"``) wrap the same module twice, and the first trainer keeps
the first wrapper alive. Its hooks stay on the parameters: after its last backward was reduced, it started a new
round of reductions for every later backward that reached them, the second wrapper's (two reducers raced on the same
gradients: wrong values, internal errors or a hang) or a plain backward through the bare module after training (one
rank alone then waited in a collective until the group's timeout). Each case trains 2 gloo ranks, compares the
parameters with a plain model whose gradients are averaged by hand, backward by backward, and counts the reductions.
"""

import copy
from typing import Any, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 90.0
BUCKETS = [0, 2**20]  # unbucketed reductions, and one bucket per owner
PATTERNS = ["single", "two_forwards", "retain_graph", "inside_forward"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(i: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * i + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


class _Manual(nn.Module):
    """Lightning's manual optimization: the wrapped forward runs the backwards itself (two here, same parameters)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> None:
        _loss(self.model, first).backward()
        _loss(self.model, second).backward()


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


def _run_pattern(sdp: ShardedDataParallel, pattern: str, x1: torch.Tensor, x2: torch.Tensor) -> List[torch.Tensor]:
    """One step's forwards and backwards through ``sdp``; returns the batches, one per backward."""
    if pattern == "single":
        _loss(sdp, x1).backward()
        return [x1]
    if pattern == "two_forwards":  # forward, forward, backward, backward
        first, second = _loss(sdp, x1), _loss(sdp, x2)
        first.backward()
        second.backward()
        return [x1, x2]
    if pattern == "retain_graph":  # the same graph twice
        loss = _loss(sdp, x1)
        loss.backward(retain_graph=True)
        loss.backward()
        return [x1, x1]
    sdp(x1, x2)  # "inside_forward"
    return [x1, x2]


def _second_fit_body(rank: int, world_size: int, pattern: str, bucket: int) -> List[float]:
    model = _model()
    ref = copy.deepcopy(model)
    # First fit: its wrapper (and optimizer) stay referenced, as trainer1.strategy.model keeps them.
    first_opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    first = ShardedDataParallel(model, first_opt, reduce_buffer_size=bucket)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x = _batch(step, rank)
        _loss(first, x).backward()
        first_opt.step()
        first_opt.zero_grad()
        _reference_step(ref, ref_opt, [x])
    # Second fit over the same module: a new optimizer and wrapper (Lightning's manual optimization wraps its own
    # module around the model, with the same parameters).
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05, momentum=0.5)
    wrapped = _Manual(model) if pattern == "inside_forward" else model
    sdp = ShardedDataParallel(wrapped, opt, reduce_buffer_size=bucket)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    gaps, reduces = [], []
    for step in range(2, 5):
        x1, x2 = _batch(2 * step, rank), _batch(2 * step + 1, rank)
        with collectives.count_collectives() as counter:
            batches = _run_pattern(sdp, pattern, x1, x2)
        reduces.append(float(counter.count("reduce")) / len(batches))
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ref_opt, batches)
        gaps.append(_gap(model, ref))
    assert first is not None  # alive until here
    return gaps + reduces


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_module_wrapped_again_is_reduced_by_its_new_wrapper_only(pattern: str, bucket: int) -> None:
    results = run_distributed(_second_fit_body, 2, pattern, bucket, timeout=TIMEOUT)
    for gaps_and_counts in results:
        gaps, reduces = gaps_and_counts[:3], gaps_and_counts[3:]
        assert max(gaps) < 1e-6, gaps
        # Each backward reduces once, by the new wrapper: 4 parameters, or 1 bucket per owner rank.
        assert reduces == [4.0 if bucket == 0 else 2.0] * 3, reduces


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None, "the plain backward gave no gradient"
    return param.grad


def _plain_backward_body(rank: int, world_size: int, bucket: int, ranks: str) -> List[Any]:
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):  # fit
        x = _batch(step, rank)
        _loss(sdp, x).backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ref_opt, [x])
    counts, local_gap = 0.0, 0.0
    if ranks == "all" or rank == 0:
        # After fit, on the bare module (a gradient check under `if trainer.is_global_zero:`): local gradients.
        probe = _batch(50, rank)
        expected = torch.autograd.grad(_loss(ref, probe), list(ref.parameters()))
        model.zero_grad(set_to_none=True)
        with collectives.count_collectives() as counter:
            _loss(model, probe).backward()
        counts = float(counter.count())  # any collective: a reduction, or the ranks' agreement check before it
        local_gap = max((_grad(p) - e).abs().max().item() for p, e in zip(model.parameters(), expected))
        model.zero_grad(set_to_none=True)
    # The wrapper trains on afterwards, in step with its peers.
    x = _batch(7, rank)
    _loss(sdp, x).backward()
    opt.step()
    opt.zero_grad()
    _reference_step(ref, ref_opt, [x])
    return [counts, local_gap, _gap(model, ref)]


@pytest.mark.parametrize("ranks", ["all", "rank0"])
@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
def test_plain_backward_after_training_stays_local(bucket: int, ranks: str) -> None:
    results = run_distributed(_plain_backward_body, 2, bucket, ranks, timeout=TIMEOUT)
    for counts, local_gap, gap in results:
        assert counts == 0.0, "the plain backward communicated"
        assert local_gap < 1e-6, local_gap
        assert gap < 1e-6, gap


def _checkpointed_wrapper_body(rank: int, world_size: int, bucket: int) -> float:
    """The wrapper itself under torch's reentrant checkpoint, after an ordinary step: its forward runs without grad,
    then again inside the backward, so nothing marked the new graph as the wrapper's and that step reduced nothing
    (each owner stepped with its own rank's gradient, silently)."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = _batch(step, rank).requires_grad_(True)
        if step == 0:
            loss = _loss(sdp, x)
        else:
            loss = torch.utils.checkpoint.checkpoint(sdp, x, use_reentrant=True).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ref_opt, [x.detach()])
    return _gap(model, ref)


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
def test_wrapper_under_a_reentrant_checkpoint_is_reduced(bucket: int) -> None:
    for gap in run_distributed(_checkpointed_wrapper_body, 2, bucket, timeout=TIMEOUT):
        assert gap < 1e-6, gap


def _freeze_after_forward_body(rank: int, world_size: int, bucket: int) -> None:
    """Freezing a layer between a forward and its backward: an internal "cannot be None" error before."""
    from fairscale.internal.errors import FairscaleRuntimeError

    model = _model()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1), reduce_buffer_size=bucket)
    loss = _loss(sdp, _batch(0, rank))
    model[0].requires_grad_(False)
    with pytest.raises(FairscaleRuntimeError, match="requires_grad turned off between the forward and its backward"):
        loss.backward()


@pytest.mark.parametrize("bucket", BUCKETS, ids=["unbucketed", "bucketed"])
def test_freezing_between_forward_and_backward_is_explained(bucket: int) -> None:
    run_distributed(_freeze_after_forward_body, 2, bucket, timeout=TIMEOUT)
