# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Skip connections through Pipe: every balance and checkpoint mode equals the plain Sequential."""

import copy

import pytest
import torch
from torch import nn

from fairscale.nn.pipe import Pipe
from fairscale.nn.pipe.skip import pop, skippable, stash
from fairscale.nn.pipe.skip.portal import PortalBlue, PortalCopy, PortalOrange


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, input):
        yield stash("1to3", input)
        output = self.conv(input)
        return output  # noqa


class Layer2(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, input):
        output = self.conv(input)
        return output


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, input):
        skip_1to3 = yield pop("1to3")
        output = self.conv(input) + skip_1to3
        return output


@pytest.mark.parametrize("balance", [[3], [1, 2], [2, 1], [1, 1, 1]], ids=["3", "1:2", "2:1", "1:1:1"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_1to3(balance, checkpoint):
    model = nn.Sequential(Layer1(), Layer2(), Layer3())
    reference = copy.deepcopy(model)
    pipe = Pipe(model, balance, chunks=3, checkpoint=checkpoint, devices=["cpu"] * len(balance))

    input = torch.rand(6, 3, 4, 4, requires_grad=True)
    output = pipe(input)
    ref_input = input.detach().clone().requires_grad_()
    ref_output = reference(ref_input)
    torch.testing.assert_close(output, ref_output)

    output.norm().backward()
    ref_output.norm().backward()
    torch.testing.assert_close(input.grad, ref_input.grad)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_1to3_uses_portals_across_partitions():
    model = nn.Sequential(Layer1(), Layer2(), Layer3())
    pipe = Pipe(model, [1, 1, 1], chunks=1, checkpoint="never", devices=["cpu"] * 3)
    output = pipe(torch.rand(2, 3, 4, 4, requires_grad=True))
    seen, stack, names = set(), [output.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn))
        stack.extend(f for f, _ in fn.next_functions)
    assert {PortalBlue._backward_cls, PortalOrange._backward_cls, PortalCopy._backward_cls} <= names


def test_none_skip():
    @skippable(stash=["none"])
    class Stash(nn.Module):
        def forward(self, input):
            yield stash("none", None)
            return input  # noqa

    @skippable(pop=["none"])
    class Pop(nn.Module):
        def forward(self, input):
            none = yield pop("none")
            assert none is None
            return input

    model = nn.Sequential(Stash(), Pop())
    model = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=5)

    input = torch.rand(10, requires_grad=True)
    output = model(input)

    def assert_grad_fn_is_not_portal(grad_fn, visited=None):
        if visited is None:
            visited = set()
        if grad_fn in visited or grad_fn is None:
            return

        assert not isinstance(grad_fn, PortalBlue._backward_cls)
        assert not isinstance(grad_fn, PortalCopy._backward_cls)
        assert not isinstance(grad_fn, PortalOrange._backward_cls)

        visited.add(grad_fn)
        for next_grad_fn, _ in grad_fn.next_functions:
            assert_grad_fn_is_not_portal(next_grad_fn, visited)

    assert_grad_fn_is_not_portal(output.grad_fn)

    output.sum().backward()
    assert input.grad.mean().item() == 1


def test_skip_mismatch_is_rejected_by_pipe():
    model = nn.Sequential(Layer1(), Layer2())
    with pytest.raises(TypeError, match="no module declared '1to3' as poppable but stashed"):
        Pipe(model, [1, 1], devices=["cpu", "cpu"])
