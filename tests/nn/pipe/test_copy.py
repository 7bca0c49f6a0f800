# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
import pytest
import torch

from fairscale.nn.pipe.copy import Copy, Wait
from fairscale.nn.pipe.stream import CPUStream, current_stream, get_device, is_cuda, new_stream, use_stream

from ._util import NEEDS_CUDA


def _test_copy_wait(prev_stream, next_stream):
    device = get_device(prev_stream)

    with use_stream(prev_stream):
        x = torch.ones(100, device=device, requires_grad=True)

    (y,) = Copy.apply(prev_stream, next_stream, x)
    (y,) = Wait.apply(prev_stream, next_stream, x)

    with use_stream(next_stream):
        assert torch.allclose(y.sum(), torch.tensor(100.0, device=y.device))
        y.norm().backward()
    with use_stream(prev_stream):
        assert torch.allclose(x.grad.sum(), torch.tensor(10.0, device=x.device))


def test_copy_wait_cpu_cpu():
    prev_stream = CPUStream
    next_stream = CPUStream
    _test_copy_wait(prev_stream, next_stream)


def test_copy_grad_fn_and_alias_on_cpu():
    x = torch.ones(3, requires_grad=True)
    (y,) = Copy.apply(CPUStream, CPUStream, x)
    assert y.grad_fn.__class__.__name__ == "CopyBackward"
    assert y is not x
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


@NEEDS_CUDA
def test_copy_wait_cpu_cuda():
    prev_stream = CPUStream
    next_stream = current_stream(torch.device("cuda"))
    _test_copy_wait(prev_stream, next_stream)


@NEEDS_CUDA
def test_copy_wait_cuda_cpu():
    prev_stream = current_stream(torch.device("cuda"))
    next_stream = CPUStream
    _test_copy_wait(prev_stream, next_stream)


@NEEDS_CUDA
def test_copy_wait_cuda_cuda():
    prev_stream = current_stream(torch.device("cuda"))
    next_stream = new_stream(torch.device("cuda"))
    assert is_cuda(next_stream)
    _test_copy_wait(prev_stream, next_stream)


def test_wait_multiple_tensors():
    a = torch.rand(1, requires_grad=True)
    b = torch.rand(1, requires_grad=True)

    a, b = Wait.apply(CPUStream, CPUStream, a, b)

    assert a.grad_fn is b.grad_fn
    assert a.grad_fn.__class__ is Wait._backward_cls
