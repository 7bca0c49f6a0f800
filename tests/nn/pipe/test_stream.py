# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
import pytest
import torch

from fairscale.nn.pipe.stream import (
    CPUStream,
    current_stream,
    default_stream,
    get_device,
    is_cuda,
    new_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)

from ._util import NEEDS_CUDA

CPU = torch.device("cpu")


def test_new_stream_cpu():
    assert new_stream(CPU) is CPUStream


def test_current_stream_cpu():
    assert current_stream(CPU) is CPUStream


def test_default_stream_cpu():
    assert default_stream(CPU) is CPUStream


def test_use_device_cpu():
    with use_device(CPU):
        pass


def test_use_stream_cpu():
    with use_stream(CPUStream):
        pass
    with use_stream(None):
        pass


def test_get_device_cpu():
    assert get_device(CPUStream).type == "cpu"


def test_wait_stream_cpu_cpu():
    source = CPUStream
    target = CPUStream
    wait_stream(source, target)


def test_record_stream_cpu():
    # It should silently ignore CPU tensors.
    x = torch.rand(1, device=CPU)
    record_stream(x, CPUStream)


def test_is_cuda():
    assert not is_cuda(CPUStream)


@NEEDS_CUDA
def test_streams_cuda():
    cuda = torch.device("cuda")
    stream = new_stream(cuda)
    assert is_cuda(stream)
    assert get_device(stream).type == "cuda"
    assert current_stream(cuda) is not CPUStream
    assert default_stream(cuda) is not CPUStream
    with use_stream(stream):
        x = torch.ones(10, device=cuda)
    wait_stream(current_stream(cuda), stream)
    wait_stream(CPUStream, stream)
    record_stream(x, stream)
    assert x.sum().item() == 10
