# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
import pytest
import torch
from torch import nn

from fairscale.nn.pipe.skip import pop, skippable, stash
from fairscale.nn.pipe.skip.tracker import SkipTracker, use_skip_tracker


@pytest.fixture(autouse=True)
def skip_tracker():
    skip_tracker = SkipTracker()
    with use_skip_tracker(skip_tracker):
        yield skip_tracker


def test_stash(skip_tracker):
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", input)
            return input * 2  # noqa

    l1 = Stash()

    assert len(skip_tracker.tensors) == 0

    with use_skip_tracker(skip_tracker):
        l1(torch.tensor(42))

    assert len(skip_tracker.tensors) == 1


def test_pop():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", input)
            return input * 2  # noqa

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, input):
            foo = yield pop("foo")
            return foo  # noqa

    l1 = Stash()
    l2 = Pop()

    output = l2(l1(torch.tensor(42)))

    assert output.item() == 42


def test_declare_but_not_use():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            return input * 2

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, input):
            return input * 3

    l1 = Stash()
    l2 = Pop()

    with pytest.raises(RuntimeError):
        l1(torch.tensor(42))

    with pytest.raises(RuntimeError):
        l2(torch.tensor(42))


def test_stash_not_declared():
    @skippable()
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", input)
            return input * 2  # noqa

    l1 = Stash()

    with pytest.raises(RuntimeError, match="'foo' has not been declared as stashable"):
        l1(torch.tensor(42))


def test_pop_not_declared():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", input)
            return input * 2  # noqa

    @skippable()
    class Pop(nn.Module):
        def forward(self, input):
            foo = yield pop("foo")
            return foo  # noqa

    l1 = Stash()
    l2 = Pop()

    latent = l1(torch.tensor(42))

    with pytest.raises(RuntimeError, match="'foo' has not been declared as poppable"):
        l2(latent)


def test_pop_not_stashed():
    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, input):
            yield pop("foo")

    l1 = Pop()

    with pytest.raises(RuntimeError, match="'foo' has not been stashed"):
        l1(torch.tensor(42))


def test_stash_none():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", None)
            return input * 2  # noqa

    l1 = Stash()
    l1(torch.tensor(42))


def test_missing_stash_and_pop_messages():
    @skippable(stash=["a", "b"])
    class StashNothing(nn.Module):
        def forward(self, input):
            return input

    with pytest.raises(RuntimeError, match="must be stashed but have not"):
        StashNothing()(torch.tensor(1))


def test_double_pop_and_bad_command():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("foo", input)
            return input  # noqa

    @skippable(pop=["foo"])
    class PopTwice(nn.Module):
        def forward(self, input):
            yield pop("foo")
            yield pop("foo")
            return input  # noqa

    @skippable()
    class Bad(nn.Module):
        def forward(self, input):
            yield 42
            return input  # noqa

    @skippable(stash=["x"])
    class NoReturn(nn.Module):
        def forward(self, input):
            yield stash("x", input)

    with pytest.raises(KeyError):
        PopTwice()(Stash()(torch.tensor(1)))
    with pytest.raises(TypeError, match="42 is not a command from @skippable"):
        Bad()(torch.tensor(1))
    with pytest.raises(IndexError, match="returned no output"):
        NoReturn()(torch.tensor(1))
