# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Choosing how a collective runs: torch's function looked up at call time, and a fallback strategy per backend gap.

A backend may reject a variant of a collective (no tensor reduce-scatter, no bf16/fp16 support ...). Each
collective lists its strategies; ``_dispatch`` runs the first one the backend accepts and remembers it per
``(backend, collective, dtype, device type)`` in ``_chosen``. ``_force_strategy`` lets tests pick one.
"""

import contextlib
import datetime
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import _GroupInfo
from .work import WorkHandle, _copy_back

# torch's names of the flat-tensor variants, newest first (the older ones print deprecation warnings on recent torch).
# They are looked up on ``torch.distributed`` at every call, never bound at import, so that tests and tools that
# patch them (to count calls or inject delays, as upstream's tests do) see every call. A name patched since import
# wins over the newest name: on recent torch the older names are thin wrappers that call the newest one inside
# torch, so a patched older name would otherwise never run.
_ALL_GATHER_TENSOR_NAMES = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_REDUCE_SCATTER_TENSOR_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
_TORCH_ORIGINALS = {name: getattr(dist, name, None) for name in _ALL_GATHER_TENSOR_NAMES + _REDUCE_SCATTER_TENSOR_NAMES}


def _torch_function(names: Sequence[str]) -> Callable[..., Any]:
    """The function of ``torch.distributed`` to call now: a patched one if any, else the newest that exists."""
    current: List[Tuple[str, Optional[Callable[..., Any]]]] = [(name, getattr(dist, name, None)) for name in names]
    for name, fn in current:
        if fn is not None and fn is not _TORCH_ORIGINALS[name]:
            return fn
    for _, fn in current:
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch.distributed has none of {list(names)}; fairscale needs torch >= 2.1")


# What _torch_function returns while nothing is patched, and the module attributes that say so: every call checks
# them with one tuple comparison (identity of each attribute) and only a patched module takes the slow lookup.
_AG_ORIGINALS = tuple(_TORCH_ORIGINALS[name] for name in _ALL_GATHER_TENSOR_NAMES)
_RS_ORIGINALS = tuple(_TORCH_ORIGINALS[name] for name in _REDUCE_SCATTER_TENSOR_NAMES)
_AG_NEWEST: Optional[Callable[..., Any]] = next((fn for fn in _AG_ORIGINALS if fn is not None), None)
_RS_NEWEST: Optional[Callable[..., Any]] = next((fn for fn in _RS_ORIGINALS if fn is not None), None)


# The module's namespace never changes identity; its bound lookup is the cheapest way to read an attribute that may
# not exist on this torch (a missing name reads as None, as it was recorded at import).
_dist_attr = vars(dist).get
_AG0, _AG1, _AG2 = _ALL_GATHER_TENSOR_NAMES
_RS0, _RS1, _RS2 = _REDUCE_SCATTER_TENSOR_NAMES
_AG_O0, _AG_O1, _AG_O2 = _AG_ORIGINALS
_RS_O0, _RS_O1, _RS_O2 = _RS_ORIGINALS


def _all_gather_function() -> Callable[..., Any]:
    """torch's flat all-gather to call now (see :func:`_torch_function`)."""
    if _dist_attr(_AG0) is _AG_O0 and _dist_attr(_AG1) is _AG_O1 and _dist_attr(_AG2) is _AG_O2:
        if _AG_NEWEST is not None:
            return _AG_NEWEST
    return _torch_function(_ALL_GATHER_TENSOR_NAMES)


def _reduce_scatter_function() -> Callable[..., Any]:
    """torch's flat reduce-scatter to call now (see :func:`_torch_function`)."""
    if _dist_attr(_RS0) is _RS_O0 and _dist_attr(_RS1) is _RS_O1 and _dist_attr(_RS2) is _RS_O2:
        if _RS_NEWEST is not None:
            return _RS_NEWEST
    return _torch_function(_REDUCE_SCATTER_TENSOR_NAMES)


def _all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    return _all_gather_function()(*args, **kwargs)


def _reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    return _reduce_scatter_function()(*args, **kwargs)


_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Errors a backend raises, before any communication, for a variant or dtype it lacks. Only
# these trigger a fallback: anything else (a dead peer, a timeout) must surface unchanged.
_UNSUPPORTED = re.compile(r"not support|no support|unsupported|not implemented|no kernel|invalid scalar type", re.I)

_Strategy = Tuple[str, Callable[[], WorkHandle]]
# Collectives read it directly once a strategy is known: (backend, kind, dtype, device type) -> "tensor" lets them
# call torch's tensor variant without building their strategy list (and without a call to _dispatch). The device
# type is part of the key: one group can hold two backends ("cpu:gloo,cuda:nccl"), and a variant NCCL took must not
# be taken for CPU tensors that gloo handles (torch 2.2's gloo reduce-scatter sums wrongly).
_chosen: Dict[Tuple[str, str, torch.dtype, str], str] = {}
# Tests force a strategy to exercise fallbacks that the installed torch does not need.
_forced: Dict[Tuple[str, Optional[torch.dtype]], str] = {}


