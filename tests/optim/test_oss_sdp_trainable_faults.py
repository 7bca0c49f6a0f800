# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS and ShardedDataParallel when trainability changes without a refresh, and ``reduce()`` with unused parameters.

* ``OSS.step()`` after a parameter was unfrozen (on every rank) without ``refresh_trainable()``: the owner stepped it
  and nobody received the new value (it is in no broadcast bucket), the replicas drifted apart silently. It now
  raises the same ``FairscaleRuntimeError`` on every rank, before stepping anything.
* ``ShardedDataParallel(auto_refresh_trainable=False)`` after a parameter was unfrozen (or frozen) on every rank without
  ``refresh_trainable()``: its gradients were never reduced, silently. The backward now raises on every rank, before
  any reduction.
* ``ShardedDataParallel.reduce()`` after a ``no_sync()`` backward that left a parameter without gradient failed with
  an internal error without buckets (``reduce_buffer_size=0``); it now gives the bucketed path's gradients.

Real gloo worlds of two ranks; each body returns what the test compares, so the test sees every rank's result.
"""

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 60.0
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _same_on_every_rank(tensors: List[torch.Tensor]) -> bool:
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [t.detach().clone() for t in tensors])
    return all(torch.equal(a, b) for other in gathered[1:] for a, b in zip(gathered[0], other))


def _averaged_grads(model: nn.Module, x: torch.Tensor, world_size: int) -> None:
    """DDP-like: every rank's gradients become the average over the ranks."""
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


# ------------------------------------------------------------------------------------------------------------------
# OSS


def _oss_unfreeze_body(rank: int, world_size: int) -> Tuple[Optional[str], bool, bool, bool]:
    model, reference = _model(), _model()
    model[0].requires_grad_(False)
    oss = OSS(model.parameters(), lr=LR)
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    model[0].requires_grad_(True)  # on every rank, without oss.refresh_trainable()
    _averaged_grads(model, _data(0, rank), world_size)
    before = [p.detach().clone() for p in model.parameters()]
    message = None
    try:
        oss.step()
    except FairscaleRuntimeError as e:
        message = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # As the message says: refresh, then the step trains every parameter, on every rank alike (exactly as a plain
    # optimizer over the same averaged gradients).
    oss.refresh_trainable()
    oss.step()
    _averaged_grads(reference, _data(0, rank), world_size)
    sgd.step()
    matches = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    # Freezing without a refresh is left alone (as upstream): the parameter stays in its bucket, its owner's value
    # is broadcast, the ranks stay identical.
    model[2].requires_grad_(False)
    oss.zero_grad()
    _averaged_grads(model, _data(1, rank), world_size)
    oss.step()
    return message, unchanged, matches, _same_on_every_rank(list(model.parameters()))


def test_oss_step_refuses_a_parameter_unfrozen_without_refresh() -> None:
    results = run_distributed(_oss_unfreeze_body, 2, timeout=TIMEOUT)
    messages = [r[0] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], "the same error on every rank"
    assert messages[0].startswith("OSS.step: 2 parameter(s) were unfrozen"), messages[0]
    assert "group 0, parameter 0 (shape [4, 4]), group 0, parameter 1 (shape [4])" in messages[0], messages[0]
    assert "refresh_trainable()" in messages[0]
    assert all(r[1] for r in results), "nothing was stepped before the error"
    assert all(r[2] for r in results), "after refresh_trainable() the step equals a plain SGD step"
    assert all(r[3] for r in results), "a parameter frozen without refresh keeps the replicas identical"


# ------------------------------------------------------------------------------------------------------------------
# ShardedDataParallel(auto_refresh_trainable=False)


def _sdp_step(sdp: ShardedDataParallel, oss: OSS, step: int, rank: int) -> None:
    sdp.zero_grad()
    sdp(_data(step, rank)).pow(2).mean().backward()
    oss.step()


