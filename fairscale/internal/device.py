# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The device layer: the only module of fairscale that touches ``torch.cuda``, streams and events.

Everything that differs between an accelerator (CUDA, or another torch accelerator with the same
module API such as XPU) and the CPU is hidden behind :class:`DeviceHandle`. On CPU, streams and
events are inert objects whose methods return immediately, so callers write the accelerator
code path once and never branch on the device type: CPU kernels run synchronously in program
order, which is exactly the ordering the stream/event calls would enforce.
"""

import contextlib
import os
import resource
import sys
import threading
from types import ModuleType
from typing import Any, ContextManager, Dict, Optional, Protocol, Union, cast

import torch
from torch import Tensor

__all__ = [
    "Stream",
    "Event",
    "DeviceHandle",
    "accelerator_available",
    "accelerator_device_count",
    "accelerator_initialized",
    "current_accelerator_device",
    "default_compute_device",
    "cpu_peak_rss_bytes",
    "CPU_ONLY_ENV",
    "hide_accelerators_from_torch",
    "torch_sees_no_accelerator",
    "rng_device",
    "rng_get_state",
    "rng_set_state",
    "rng_manual_seed",
    "rng_initial_seed",
]


class Event(Protocol):
    """What fairscale uses of an event (``torch.cuda.Event`` satisfies it)."""

    def record(self, stream: Any = None) -> None: ...  # noqa: E704

    def wait(self, stream: Any = None) -> None: ...  # noqa: E704

    def synchronize(self) -> None: ...  # noqa: E704

    def query(self) -> bool: ...  # noqa: E704


class Stream(Protocol):
    """What fairscale uses of a stream (``torch.cuda.Stream`` satisfies it)."""

    def wait_stream(self, stream: Any) -> None: ...  # noqa: E704

    def wait_event(self, event: Any) -> None: ...  # noqa: E704

    def record_event(self, event: Any = None) -> Any: ...  # noqa: E704

    def synchronize(self) -> None: ...  # noqa: E704


class _InertEvent:
    """CPU event: work on CPU is synchronous, so an event is always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "InertEvent()"


class _InertStream:
    """CPU stream: a placeholder with the stream API whose methods do nothing."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_InertEvent":
        return event if isinstance(event, _InertEvent) else _InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "InertStream()"


# One shared inert stream: "current stream" on CPU is always the same object, which makes
# ``handle.current_stream() is handle.current_stream()`` hold as it does on CUDA.
_CPU_STREAM = _InertStream()


def _has_accelerator_api() -> bool:
    return hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available")


# Set to 1 to make fairscale ignore accelerators in this process: CPU compute device by default, inert streams. The
# test engine sets it in the ranks of CPU (gloo) worlds so that they stay on CPU on a machine with GPUs.
CPU_ONLY_ENV = "FAIRSCALE_CPU_ONLY"


def _cpu_only() -> bool:
    return os.environ.get(CPU_ONLY_ENV, "") not in ("", "0")


def accelerator_available() -> bool:
    """Whether an accelerator (CUDA or another torch accelerator) can be used.

    ``False`` when the environment variable ``FAIRSCALE_CPU_ONLY`` is set to a value other than ``0``. Does not
    initialise the accelerator runtime, so it is safe to call before forking.
    """
    if _cpu_only():
        return False
    if _has_accelerator_api():
        return bool(torch.accelerator.is_available())
    return bool(torch.cuda.is_available())


def hide_accelerators_from_torch() -> None:
    """Make this process CPU-only for fairscale and for torch itself, for the rest of its life.

    For the ranks of a CPU (gloo) world on a machine with GPUs: test worlds and ``benchmarks/fsdp.py --device
    cpu``. Sets ``FAIRSCALE_CPU_ONLY`` (fairscale's device layer) and replaces torch's own availability answers
    (``torch.cuda.is_available`` and, where it exists, ``torch.accelerator.is_available``) with
    :func:`torch_sees_no_accelerator`. The environment variable alone does not reach torch, which creates a CUDA
    context wherever a GPU is visible: from torch 2.13 the step of most optimizers (Adam, AdamW, RMSprop, ...) asks
    for the accelerator's current stream (``Optimizer._cuda_graph_capture_health_check``), for CPU parameters too,
    so each CPU rank opened a context of its own (seconds, and about 0.5 GB of GPU memory per rank).
    ``CUDA_VISIBLE_DEVICES`` would not do: it does not reach a process forked from one that already asked the
    driver. Nothing is restored: call it only in a process that stays on CPU until it exits.
    """
    os.environ[CPU_ONLY_ENV] = "1"
    torch.cuda.is_available = torch_sees_no_accelerator
    if _has_accelerator_api():
        torch.accelerator.is_available = torch_sees_no_accelerator


def torch_sees_no_accelerator() -> bool:
    """torch's availability answer after :func:`hide_accelerators_from_torch`: always ``False``."""
    return False


def accelerator_device_count() -> int:
    """Number of accelerator devices visible to this process (0 without one)."""
    if not accelerator_available():
        return 0
    if _has_accelerator_api():
        return int(torch.accelerator.device_count())
    return int(torch.cuda.device_count())


def accelerator_initialized() -> bool:
    """Whether this process has initialised CUDA (after which ``fork`` is unsafe)."""
    return bool(torch.cuda.is_initialized())


def current_accelerator_device() -> Optional[torch.device]:
    """The current accelerator device with its index (e.g. ``cuda:1``), or ``None`` without one."""
    if not accelerator_available():
        return None
    if _has_accelerator_api():
        acc = torch.accelerator.current_accelerator()
        if acc is None:
            return None
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())