class _NotApplicable(Exception):
    """A strategy that does not apply to this call (e.g. fp32 wire format for an fp32 tensor)."""


@contextlib.contextmanager
def _force_strategy(kind: str, name: str, dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Testing aid: make ``kind`` (for ``dtype``, or any dtype) use strategy ``name``."""
    key = (kind, dtype)
    previous = _forced.get(key)
    _forced[key] = name
    try:
        yield
    finally:
        if previous is None:
            del _forced[key]
        else:
            _forced[key] = previous


def _dispatch(
    kind: str, info: _GroupInfo, dtype: torch.dtype, strategies: Sequence[_Strategy], device_type: str = "cpu"
) -> WorkHandle:
    """Run the first strategy the backend accepts for ``(backend, kind, dtype, device_type)``; remember it.

    Fallbacks are for CPU tensors only (gloo's gaps). Accelerator backends (NCCL) support every variant and dtype, so
    an error there is a real failure (a CUDA error can read "operation not supported") and retrying another variant
    on this rank alone would leave the peers waiting. The tensor's device decides, not the backend's name, which
    reads "undefined" or "cpu:gloo,cuda:nccl" for groups created without an explicit backend.
    """
    forced = _forced.get((kind, dtype)) or _forced.get((kind, None))
    wanted = forced or _chosen.get((info.backend, kind, dtype, device_type))
    if wanted is not None:
        for name, run in strategies:
            if name == wanted:
                return run()
        raise ValueError(f"unknown {kind} strategy {wanted!r}")
    errors: List[str] = []
    for name, run in strategies:
        if device_type == "cpu" and "gloo" in info.backend and name != "fp32" and not _gloo_has_dtype(dtype):
            # gloo reports a dtype it has no kernels for only when the work runs, in wait() ("Invalid scalar type":
            # bf16 on torch 2.1, uint32 or float8 on later ones), after this search, and a wait here would block
            # this rank's other collectives: asked of gloo alone beforehand (_gloo_has_dtype), it skips to the fp32
            # wire format, where one applies, or to the error below, the same on every rank.
            errors.append(f"{name}: gloo has no {dtype} kernels")
            continue
        try:
            handle = run()
        except _NotApplicable:
            continue
        except (RuntimeError, NotImplementedError) as exc:
            if device_type != "cpu" or not _UNSUPPORTED.search(str(exc)):
                raise
            errors.append(f"{name}: {str(exc).strip().splitlines()[0]}")
            continue
        _chosen[(info.backend, kind, dtype, device_type)] = name
        return handle
    raise RuntimeError(
        f"{kind} of {dtype} tensors is not supported by backend {info.backend!r}; tried " + "; ".join(errors)
    )


# gloo has had kernels for these since before torch 2.1: no probe (which costs a one-rank gloo group) for them.
_gloo_dtypes: Dict[torch.dtype, bool] = {
    dtype: True
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64)
}
_PROBE_TIMEOUT = datetime.timedelta(seconds=30)


def _gloo_has_dtype(dtype: torch.dtype) -> bool:
    """Whether this torch's gloo has kernels for ``dtype``: a broadcast on a private one-rank gloo group (no peer, no
    communication; gloo checks the type on any group size), once per dtype. ``True`` when the probe itself cannot
    run (the call then finds out as before)."""
    known = _gloo_dtypes.get(dtype)
    if known is None:
        known = True
        try:
            # Looked up by name: torch's stubs do not export HashStore, nor ProcessGroupGloo's collectives.
            group: Any = getattr(dist, "ProcessGroupGloo")(getattr(dist, "HashStore")(), 0, 1, _PROBE_TIMEOUT)
            group.broadcast([torch.zeros(1, dtype=dtype)]).wait()
        except RuntimeError as exc:
            known = not _UNSUPPORTED.search(str(exc))
        except Exception:  # noqa: B902  # no gloo, no local device: no answer, no guess
            pass
        _gloo_dtypes[dtype] = known
    return known


def _via_fp32(out: Tensor, inp: Tensor, run: Callable[[Tensor, Tensor], WorkHandle]) -> WorkHandle:
    """Run ``run(wire_out, wire_in)`` on fp32 copies and cast the result back (for fp16/bf16 only)."""
    if out.dtype not in _LOW_PRECISION:
        raise _NotApplicable()
    wire_in = inp.float()
    wire_out = wire_in if out is inp else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    return WorkHandle(run(wire_out, wire_in), _copy_back(out, wire_out))
