# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Device-agnostic stream helpers for the pipeline.

An :data:`AbstractStream` is either an accelerator stream (obtained through :mod:`fairscale.internal.device`) or
the singleton placeholder :data:`CPUStream`. Every helper degrades to a no-op for the placeholder, so the pipeline
code is written once and runs on CPU devices unchanged.
"""

import contextlib
from typing import Any, ContextManager, Generator, Optional, Union, cast

import torch

from fairscale.internal.device import DeviceHandle, Stream
from fairscale.internal.device import default_stream as _device_default_stream

__all__ = [
    "CPUStreamType",
    "CPUStream",
    "AbstractStream",
    "new_stream",
    "current_stream",
    "default_stream",
    "use_device",
    "use_stream",
    "get_device",
    "wait_stream",
    "record_stream",
    "is_cuda",
    "as_cuda",
]


class CPUStreamType:
    """Type of the :data:`CPUStream` placeholder."""

    def __repr__(self) -> str:
        return "CPUStream"


#: The placeholder stream of every non-accelerator device.
CPUStream = CPUStreamType()

AbstractStream = Union[Stream, CPUStreamType]


def _handle(device: Union[str, torch.device]) -> DeviceHandle:
    return DeviceHandle.for_device(torch.device(device))


def _has_streams(device: torch.device) -> bool:
    return device.type != "cpu" and _device_default_stream(device) is not None


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on an accelerator device, else :data:`CPUStream`."""
    if not _has_streams(device):
        return CPUStream
    return _handle(device).new_stream()


def current_stream(device: torch.device) -> AbstractStream:
    """The current stream of an accelerator device, else :data:`CPUStream`."""
    if not _has_streams(device):
        return CPUStream
    return _handle(device).current_stream()


def default_stream(device: torch.device) -> AbstractStream:
    """The default stream of an accelerator device, else :data:`CPUStream`."""
    if not _has_streams(device):
        return CPUStream
    return cast(Stream, _device_default_stream(device))


@contextlib.contextmanager
def use_device(device: torch.device) -> Generator[None, None, None]:
    """Make ``device`` the current accelerator device for the block (no-op for the CPU)."""
    if not isinstance(device, torch.device) or device.type in ("cpu", "meta"):
        yield
        return
    with _handle(device).as_current():
        yield


@contextlib.contextmanager
def use_stream(stream: Optional[AbstractStream]) -> Generator[None, None, None]:
    """Make ``stream`` current for the block (no-op for a falsy value or :data:`CPUStream`)."""
    if stream is None or stream is CPUStream:
        yield
        return
    s = as_cuda(stream)
    context: ContextManager[None] = _handle(get_device(s)).stream(s)
    with context:
        yield


def get_device(stream: AbstractStream) -> torch.device:
    """The device of ``stream``; ``cpu`` for :data:`CPUStream`."""
    if stream is CPUStream:
        return torch.device("cpu")
    return cast(torch.device, cast(Any, stream).device)


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Make ``source`` wait for the work queued on ``target``.

    A CPU source waiting for an accelerator target blocks the host until the target is done; a CPU target has
    nothing queued, so there is nothing to wait for.
    """
    if is_cuda(target):
        if is_cuda(source):
            as_cuda(source).wait_stream(as_cuda(target))
        else:
            as_cuda(target).synchronize()


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tell the caching allocator that ``tensor``'s memory is in use on ``stream`` (no-op for CPU).

    The whole allocation is recorded (the allocator works per block), so shifted views are covered too.
    """
    if is_cuda(stream):
        s = as_cuda(stream)
        _handle(get_device(s)).record_stream(tensor, s)


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is an accelerator stream (anything but :data:`CPUStream`)."""
    return stream is not CPUStream


def as_cuda(stream: AbstractStream) -> Stream:
    """Cast to an accelerator stream (an identity at run time)."""
    return cast(Stream, stream)