def _sdp_stale_body(rank: int, world_size: int, unfreeze: bool) -> List[Tuple[Optional[str], bool, bool]]:
    results = []
    for bucket in (0, 1000):
        model, reference = _model(), _model()
        if unfreeze:
            model[0].requires_grad_(False)
            reference[0].requires_grad_(False)
        oss = OSS(model.parameters(), lr=LR)
        sgd = torch.optim.SGD(reference.parameters(), lr=LR)
        sdp = ShardedDataParallel(model, oss, reduce_buffer_size=bucket, auto_refresh_trainable=False)
        _sdp_step(sdp, oss, 0, rank)
        sgd.zero_grad()
        _averaged_grads(reference, _data(0, rank), world_size)
        sgd.step()
        model[0].requires_grad_(unfreeze)  # on every rank alike, without sdp.refresh_trainable()
        reference[0].requires_grad_(unfreeze)
        message = None
        sdp.zero_grad()
        try:
            sdp(_data(1, rank)).pow(2).mean().backward()
        except FairscaleRuntimeError as e:
            message = str(e)
        # As the message says: refresh, then train on; the result is the averaged-gradient training's.
        sdp.refresh_trainable()
        _sdp_step(sdp, oss, 1, rank)
        sgd.zero_grad(set_to_none=True)
        _averaged_grads(reference, _data(1, rank), world_size)
        sgd.step()
        matches = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
        results.append((message, matches, _same_on_every_rank(list(model.parameters()))))
    return results


@pytest.mark.parametrize("unfreeze", [True, False], ids=["unfrozen", "frozen"])
def test_sharded_ddp_backward_refuses_trainability_changed_without_refresh(unfreeze: bool) -> None:
    per_rank = run_distributed(_sdp_stale_body, 2, unfreeze, timeout=TIMEOUT)
    for bucket_results in zip(*per_rank):  # reduce_buffer_size 0, then 1000
        messages = [r[0] for r in bucket_results]
        assert messages[0] is not None and messages[0] == messages[1], f"the same error on every rank: {messages}"
        assert messages[0].startswith("ShardedDataParallel: requires_grad changed"), messages[0]
        what = "unfrozen, never reduced: " if unfreeze else "frozen, still hooked: "
        assert what + "0.weight, 0.bias" in messages[0] or what + "0.bias, 0.weight" in messages[0], messages[0]
        assert "refresh_trainable()" in messages[0]
        assert all(r[1] for r in bucket_results), "after refresh_trainable() training equals averaged-gradient SGD"
        assert all(r[2] for r in bucket_results), "the replicas stay identical"


# ------------------------------------------------------------------------------------------------------------------
# reduce() after no_sync() with a parameter that got no gradient


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def _reduce_unused_body(rank: int, world_size: int, unused_everywhere: bool) -> Dict[int, Dict[str, Any]]:
    """``{bucket size: {name: owner's gradient after reduce(), or the reference}}``; b is unused on every rank, or
    on rank 1 only (then used on rank 0)."""
    results: Dict[int, Dict[str, Any]] = {}
    for bucket in (0, 1000):
        model, reference = _TwoHeads(), _TwoHeads()
        model.use_b = reference.use_b = not unused_everywhere and rank == 0
        oss = OSS(model.parameters(), lr=LR)
        sdp = ShardedDataParallel(model, oss, reduce_buffer_size=bucket)
        with sdp.no_sync():
            for step in range(2):
                sdp(_data(step, rank)).sum().backward()
                reference(_data(step, rank)).sum().backward()
        sdp.reduce()
        got: Dict[str, Any] = {}
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            local = q.grad if q.grad is not None else torch.zeros_like(q)
            dist.all_reduce(local)
            if oss._param_to_rank[p] == rank:
                got[name] = (None if p.grad is None else p.grad.clone(), local / world_size)
        results[bucket] = got
    return results


@pytest.mark.parametrize("unused_everywhere", [True, False], ids=["unused on every rank", "unused on rank 1"])
def test_reduce_after_no_sync_with_an_unused_parameter(unused_everywhere: bool) -> None:
    per_rank = run_distributed(_reduce_unused_body, 2, unused_everywhere, timeout=TIMEOUT)
    owned = set()
    for results in per_rank:
        unbucketed, bucketed = results[0], results[1000]
        assert unbucketed.keys() == bucketed.keys()
        owned |= set(unbucketed)
        for name, (grad, expected) in unbucketed.items():
            assert grad is not None, f"{name}: no gradient after reduce() without buckets"
            assert torch.allclose(grad, bucketed[name][0], atol=1e-6), f"{name}: differs from the bucketed path"
            assert torch.allclose(grad, expected, atol=1e-6), f"{name}: not the average of the ranks' gradients"
    assert owned == {"a.weight", "a.bias", "b.weight", "b.bias"}, owned
