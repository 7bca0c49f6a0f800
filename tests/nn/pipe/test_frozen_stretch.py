# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A frozen stretch before trainable layers: Pipe records what nn.Sequential records, in every checkpoint mode.

The ordering of micro-batches' backwards (a grad-requiring phony joined into each partition's input) and the
checkpoint's own phony made a partition's input require grad where the plain model's does not; an in-place op after a
saved activation then failed in backward (found by a fuzz of Pipe, session 43).
"""

import copy

import pytest
import torch
from torch import nn

from fairscale.nn.pipe import Pipe
from fairscale.nn.pipe.skip import pop, skippable, stash

MODES = ["never", "except_last", "always"]


class Probe(nn.Module):
    """Records whether each input it sees requires grad (recomputations included)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return x


def _frozen_then_inplace() -> nn.Sequential:
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    return nn.Sequential(frozen, Probe(), nn.Tanh(), nn.ReLU(inplace=True), nn.Linear(4, 4))


@pytest.mark.parametrize("checkpoint", MODES)
def test_inplace_after_frozen_partition_matches_sequential(checkpoint):
    ref = _frozen_then_inplace()
    x = torch.randn(6, 4)
    ref(x).pow(2).sum().backward()
    model = copy.deepcopy(ref)
    model.zero_grad()
    model[1].seen.clear()
    pipe = Pipe(model, [1, 4], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    pipe(x).pow(2).sum().backward()
    assert model[1].seen and not any(model[1].seen)  # as in nn.Sequential: nothing before it is trainable
    torch.testing.assert_close(model[4].weight.grad, ref[4].weight.grad)
    torch.testing.assert_close(model[4].bias.grad, ref[4].bias.grad)


@pytest.mark.parametrize("checkpoint", MODES)
def test_trainable_partition_with_frozen_input_still_gets_gradients(checkpoint):
    # The checkpoint's phony is still needed when the partition's own parameters are trainable.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    ref(x).sum().backward()
    model = copy.deepcopy(ref)
    model.zero_grad()
    Pipe(model, [1, 3], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)(x).sum().backward()
    for got, want in zip(model.parameters(), ref.parameters()):
        if want.grad is None:
            assert got.grad is None
        else:
            torch.testing.assert_close(got.grad, want.grad)


@skippable(stash=["side"])
class StashProjection(nn.Module):
    """Stashes a trainable projection of its input and passes the raw input (no grad) on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        yield stash("side", self.proj(x))
        return x.clone()  # noqa: B901


@skippable(pop=["side"])
class PopMul(nn.Module):
    """Multiplies by the popped skip; no parameters: only the skip carries a gradient."""

    def forward(self, x):
        side = yield pop("side")
        return x * side  # noqa: B901


@pytest.mark.parametrize("checkpoint", MODES)
def test_pop_of_a_grad_skip_into_a_frozen_partition_keeps_its_gradient(checkpoint):
    torch.manual_seed(0)
    ref = nn.Sequential(StashProjection(), nn.Identity(), PopMul())
    x = torch.randn(4, 4)
    ref(x).sum().backward()
    model = copy.deepcopy(ref)
    model.zero_grad()
    Pipe(model, [1, 1, 1], devices=["cpu", "cpu", "cpu"], chunks=2, checkpoint=checkpoint)(x).sum().backward()
    torch.testing.assert_close(model[0].module.proj.weight.grad, ref[0].module.proj.weight.grad)
    torch.testing.assert_close(model[0].module.proj.bias.grad, ref[0].module.proj.bias.grad)


class ScaleBy(nn.Module):
    """Multiplies by a learnable tensor that is a plain attribute, not a Parameter (owned elsewhere)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@pytest.mark.parametrize("checkpoint", MODES)
def test_learnable_tensor_attribute_in_a_checkpointed_partition_gets_its_gradient(checkpoint):
    # The partition holds no trainable Parameter and its input needs no grad: its output must still require grad.
    x = torch.randn(4, 4)
    torch.manual_seed(0)
    w = torch.full((1,), 2.0, requires_grad=True)
    head = nn.Linear(4, 1)
    nn.Sequential(ScaleBy(w), head)(x).sum().backward()
    want = w.grad.clone()
    w.grad = None
    model = nn.Sequential(ScaleBy(w), copy.deepcopy(head))
    Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)(x).sum().backward()
    torch.testing.assert_close(w.grad, want)


@skippable(stash=["s"])
class StashTriple(nn.Module):
    def forward(self, x):
        yield stash("s", x * 3)
        return x  # noqa: B901


@skippable(pop=["s"])
class PopPlus(nn.Module):
    def forward(self, x):
        s = yield pop("s")
        return x + s  # noqa: B901


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_across_a_learnable_tensor_attribute_with_all_parameters_frozen(checkpoint):
    # Only Parameters counted as trainable: the stash's micro-batch was not checkpointed, the pop's was, and backward
    # failed with "tensor in portal has been removed" (found by a fuzz of Pipe, session 43).
    x = torch.randn(4, 4)
    w = torch.ones(1, requires_grad=True)
    nn.Sequential(StashTriple(), ScaleBy(w), PopPlus())(x).sum().backward()
    want = w.grad.clone()
    w.grad = None
    model = nn.Sequential(StashTriple(), ScaleBy(w), PopPlus())
    Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)(x).sum().backward()
    torch.testing.assert_close(w.grad, want)


class ScaleByListed(nn.Module):
    """The learnable tensor inside a list attribute: no walk of the module sees it."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.held = [w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.held[0]


@pytest.mark.parametrize("checkpoint", MODES)
def test_learnable_tensor_the_walk_cannot_see_still_gets_its_gradient(checkpoint):
    # A partition that looks frozen and gets an input that needs no grad runs without checkpointing, so autograd
    # finds the tensor (a review of the first version, which gave it no or wrong gradients; a fuzz, session 44).
    x = torch.randn(4, 4)
    torch.manual_seed(0)
    frozen, head = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 1)
    w = torch.randn(4, requires_grad=True)
    nn.Sequential(frozen, ScaleByListed(w), head)(x).sum().backward()
    want = w.grad.clone()
    w.grad = None
    model = nn.Sequential(copy.deepcopy(frozen), ScaleByListed(w), copy.deepcopy(head))
    Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)(x).sum().backward()
    torch.testing.assert_close(w.grad, want)


class WithMask(nn.Module):
    """Returns its result beside a tensor that needs no gradient (a mask, a position table)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        return self.lin(x), torch.ones(x.shape[0], 4)


class UsesMaskInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, pair):
        y, mask = pair
        self.seen.append(mask.requires_grad)
        h = mask.pow(2)  # saves the mask for backward
        mask.add_(1)  # fine when the mask needs no gradient, as in nn.Sequential
        return y * h, mask


@pytest.mark.parametrize("checkpoint", ["never"])
def test_tuple_element_needing_no_grad_keeps_needing_none(checkpoint):
    # Copied to the next partition, every float element required grad once any did: in-place code on the mask failed
    # in backward ("modified by an inplace operation"), and the output's mask required grad (a fuzz of Pipe, s. 45).
    # A checkpointed partition's outputs all require grad (its first pass runs without autograd; as upstream).
    torch.manual_seed(0)
    reference = nn.Sequential(WithMask(), UsesMaskInPlace())
    pipe = Pipe(copy.deepcopy(reference), balance=[1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    outputs = [m(x) for m in (reference, pipe)]
    for y, mask in outputs:
        y.sum().backward()
    assert [t.requires_grad for t in outputs[1]] == [t.requires_grad for t in outputs[0]] == [True, False]
    assert not any(pipe[1].seen)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
