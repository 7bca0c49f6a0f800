# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
import copy
from functools import partial

import pytest
import torch
from torch import nn
from torch.autograd import Function

from fairscale.nn.pipe import Pipe
from fairscale.nn.pipe.checkpoint import Checkpointing, is_checkpointing, is_recomputing
from fairscale.nn.pipe.dependency import fork, join
from fairscale.nn.pipe.microbatch import Batch

from ._util import cuda_devices


def _checkpoint_and_recompute(function, x):
    chk = Checkpointing(function, Batch(x, 0))
    batch = chk.checkpoint()
    chk.recompute(batch)
    return batch


@pytest.mark.parametrize("device", cuda_devices())
def test_serial_checkpoints(device):
    timeline = []

    class Log(Function):
        @staticmethod
        def forward(ctx, name, x):
            ctx.name = name
            timeline.append(f"{name}:forward")
            return x.detach()

        @staticmethod
        def backward(ctx, grad_output):
            timeline.append(f"{ctx.name}:backward")
            return None, grad_output

    a = torch.rand(1, device=device, requires_grad=True)
    b = torch.rand(1, device=device, requires_grad=True)
    a_out = _checkpoint_and_recompute(partial(Log.apply, "a"), a).tensor
    a_out, phony = fork(a_out)
    b = join(b, phony)
    b_out = _checkpoint_and_recompute(partial(Log.apply, "b"), b).tensor
    torch.cat((a_out, b_out)).sum().backward()
    assert timeline == ["a:forward", "b:forward", "b:forward", "b:backward", "a:forward", "a:backward"]


def test_not_requires_grad():
    x = Batch(torch.rand(1, requires_grad=False), 0)
    assert not x[0].requires_grad

    def f(x):
        return x * 2

    chk = Checkpointing(f, x)
    x = chk.checkpoint()
    assert x[0].requires_grad
    chk.recompute(x)
    assert x[0].requires_grad
    x.tensor.backward()


def test_not_requires_grad_with_parameter():
    x = torch.rand(1, requires_grad=False)
    a = torch.rand(1, requires_grad=True)

    def f(x):
        return x * a

    y = _checkpoint_and_recompute(f, x)
    y.tensor.backward()
    assert a.grad is not None


@pytest.mark.parametrize("device", cuda_devices())
def test_random_in_checkpoint(device):
    dropout = nn.Dropout(p=0.5)
    torch.manual_seed(0)
    x = torch.randn(3, 3, device=device, requires_grad=True)
    y = dropout(x)
    y.norm().backward()

    torch.manual_seed(0)
    chk_x = torch.randn(3, 3, device=device, requires_grad=True)
    chk_y = _checkpoint_and_recompute(dropout, chk_x).tensor
    chk_y.norm().backward()
    assert torch.allclose(x.grad, chk_x.grad)


def test_recompute_leaves_global_rng_alone():
    dropout = nn.Dropout(p=0.5)
    x = torch.randn(4, 4, requires_grad=True)
    y = _checkpoint_and_recompute(dropout, x).tensor
    state = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(state, torch.get_rng_state())


def test_detect_checkpointing_recomputing():
    logs = []

    class Detect(nn.Module):
        def forward(self, input):
            logs.append((is_checkpointing(), is_recomputing()))
            return input

    model = Detect()
    input = torch.rand(1, requires_grad=True)
    output = _checkpoint_and_recompute(model, input).tensor
    output.backward()
    assert logs == [(True, False), (False, True)]


def test_detect_checkpointing_recomputing_without_checkpoint():
    logs = []

    class Detect(nn.Module):
        def forward(self, input):
            logs.append((is_checkpointing(), is_recomputing()))
            return input

    model = Detect()
    input = torch.rand(1, requires_grad=True)
    output = model(input)
    output.backward()
    assert logs == [(False, False)]


def test_non_grad_output():
    class ForkNonGrad(nn.Module):
        def forward(self, input):
            return (input * 2, torch.rand(1))

    model = ForkNonGrad()
    input = torch.rand(1, requires_grad=True)
    output = _checkpoint_and_recompute(model, input)
    output[0].backward()


def test_grad_alignment_with_non_grad_output_first():
    # Upstream paired the gradients with the filtered outputs by position; here each keeps its own gradient.
    class NonGradFirst(nn.Module):
        def forward(self, x):
            return (torch.zeros(1), x * 3)

    x = torch.ones(1, requires_grad=True)
    out = _checkpoint_and_recompute(NonGradFirst(), x)
    # out[0] requires grad only through the checkpoint's phony; the recomputed one does not.
    (out[0].sum() * 0 + out[1].sum()).backward()
    assert torch.equal(x.grad, torch.tensor([3.0]))


def test_detect_flags_through_pipe():
    logs = []

    class Detect(nn.Module):
        def forward(self, input):
            logs.append((is_checkpointing(), is_recomputing()))
            return input

    pipe = Pipe(nn.Sequential(Detect()), [1], devices=["cpu"], chunks=1, checkpoint="always")
    pipe(torch.rand(1, requires_grad=True)).sum().backward()
    assert logs == [(True, False), (False, True)]


class _CountPasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.recomputations = 0

    def forward(self, x):
        self.recomputations += int(is_recomputing())
        return self.lin(x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_frozen_pipe_is_not_checkpointed(checkpoint):
    # With no parameter and no input that requires grad, the micro-batches were checkpointed anyway: the output
    # required grad (the checkpoint's phony) and a backward through it recomputed every partition for nothing
    # (session 39). With an input that requires grad they are checkpointed, and its gradient is the plain model's.
    torch.manual_seed(0)
    plain = nn.Sequential(_CountPasses(), nn.ReLU(), _CountPasses()).requires_grad_(False)
    reference = copy.deepcopy(plain)
    pipe = Pipe(plain, [2, 1], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)
    out = pipe(torch.randn(6, 4))
    assert not out.requires_grad
    x = torch.randn(6, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pipe(x).sum().backward()
    reference(x_ref).sum().backward()
    assert plain[0].recomputations == (3 if checkpoint == "always" else 2)
    torch.testing.assert_close(x.grad, x_ref.grad)
