# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A unit used twice (ALBERT-style weight sharing) under activation checkpointing, against the plain model.

Found by a fuzz of the fork's features and a review (session 45), after a change that let a late pre-backward hook
leave the handles reduced in this backward alone (reverted): the second use's hook, and the output of a reentrant
checkpoint inside the unit, are late hooks whose backward still reads those parameters.

* Both uses inside one checkpointed region (``checkpoint_wrapper`` or torch's reentrant checkpoint) with
  ``optimize_backward_concat`` (and mixed precision): the first use's backward read freed parameters ("setStorage").
* ``FSDP(checkpoint_wrapper(block))`` used twice per forward, two forwards before their backwards: the second
  backward's recomputation read the shard ("mat2 must be a matrix" / "not in memory between steps").
* A unit returning a reentrant checkpoint's output, whose layer it also uses directly, not flattened: the
  recomputation read the shard of the layer reduced by then.

Two gloo ranks, the same data on both.
"""

import functools

import torch
from test_fsdp_output_hooks import _step_and_compare  # tests/nn/data_parallel is on sys.path
from torch import nn
from torch.utils.checkpoint import checkpoint

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 2
TIMEOUT = 120.0


class Pair(nn.Module):
    """A shared layer applied twice, checkpointed as one region."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(torch.tanh(self.blk(x)))


class PairNet(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.pair, self.mode = nn.Linear(4, 4), Pair(), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        return checkpoint(self.pair, x, use_reentrant=True) if self.mode == "reentrant" else self.pair(x)


class SharedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blk = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(torch.tanh(self.blk(torch.tanh(self.inp(x)))))


def _batches() -> list:
    return [torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]


def _case_two_uses_in_one_region(mode: str) -> None:
    reference = PairNet(mode)
    net = PairNet(mode)
    net.pair.blk = FSDP(net.pair.blk, optimize_backward_concat=True)
    if mode == "checkpoint_wrapper":
        net.pair = checkpoint_wrapper(net.pair)
    model = FSDP(net, optimize_backward_concat=True)
    x = _batches()[0]
    reference(x).sum().backward()
    model(x).sum().backward()
    _step_and_compare(model, reference)


def _case_two_forwards_of_a_checkpointed_shared_unit(flatten: bool) -> None:
    reference = SharedNet()
    net = SharedNet()
    net.blk = FSDP(checkpoint_wrapper(net.blk), flatten_parameters=flatten)
    model = FSDP(net, flatten_parameters=flatten)
    losses = [reference(x).sum() for x in _batches()]
    for loss in losses:
        loss.backward()
    losses = [model(x).sum() for x in _batches()]
    for loss in losses:
        loss.backward()
    _step_and_compare(model, reference)


class CheckpointInside(nn.Module):
    """A unit returning a reentrant checkpoint's output, whose layer it also uses directly."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        b = checkpoint(self.l3, x, use_reentrant=True)
        return self.l2(torch.tanh(self.l1(x)) + b) + self.l3(x), b


class CheckpointInsideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.unit = nn.Linear(4, 4), CheckpointInside()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.unit(torch.tanh(self.inp(x)))
        return (a * a).sum() + b.sum()


def _case_late_hook_of_a_checkpoint_inside_the_unit(flatten: bool) -> None:
    # The checkpoint's output gets its gradient after l3's direct use reduced l3; its recomputation reads l3 again.
    # A first version of "a late hook leaves reduced parameters alone" read the shard there (a review, session 45).
    reference = CheckpointInsideNet()
    net = CheckpointInsideNet()
    net.unit = FSDP(net.unit, flatten_parameters=flatten)
    model = FSDP(net, flatten_parameters=flatten)
    x = _batches()[0]
    reference(x).backward()
    model(x).backward()
    _step_and_compare(model, reference)


def _body(rank: int, world_size: int) -> None:
    cases = [
        (f"two uses in one {m} region", functools.partial(_case_two_uses_in_one_region, m))
        for m in ("reentrant", "checkpoint_wrapper")
    ]
    cases += [
        (f"two forwards, flatten={f}", functools.partial(_case_two_forwards_of_a_checkpointed_shared_unit, f))
        for f in (True, False)
    ]
    cases += [
        (f"checkpoint inside, flatten={f}", functools.partial(_case_late_hook_of_a_checkpoint_inside_the_unit, f))
        for f in (True, False)
    ]
    run_cases(cases)


def test_shared_unit_under_checkpointing() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