def _is_accelerator_type(device_type: str) -> bool:
    return device_type not in ("cpu", "meta")


def default_compute_device(params_device: Optional[torch.device]) -> torch.device:
    """Choose the device FSDP computes on when the user does not say.

    The fork's rule: parameters already on an accelerator compute there; otherwise the current
    accelerator if one is available (parameters get moved to it); otherwise the CPU. Upstream
    always chose CUDA, which crashed on machines without one.

    Args:
        params_device (Optional[torch.device]): the device of the module's parameters, or
            ``None`` for a module without parameters.

    Returns:
        torch.device: the compute device, with an index on accelerators.
    """
    if params_device is not None and _is_accelerator_type(params_device.type):
        return _normalize_device(params_device)
    current = current_accelerator_device()
    return current if current is not None else torch.device("cpu")


def cpu_peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (for benchmarks; no accelerator memory)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class DeviceHandle:
    """Streams, events, synchronisation and memory statistics of one device.

    Obtain handles with :meth:`DeviceHandle.for_device` (cached per device). On CPU every stream
    and event is inert and memory statistics are 0; on an accelerator the calls go to the
    device's torch module (``torch.cuda`` for CUDA).

    Attributes:
        device (torch.device): the device, with its index on accelerators.
        is_accelerator (bool): ``False`` for CPU (and ``meta``), ``True`` otherwise.
    """

    _cache: Dict[torch.device, "DeviceHandle"] = {}
    _cache_lock = threading.Lock()

    def __init__(self, device: Union[str, torch.device]) -> None:
        device = _normalize_device(torch.device(device))
        self.device: torch.device = device
        self.is_accelerator: bool = _is_accelerator_type(device.type)
        self._module: Optional[ModuleType] = getattr(torch, device.type, None) if self.is_accelerator else None
        # Accelerators without a stream API (e.g. MPS) still work, with inert streams.
        self._has_streams = self._module is not None and hasattr(self._module, "Stream")

    @staticmethod
    def for_device(device: Union[str, torch.device]) -> "DeviceHandle":
        """Return the cached handle of ``device`` (``"cuda"`` means the current CUDA device)."""
        key = _normalize_device(torch.device(device))
        with DeviceHandle._cache_lock:
            handle = DeviceHandle._cache.get(key)
            if handle is None:
                handle = DeviceHandle(key)
                DeviceHandle._cache[key] = handle
            return handle

    def new_stream(self) -> Stream:
        """A new stream on this device (inert on CPU)."""
        if self._has_streams:
            return cast(Stream, self._mod.Stream(device=self.device))
        return _InertStream()

    def current_stream(self) -> Stream:
        """The stream that kernels are currently queued on."""
        if self._has_streams:
            return cast(Stream, self._mod.current_stream(self.device))
        return _CPU_STREAM

    def as_current(self) -> ContextManager[None]:
        """Context manager that makes this device the current one (does nothing on CPU).

        Object collectives on NCCL place their buffers on the *current* CUDA device: inside this context they use
        the compute device even when the user never called ``torch.cuda.set_device``.
        """
        if self._module is not None and hasattr(self._module, "device") and self.device.index is not None:
            return cast(ContextManager[None], self._module.device(self.device.index))
        return contextlib.nullcontext()

    def stream(self, s: Stream) -> ContextManager[None]:
        """Context manager that makes ``s`` the current stream (does nothing on CPU)."""
        if self._has_streams and not isinstance(s, _InertStream):
            return cast(ContextManager[None], self._mod.stream(s))
        return contextlib.nullcontext()

    def new_event(self) -> Event:
        """A new event (inert and always complete on CPU)."""
        if self._has_streams:
            return cast(Event, self._mod.Event())
        return _InertEvent()

    def synchronize(self) -> None:
        """Block the host until all queued work on this device is done (no-op on CPU)."""
        if self._module is not None and hasattr(self._module, "synchronize"):
            if self._has_streams:
                self._mod.synchronize(self.device)
            else:
                self._mod.synchronize()

    def record_stream(self, tensor: Tensor, stream: Stream) -> None:
        """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU).

        Needed when a tensor allocated on one stream is consumed on another and then freed:
        without it the allocator could hand its memory out while the other stream still reads it.
        """
        if self._has_streams and tensor.device.type == self.device.type and not isinstance(stream, _InertStream):
            tensor.record_stream(cast(Any, stream))

    def pin_memory(self, tensor: Tensor) -> Tensor:
        """Return a pinned copy of a CPU tensor when an accelerator exists, else ``tensor`` itself.

        Pinned host memory only helps host/accelerator copies; without an accelerator pinning
        fails or wastes locked pages, so the tensor is returned unchanged.
        """
        if tensor.device.type == "cpu" and accelerator_available() and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def memory_allocated(self) -> int:
        """Bytes currently allocated by tensors on this device (0 on CPU)."""
        return self._memory_stat("memory_allocated")

    def max_memory_allocated(self) -> int:
        """Peak bytes allocated on this device since the last reset (0 on CPU)."""
        return self._memory_stat("max_memory_allocated")

    def reset_peak_memory_stats(self) -> None:
        """Reset the peak returned by :meth:`max_memory_allocated` (no-op on CPU)."""
        if self._module is not None and hasattr(self._module, "reset_peak_memory_stats"):
            self._mod.reset_peak_memory_stats(self.device)

    def name(self) -> str:
        """The device's model name (e.g. ``"NVIDIA H200"``), or its type (``"cpu"``) where the backend has none."""
        if self._module is not None and hasattr(self._module, "get_device_name"):
            return str(self._mod.get_device_name(self.device))
        return self.device.type

    def __repr__(self) -> str:
        return f"DeviceHandle({self.device})"

    @property
    def _mod(self) -> Any:
        # Typed as Any: the accelerator modules are resolved by name at run time.
        return self._module

    def _memory_stat(self, name: str) -> int:
        if self._module is None or not hasattr(self._module, name):
            return 0
        return int(getattr(self._module, name)(self.device))


