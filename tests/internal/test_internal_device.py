# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.device: inert on CPU, real streams where an accelerator exists."""

import re

import pytest
import torch

from fairscale.fair_dev.testing import run_distributed
from fairscale.internal.device import (
    CPU_ONLY_ENV,
    DeviceHandle,
    accelerator_available,
    accelerator_device_count,
    cpu_peak_rss_bytes,
    current_accelerator_device,
    default_compute_device,
)

no_accelerator = pytest.mark.skipif(accelerator_available(), reason="checks the CPU-only machine")


def test_cpu_handle_is_inert_and_cached() -> None:
    handle = DeviceHandle.for_device("cpu")
    assert handle is DeviceHandle.for_device(torch.device("cpu"))
    assert handle.device == torch.device("cpu") and not handle.is_accelerator
    stream, other = handle.new_stream(), handle.current_stream()
    assert handle.current_stream() is other  # one "current stream", as on accelerators
    event = stream.record_event()
    assert event.query()
    event.record(stream)
    event.wait(stream)
    event.synchronize()
    stream.wait_stream(other)
    stream.wait_event(handle.new_event())
    stream.synchronize()
    t = torch.ones(3)
    with handle.stream(stream):
        t.add_(1)  # work inside the context runs as usual
    handle.record_stream(t, stream)
    handle.synchronize()
    assert torch.equal(t, torch.full((3,), 2.0))
    assert handle.memory_allocated() == 0 and handle.max_memory_allocated() == 0
    handle.reset_peak_memory_stats()
    assert handle.name() == "cpu"


@no_accelerator
def test_cpu_only_machine() -> None:
    assert current_accelerator_device() is None and accelerator_device_count() == 0
    t = torch.ones(2)
    assert DeviceHandle.for_device("cpu").pin_memory(t) is t  # nothing to pin for


def test_default_compute_device_rule() -> None:
    current = current_accelerator_device()
    fallback = current if current is not None else torch.device("cpu")
    # Parameters off accelerators: the current accelerator if any, else CPU.
    assert default_compute_device(None) == fallback
    assert default_compute_device(torch.device("cpu")) == fallback
    assert default_compute_device(torch.device("meta")) == fallback
    # Parameters on an accelerator stay there (checked without touching the accelerator).
    assert default_compute_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert default_compute_device(torch.device("cuda")).index is not None


def _pretend_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report one CUDA-like accelerator at index 0 (this machine may have none)."""

    class _Acc:
        type = "cuda"

    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available"):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: _Acc())
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    else:  # torch without the accelerator API
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cpu_only_env_hides_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAIRSCALE_CPU_ONLY: CPU compute device by default even where an accelerator exists (CPU test worlds)."""
    _pretend_accelerator(monkeypatch)
    monkeypatch.delenv(CPU_ONLY_ENV, raising=False)
    assert accelerator_available() and default_compute_device(None) == torch.device("cuda", 0)
    monkeypatch.setenv(CPU_ONLY_ENV, "1")
    assert not accelerator_available() and accelerator_device_count() == 0
    assert current_accelerator_device() is None
    assert default_compute_device(None) == torch.device("cpu")
    assert default_compute_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setenv(CPU_ONLY_ENV, "0")
    assert accelerator_available()


def test_cpu_peak_rss_bytes() -> None:
    with open("/proc/self/status") as f:
        rss_kib = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))  # type: ignore[union-attr]
    peak = cpu_peak_rss_bytes()
    assert peak >= rss_kib * 1024 * 0.9  # the peak is at least what is resident now (in bytes, not KiB)


def _streams_order_work(rank: int, world_size: int) -> None:
    device = current_accelerator_device()
    assert device is not None
    handle = DeviceHandle.for_device(device.type)
    assert handle is DeviceHandle.for_device(device) and handle.is_accelerator
    assert default_compute_device(None) == device
    handle.reset_peak_memory_stats()
    side = handle.new_stream()
    x = torch.ones(1024, 1024, device=device)
    side.wait_stream(handle.current_stream())
    with handle.stream(side):
        y = x @ x
        done = side.record_event()
    handle.record_stream(y, side)
    done.wait(handle.current_stream())
    z = y.sum()
    handle.synchronize()
    assert done.query() and float(z) == 1024.0**3
    assert handle.memory_allocated() > 0 and handle.max_memory_allocated() >= handle.memory_allocated()
    pinned = handle.pin_memory(torch.ones(4))
    assert pinned.is_pinned()
    assert handle.name() == torch.cuda.get_device_name(device) and handle.name() != "cuda"  # the model, for reports


def test_accelerator_streams_order_work() -> None:
    # In a CUDA world (skipped without a GPU): the pytest process never creates a CUDA context.
    run_distributed(_streams_order_work, 1, device="cuda")


def test_as_current_on_cpu_is_inert() -> None:
    with DeviceHandle.for_device("cpu").as_current():
        assert torch.zeros(1).device.type == "cpu"


def _as_current_switches(rank: int, world_size: int) -> None:
    last = accelerator_device_count() - 1
    handle = DeviceHandle.for_device(torch.device("cuda", last))
    before = torch.cuda.current_device()
    with handle.as_current():
        assert torch.cuda.current_device() == last  # where NCCL object collectives put their buffers
    assert torch.cuda.current_device() == before


def test_as_current_switches_the_current_accelerator() -> None:
    run_distributed(_as_current_switches, 1, device="cuda")
