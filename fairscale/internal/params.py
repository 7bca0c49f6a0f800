# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Small helpers about parameters, ranks and moving nested values between devices."""

import collections.abc
import contextlib
import threading
from collections import OrderedDict
from math import inf
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Workhandle", "get_global_rank", "recursive_copy_to_device", "calc_grad_norm", "conversion_in_place"]


class Workhandle:
    """A pending asynchronous operation and what to run once it is done.

    Attributes:
        handle (Any): the work object (anything with ``wait()``).
        callback (Optional[Callable[[], Any]]): called by the owner after ``handle.wait()``.
    """

    callback: Optional[Callable[[], Any]] = None  # a class attribute too, as upstream

    def __init__(self, handle: Any, callback: Optional[Callable[[], Any]] = None) -> None:
        self.handle = handle
        self.callback = callback


def get_global_rank(group: Any, rank: int) -> int:
    """Translate ``rank`` inside ``group`` to the rank in the default (world) group.

    Args:
        group (Any): a process group; ``None`` or the world group means ranks are already global.
        rank (int): a rank inside ``group``.

    Returns:
        int: the global rank.
    """
    if group is None or group is dist.group.WORLD:
        return rank
    return int(dist.get_global_rank(group, rank))


def recursive_copy_to_device(value: Any, non_blocking: bool, device: torch.device) -> Any:
    """Copy every tensor in a nested structure to ``device``.

    Lists stay lists, tuples stay tuples (namedtuples keep their type), mappings become dicts
    (``OrderedDict`` stays one); other values are returned as they are.

    Args:
        value (Any): a tensor or a nested list/tuple/mapping of them.
        non_blocking (bool): passed to ``Tensor.to`` (asynchronous host/accelerator copies).
        device (torch.device): the destination.

    Returns:
        Any: the same structure with the tensors on ``device``.
    """
    if isinstance(value, Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (list, tuple)):
        values = [recursive_copy_to_device(v, non_blocking, device) for v in value]
        if isinstance(value, list):
            return values
        if hasattr(value, "_fields"):
            return type(value)(*values)
        return tuple(values)
    if isinstance(value, collections.abc.Mapping):
        items = [(k, recursive_copy_to_device(v, non_blocking, device)) for k, v in value.items()]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    return value


@torch.no_grad()
def calc_grad_norm(parameters: Iterable[torch.nn.Parameter], p: float) -> Tensor:
    """The ``p``-norm of the gradients of ``parameters`` taken together (parameters without grad skipped).

    Per-parameter norms are computed in at least fp32 (fp64 gradients in fp64) and combined, as
    ``torch.nn.utils.clip_grad_norm_`` does, so low-precision gradients do not overflow.

    Args:
        parameters (Iterable[torch.nn.Parameter]): the parameters whose ``.grad`` is measured (a list, or any
            iterable, an iterator or generator included: it is walked once).
        p (float): the norm order; ``math.inf`` for the max norm.

    Returns:
        Tensor: a 0-dim tensor in the (real) dtype of the first parameter with a gradient, on its
        device; ``torch.tensor(0.0)`` if no parameter has a gradient.
    """
    # Listed once: the dtype lookup below walks the parameters a second time, which found an exhausted iterator (a
    # filter() or generator, e.g. from OSS.clip_grad_norm's filter_params_fn) and raised StopIteration.
    parameters = list(parameters)
    grads = [param.grad.detach() for param in parameters if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    p = float(p)
    # A norm is real: fp32 at least, fp64 where any gradient is (a fixed fp32 refused fp64 and complex gradients,
    # so OSS.clip_grad_norm failed on any fp64 model).
    wide = torch.float64 if any(_real_dtype(g.dtype) == torch.float64 for g in grads) else torch.float32
    if p == inf:
        maxima = [g.abs().max().to(device=device, dtype=wide) for g in grads if g.numel() > 0]
        local_norm = torch.stack(maxima).max() if maxima else torch.zeros((), device=device, dtype=wide)
    else:
        norms = [torch.linalg.vector_norm(g, p, dtype=_norm_dtype(g.dtype)).to(device, wide) for g in grads]
        local_norm = torch.linalg.vector_norm(torch.stack(norms), p)
    first_dtype = next(param.dtype for param in parameters if param.grad is not None)
    return local_norm.to(dtype=_real_dtype(first_dtype))


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``dtype``'s real part (``dtype`` itself where it is real)."""
    return {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}.get(
        dtype, dtype
    )


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``vector_norm`` computes a gradient's norm in: at least fp32, never narrower than the gradient
    (and complex for a complex gradient, as ``vector_norm`` asks; its result is real)."""
    return torch.promote_types(dtype, torch.complex64 if dtype.is_complex else torch.float32)


class _Conversions:
    """The conversions inside :func:`conversion_in_place` now (all threads) and the user's settings they replaced."""

    lock = threading.Lock()  # held only to count, never during a conversion (which may wait for another thread's)
    active = 0
    saved = (False, False)


@contextlib.contextmanager
def conversion_in_place() -> Iterator[None]:
    """Inside: ``Module._apply`` (``.to()``, ``.double()``...) keeps each parameter object, whatever
    ``torch.__future__``'s conversion settings say.

    For owners that swap tensors in and out of ``param.data`` and hold the parameter objects (FSDP's shards): the
    overwrite setting would register new parameter objects the owner does not know, and the swap setting refuses
    parameters whose views are alive (or drops their attributes). A conversion that ``.data`` cannot take (a meta
    tensor to a real device) makes a new object all the same, as torch does.

    The settings are process-wide: the first conversion to enter saves the user's values and the last one to leave
    restores them (before, a thread entering while another was inside saved that one's temporary values and, leaving
    last, restored them for good). A plain module converted by another thread meanwhile still sees the temporary
    settings.
    """
    with _Conversions.lock:
        if _Conversions.active == 0:
            _Conversions.saved = (
                torch.__future__.get_overwrite_module_params_on_conversion(),
                torch.__future__.get_swap_module_params_on_conversion(),
            )
            torch.__future__.set_overwrite_module_params_on_conversion(False)
            torch.__future__.set_swap_module_params_on_conversion(False)
        _Conversions.active += 1
    try:
        yield
    finally:
        with _Conversions.lock:
            _Conversions.active -= 1
            if _Conversions.active == 0:
                overwrite, swap = _Conversions.saved
                torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
                torch.__future__.set_swap_module_params_on_conversion(swap)