def _normalize_device(device: torch.device) -> torch.device:
    """Give accelerator devices an index so "cuda" and "cuda:0" share one cached handle."""
    if not _is_accelerator_type(device.type) or device.index is not None:
        return device
    current = current_accelerator_device()
    if current is not None and current.type == device.type:
        return current
    return torch.device(device.type, 0)


# ----------------------------------------------------------------------------------------------
# Device RNG: the default generator of the current accelerator, or the CPU generator without one.
# The model-parallel RNG tracker (fairscale.nn.model_parallel.random) keeps upstream's CUDA names
# but works through these, so that it also tracks the CPU stream on CPU-only machines.


def _rng_device(device: Optional[torch.device] = None) -> torch.device:
    """Resolve ``device`` (``None``: the current accelerator if any, else the CPU) for the RNG calls."""
    if device is None:
        current = current_accelerator_device()
        return current if current is not None else torch.device("cpu")
    if _is_accelerator_type(device.type) and not accelerator_available():
        raise ValueError(
            f"the RNG of {device} was requested but no accelerator is available; use the CPU (device=None "
            "picks the current accelerator or the CPU)"
        )
    return _normalize_device(device) if _is_accelerator_type(device.type) else torch.device("cpu")


def rng_device(device: Optional[torch.device] = None) -> torch.device:
    """The device whose default generator the ``rng_*`` functions use for ``device`` (``None``: default).

    Args:
        device (Optional[torch.device]): an explicit device, or ``None`` for the current accelerator
            (the CPU when there is none).
    """
    return _rng_device(device)


def rng_get_state(device: Optional[torch.device] = None) -> Tensor:
    """A copy of the default generator's state of ``device`` (see :func:`rng_device`)."""
    dev = _rng_device(device)
    if dev.type == "cpu":
        return torch.get_rng_state()
    return cast(Tensor, getattr(torch, dev.type).get_rng_state(dev))


def rng_set_state(state: Tensor, device: Optional[torch.device] = None) -> None:
    """Restore the default generator of ``device`` to ``state`` (which is not modified)."""
    dev = _rng_device(device)
    if dev.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, dev.type).set_rng_state(state, dev)


def rng_manual_seed(seed: int, device: Optional[torch.device] = None) -> None:
    """Seed the default generator of ``device`` only (the CPU generator is untouched on accelerators)."""
    dev = _rng_device(device)
    if dev.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        with getattr(torch, dev.type).device(dev.index):
            getattr(torch, dev.type).manual_seed(seed)


