# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A skip that carries a gradient and is changed in place after its stash is refused at the pop.

A skip across partitions carries its gradient from the stash point: a change after it (``ReLU(inplace=True)`` right
after the stash) was missed by the gradient, silently, and a popping layer that changed it in a checkpointed
partition recomputed with the changed values (found by fuzzes of Pipe, session 44).
"""

import copy

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe
from fairscale.nn.pipe.skip import pop, skippable, stash

from .._util import PopAdd, StashInput


@skippable(stash=["s"])
class StashCopy(nn.Module):
    def forward(self, x):
        yield stash("s", x * 1)
        return x  # noqa: B901


@skippable(pop=["s"])
class PopScaleInPlace(nn.Module):
    def forward(self, x):
        s = yield pop("s")
        s.mul_(2)
        return x * s  # noqa: B901


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_in_place_change_after_the_stash_is_refused(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), StashInput(), nn.ReLU(inplace=True), nn.Linear(4, 4), PopAdd())
    pipe = Pipe(model, [3, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    with pytest.raises(RuntimeError, match=r"skip 's' carries a gradient and was changed in place.*clone\(\)"):
        pipe(torch.randn(4, 4)).sum().backward()


def test_in_place_change_by_a_checkpointed_pop_is_refused_and_plain_one_works():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), StashCopy(), nn.Linear(4, 4), PopScaleInPlace())
    x = torch.randn(4, 4)
    model = copy.deepcopy(reference)
    with pytest.raises(RuntimeError, match="skip 's' was changed in place after its pop"):
        Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")(x).sum().backward()
    reference(x).sum().backward()  # "never": the pop's change is seen once, as in the plain module
    model = copy.deepcopy(reference)
    model.zero_grad()
    Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="never")(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


@skippable(stash=["mask"])
class StashMask(nn.Module):
    def forward(self, x):
        yield stash("mask", (x > 0).float())
        return x  # noqa: B901


@skippable(pop=["mask"])
class PopMaskInPlace(nn.Module):
    def forward(self, x):
        mask = yield pop("mask")
        mask.mul_(0.5)  # no gradient: changed as in the plain module
        return x * mask  # noqa: B901


def test_skip_without_gradient_changed_in_place_by_a_checkpointed_pop_is_refused():
    # The recomputation would pop the halved mask and halve it again (the gradients came out wrong, silently).
    model = nn.Sequential(StashMask(), nn.Linear(4, 4), PopMaskInPlace())
    pipe = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    with pytest.raises(RuntimeError, match="skip 'mask' was changed in place after its pop"):
        pipe(torch.randn(4, 4)).sum().backward()


@pytest.mark.parametrize("checkpoint", ["never"])
def test_skip_without_gradient_changed_in_place_works(checkpoint):
    torch.manual_seed(0)
    reference = nn.Sequential(StashMask(), nn.Linear(4, 4), PopMaskInPlace())
    x = torch.randn(4, 4)
    want = reference(x)
    want.sum().backward()
    model = copy.deepcopy(reference)
    model.zero_grad()
    got = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad)


# What the refusal must let through (found by a review of its first version, which refused them).


class ReluRightInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 2:].relu_()
        return x


@skippable(stash=["s"])
class StashLeft(nn.Module):
    def forward(self, x):
        yield stash("s", x[:, :2])  # a view: shares its version counter with x
        return x  # noqa: B901


@skippable(pop=["s"])
class PopMulLeft(nn.Module):
    def forward(self, x):
        s = yield pop("s")
        return x[:, :2] * s  # noqa: B901


def _same_as_sequential(reference: nn.Sequential, balance, checkpoint: str, x: torch.Tensor) -> None:
    model = copy.deepcopy(reference)
    reference(x).sum().backward()
    Pipe(model, balance, devices=["cpu"] * len(balance), chunks=2, checkpoint=checkpoint)(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        if want.grad is None:
            assert got.grad is None
        else:
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_frozen_stash_changed_in_place_before_a_checkpointed_partition_trains(checkpoint):
    # The skip needs no gradient (frozen feature extractor): both passes pop the same changed values.
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    reference = nn.Sequential(frozen, StashInput(), nn.ReLU(inplace=True), nn.Linear(4, 4), PopAdd())
    _same_as_sequential(reference, [4, 1], checkpoint, torch.randn(8, 4))


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_view_skip_with_another_part_changed_in_place_trains(checkpoint):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), StashLeft(), ReluRightInPlace(), nn.Linear(4, 4), PopMulLeft())
    _same_as_sequential(reference, [3, 2], checkpoint, torch.randn(8, 4))
