# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Deferred gradient reduce-scatters (issue 28) on CPU with gloo.

FSDP's bucketer issues each reduce-scatter asynchronously and completes it (wait, replicate all-reduce, callbacks)
when the next one is issued or at the end of backward. These tests check, on real gloo worlds, that a reduction is
still pending during backward (so they fail with the deferral removed) and that the gradients are bitwise those of
the synchronous bucketer: bucketed and direct sends, no_sync accumulation, ``optimize_backward_concat``, hybrid
sharding, and a backward that raised with a reduction pending (the next step neither hangs nor keeps anything of it).
"""

import contextlib
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import hybrid_groups

TIMEOUT = 180.0
DIM = 6
HIDDEN = (5, 7, 9)

# Set by a test: called when the backward reaches the input layer (after every block's gradient was handed to the
# bucketer, before the root's).
PROBE: List[Any] = [None]


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, hidden)
        self.b = nn.Linear(hidden, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.Sequential(*[Block(h) for h in HIDDEN])
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if h.requires_grad and PROBE[0] is not None:
            h.register_hook(lambda g: PROBE[0]())
        return self.head(self.blocks(h))


def _build(kwargs: Dict[str, Any]) -> FSDP:
    torch.manual_seed(0)
    net = Net()
    for i in range(len(HIDDEN)):
        net.blocks[i] = FSDP(net.blocks[i], **kwargs)
    return FSDP(net, **kwargs)


def _configure(model: FSDP, overlap: bool, floor: Optional[int]) -> None:
    """Set the bucketer up (the tree exists after the first forward)."""
    tree = model._tree
    assert tree is not None
    tree.bucketer.overlap = overlap
    if floor is not None:
        tree.bucketer.hold_floor_bytes = floor  # 0: one fill per unit gradient, so several sends per backward


def _batch(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + 10 * mb + rank))


def _train(rank: int, kwargs: Dict[str, Any], overlap: bool, floor: Optional[int], microbatches: int) -> List[Tensor]:
    """Three steps of SGD; returns every step's gradients. Checks that with overlap a reduction was pending when the
    backward reached the input layer, and that none is left after the backward."""
    model = _build(kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: List[bool] = []
    PROBE[0] = lambda: seen.append(model._tree.bucketer.pending)  # type: ignore[union-attr]
    grads: List[Tensor] = []
    try:
        for step in range(3):
            for mb in range(microbatches):
                last = mb == microbatches - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    out = model(_batch(step, mb, rank))
                    _configure(model, overlap, floor)
                    out.square().sum().backward()
            assert model._tree is not None and not model._tree.bucketer.pending
            grads.extend(p.grad.clone() for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        PROBE[0] = None
    synced = seen[microbatches - 1 :: microbatches]  # the probes of synchronizing backwards
    assert any(synced) == overlap, seen  # with overlap a send is still pending when the input layer's grad comes
    return grads


CASES = {
    "bucketed": (dict(), 0, 1),
    "direct": (dict(bucket_cap_mb=0), None, 1),
    "no_sync": (dict(), 0, 2),
    "raf_false": (dict(reshard_after_forward=False), 0, 1),
    "obc": (dict(optimize_backward_concat=True), 0, 2),
}


def _parity_body(rank: int, ws: int) -> None:
    for name, (kwargs, floor, microbatches) in CASES.items():
        reference = _train(rank, kwargs, False, floor, microbatches)
        deferred = _train(rank, kwargs, True, floor, microbatches)
        assert len(reference) == len(deferred)
        for i, (a, b) in enumerate(zip(reference, deferred)):
            assert torch.equal(a, b), f"{name}: gradient {i} differs"


def test_deferred_reduce_scatter_parity() -> None:
    run_distributed(_parity_body, 2, timeout=TIMEOUT)


def _hybrid_body(rank: int, ws: int) -> None:
    shard, replicate = hybrid_groups(2)
    kwargs = dict(process_group=shard, replicate_process_group=replicate)
    reference = _train(rank, kwargs, False, 0, 2)
    deferred = _train(rank, kwargs, True, 0, 2)
    for i, (a, b) in enumerate(zip(reference, deferred)):
        assert torch.equal(a, b), f"hybrid: gradient {i} differs"


def test_deferred_reduce_scatter_hybrid() -> None:
    run_distributed(_hybrid_body, 4, timeout=TIMEOUT)


class _Boom(Exception):
    pass


def _aborted_body(rank: int, ws: int) -> None:
    """Every rank raises in backward while a reduction is pending; the next step neither hangs nor keeps any of the
    failed backward's reductions: its gradients equal those of a model that never failed."""
    reference = _build({})
    out = reference(_batch(0, 0, rank))
    _configure(reference, False, 0)
    out.square().sum().backward()
    expected = [p.grad.clone() for p in reference.parameters()]

    model = _build({})
    seen: List[bool] = []

    def boom() -> None:
        assert model._tree is not None
        seen.append(model._tree.bucketer.pending)
        raise _Boom()

    PROBE[0] = boom
    try:
        out = model(_batch(1, 0, rank))  # another batch: its reductions must not leak into the next step
        _configure(model, True, 0)
        with pytest.raises(_Boom):
            out.square().sum().backward()
    finally:
        PROBE[0] = None
    assert seen == [True]  # the error struck with a reduce-scatter pending
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the previous backward did not finish (it raised); resetting"
        out = model(_batch(0, 0, rank))
    assert model._tree is not None and not model._tree.bucketer.pending  # discarded by the recovery
    out.square().sum().backward()
    for i, (a, p) in enumerate(zip(expected, model.parameters())):
        assert p.grad is not None and torch.equal(a, p.grad), i


def test_deferred_reduce_scatter_aborted_backward() -> None:
    run_distributed(_aborted_body, 2, timeout=60)