def rng_initial_seed(device: Optional[torch.device] = None) -> int:
    """The seed the default generator of ``device`` was last seeded with."""
    dev = _rng_device(device)
    if dev.type == "cpu":
        return int(torch.initial_seed())
    with getattr(torch, dev.type).device(dev.index):
        return int(getattr(torch, dev.type).initial_seed())


# ---- pipeline parallelism (fairscale.nn.pipe): default streams, stream devices, accelerator RNG ----


def default_stream(device: Union[str, torch.device]) -> Optional[Stream]:
    """The default stream of an accelerator device, or ``None`` for the CPU (and devices without streams)."""
    handle = DeviceHandle.for_device(device)
    if not handle._has_streams:
        return None
    return cast(Stream, handle._mod.default_stream(handle.device))


def accelerator_rng_state(device: torch.device) -> Optional[Tensor]:
    """The RNG state of an accelerator device, or ``None`` for the CPU (whose state is torch's global one)."""
    handle = DeviceHandle.for_device(device)
    if handle._module is None or not hasattr(handle._module, "get_rng_state"):
        return None
    return cast(Tensor, handle._mod.get_rng_state(handle.device))


def set_accelerator_rng_state(device: torch.device, state: Tensor) -> None:
    """Restore an RNG state returned by :func:`accelerator_rng_state` (no-op for the CPU)."""
    handle = DeviceHandle.for_device(device)
    if handle._module is not None and hasattr(handle._module, "set_rng_state"):
        handle._mod.set_rng_state(state, handle.device)


# ---- AMP gradient scalers (fairscale.optim.grad_scaler) ----

#: The base class of fairscale's grad scalers: torch's CUDA scaler class (a subclass of the device-generic
#: ``torch.amp.GradScaler`` on torch >= 2.3), so that ``isinstance`` checks written for upstream still hold.
CudaAmpGradScaler = torch.cuda.amp.GradScaler
#: The per-optimizer stage enum torch's scalers compare against (``READY``, ``UNSCALED``, ``STEPPED``).
AmpOptState = torch.cuda.amp.grad_scaler.OptState  # type: ignore[attr-defined]


def amp_custom_fwd_bwd(device_type: str = "cuda") -> "tuple[Any, Any]":
    """torch's ``(custom_fwd, custom_bwd)`` decorators for autograd Functions under autocast, for ``device_type``.

    ``torch.amp.custom_fwd(device_type=...)`` on torch >= 2.4; before that only the CUDA ones existed
    (``torch.cuda.amp.custom_fwd``), which the newer torch deprecates.
    """
    amp = torch.amp
    if hasattr(amp, "custom_fwd") and hasattr(amp, "custom_bwd"):
        fwd, bwd = amp.custom_fwd, amp.custom_bwd
        return fwd(device_type=device_type), bwd(device_type=device_type)
    if device_type != "cuda":  # pragma: no cover - torch < 2.4 decorates for CUDA autocast only
        raise ValueError(f"torch {torch.__version__} has custom_fwd/custom_bwd for CUDA only, not {device_type!r}")
    return torch.cuda.amp.custom_fwd, torch.cuda.amp.custom_bwd


def device_generic_amp_scaler() -> bool:
    """Whether torch's AMP grad scaler takes a device type (torch >= 2.3), so that it also scales on the CPU."""
    amp = getattr(torch, "amp", None)
    return amp is not None and hasattr(amp, "GradScaler") and hasattr(torch.amp.GradScaler, "_unscale_grads_")


def amp_scaler_device_type() -> str:
    """The device type a grad scaler targets by default: the current accelerator's type, else ``"cpu"``."""
    current = current_accelerator_device()
    return current.type if current is not None else "cpu"


# ---- experimental (OffloadModel, SlowMo, LayerwiseMemoryTracker): reserved memory and cache release ----


def memory_reserved(device: Union[str, torch.device]) -> int:
    """Bytes held by the caching allocator of an accelerator device (0 for the CPU)."""
    return DeviceHandle.for_device(device)._memory_stat("memory_reserved")


def empty_cache(device: Union[str, torch.device]) -> None:
    """Release the unused cached blocks of an accelerator's allocator (no-op for the CPU)."""
    handle = DeviceHandle.for_device(device)
    if handle._module is not None and hasattr(handle._module, "empty_cache"):
        handle._mod.empty_cache()


def new_timing_event(device: Union[str, torch.device]) -> Optional[Any]:
    """An accelerator event that records time (``enable_timing=True``), or ``None`` for the CPU."""
    handle = DeviceHandle.for_device(device)
    if not handle._has_streams:
        return None
    return handle._mod.Event(enable_timing=True)
