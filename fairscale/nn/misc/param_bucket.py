# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Flat buffers that parameters (:class:`ParamBucket`) or gradients (:class:`GradBucket`) are views of.

Communicating one flat buffer instead of many small tensors saves the per-call latency of a collective. A bucket
owns one 1-D ``buffer``; every tensor checked into it becomes a view of a consecutive slice (in check-in order),
so writing the buffer (a broadcast, a reduce) writes all of them at once. :class:`~fairscale.optim.OSS` broadcasts
its parameters through ``ParamBucket`` s and :class:`~fairscale.nn.data_parallel.ShardedDataParallel` reduces
gradients through ``GradBucket`` s.
"""

from typing import Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

__all__ = ["Bucket", "ParamBucket", "GradBucket"]

_Device = Union[torch.device, str]


class Bucket:
    """A flat ``buffer`` plus the tensors it backs; the shared part of the two bucket kinds.

    Args:
        size (int): number of elements of the buffer.
        dtype (torch.dtype): element type; every tensor checked in must have it.
        device (torch.device): where the buffer lives; every tensor checked in must be there.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: _Device) -> None:
        self.buffer: Optional[Tensor] = torch.zeros(size, dtype=dtype, device=device)
        self._params: List[torch.Tensor] = []
        self._param_ids: List[int] = []
        self._fill = 0

    def to(
        self,
        device: Optional[_Device],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move and/or cast the buffer (``keep_param_alignment`` is used by the subclasses).

        Raises:
            FairscaleRuntimeError: the bucket has no buffer (``buffer`` was set to ``None``).
        """
        self.buffer = self._live_buffer(f"{type(self).__name__}.to").to(device, dtype, non_blocking)

    def _move(
        self,
        device: Optional[_Device],
        dtype: Optional[torch.dtype],
        non_blocking: bool,
        reattach: Optional[Callable[[], None]],
        after_rollback: Optional[Callable[[], None]] = None,
    ) -> None:
        """:meth:`to` for a subclass whose tensors are views of the buffer: ``reattach`` (``None`` to leave them
        where they are) points them into the new buffer.

        When ``reattach`` fails, the old buffer (still holding their values) comes back and they are pointed into it
        again, then ``after_rollback`` runs, before the error is raised: a failed call must not leave some of them
        outside the buffer that is meant to hold them (a reduction of the buffer must still reach every gradient).
        """
        previous = self.buffer
        Bucket.to(self, device, dtype, non_blocking)
        if reattach is None:
            return
        try:
            reattach()
        except BaseException:
            self.buffer = previous
            reattach()
            if after_rollback is not None:
                after_rollback()
            raise

    def _live_buffer(self, who: str) -> Tensor:
        """The buffer; a clear error instead of a failure on ``None`` (the module itself never sets ``None``, but
        ``buffer`` is a public attribute)."""
        if self.buffer is None:
            raise FairscaleRuntimeError(
                f"{who}: the bucket has no buffer (its buffer attribute is None); build a new "
                f"{type(self).__name__} for these tensors"
            )
        return self.buffer

    def _check_fits(self, tensor: Tensor, kind: str, who: str) -> Tensor:
        """Check that ``tensor`` (a parameter; for a gradient, its parameter) can be a view of the buffer, whose
        dtype and device it must have; returns the buffer."""
        buffer = self._live_buffer(who)
        if tensor.dtype != buffer.dtype:
            raise FairscaleTypeError(
                f"{who}: Different types for the bucket and the {kind}: the parameter is {tensor.dtype} but the "
                f"bucket is {buffer.dtype}; use a bucket of the parameter's dtype"
            )
        if tensor.device != buffer.device:
            raise FairscaleValueError(
                f"{who}: Different devices for the bucket and the {kind}: the parameter is on {tensor.device} but "
                f"the bucket is on {buffer.device}; use a bucket on the parameter's device (a tensor can only be a "
                "view of a buffer on its own device: to move parameters, move them first and build a new bucket)"
            )
        return buffer

    def _check_room(self, numel: int, buffer: Tensor, kind: str, who: str, hint: str) -> int:
        """The end of the next free slice of ``numel`` elements; raises when the buffer has no room for it."""
        end = self._fill + numel
        if end > buffer.numel():
            raise FairscaleValueError(
                f"{who}: the {kind} does not fit in the bucket: it has {numel} elements but only "
                f"{buffer.numel() - self._fill} of the bucket's {buffer.numel()} are free; {hint}"
            )
        return end


class ParamBucket(Bucket):
    """A flat buffer that a group of parameters are views of (their ``.data`` points into it).

    Args:
        size (int): number of elements of the buffer (at least the total size of the parameters added).
        dtype (torch.dtype): dtype of the buffer and of every parameter added.
        device (torch.device): device of the buffer and of every parameter added.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: _Device) -> None:
        super().__init__(size, dtype, device)

    def to(
        self,
        device: Optional[_Device],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move and/or cast the buffer; with ``keep_param_alignment`` the parameters follow it.

        Args:
            device (torch.device): the new device (``None`` keeps it).
            dtype (torch.dtype): the new dtype (``None`` keeps it).
            non_blocking (bool): asynchronous copy where the devices allow it.
            keep_param_alignment (bool): re-point every parameter into the new buffer (values come from the
                buffer). With ``False`` the parameters keep their old storage, e.g. to communicate a low-precision
                copy of the buffer and convert it back afterwards.
        """
        self._move(device, dtype, non_blocking, self._reattach_params if keep_param_alignment else None)

    @torch.no_grad()
    def add_param(self, param: Tensor) -> None:
        """Copy ``param``'s value into the next free slice and make ``param.data`` a view of that slice.

        The errors are also ``AssertionError`` s, what upstream raised.

        Raises:
            FairscaleValueError: the parameter was added already, its device differs from the buffer's, or it
                does not fit.
            FairscaleTypeError: its dtype differs from the buffer's.
            FairscaleRuntimeError: the bucket has no buffer.
        """
        if id(param) in self._param_ids:
            raise FairscaleValueError(
                "ParamBucket.add_param: the parameter is already in the bucket and cannot be checked in twice; "
                "add each parameter once"
            )
        self._add_param_as_view(param, keep_existing_value=True, who="ParamBucket.add_param")
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def _add_param_as_view(self, param: Tensor, keep_existing_value: bool = True, *, who: str) -> None:
        buffer = self._check_fits(param, "param", who)
        start = self._fill
        end = self._check_room(
            param.numel(), buffer, "parameter", who, "create the bucket with at least the total size of its parameters"
        )
        if keep_existing_value:
            buffer[start:end].copy_(param.data.flatten())
        param.data = buffer[start:end].view_as(param.data)
        self._fill = end

    @torch.no_grad()
    def _reattach_params(self) -> None:
        """Point every parameter at its slice of the (new) buffer, in check-in order, without copying values."""
        # Only called by to(), right after it assigned a tensor to the buffer: narrows the type for mypy.
        assert self.buffer is not None
        self._fill = 0
        for param in self._params:
            # The values are already in the buffer; only the dtype of .data has to follow before the re-pointing.
            if param.dtype != self.buffer.dtype:
                param.data = param.data.to(dtype=self.buffer.dtype)
            self._add_param_as_view(param, keep_existing_value=False, who="ParamBucket.to")


class GradBucket(Bucket):
    """A flat buffer that a group of gradients are views of, reduced in one call to rank ``destination``.

    Args:
        size (int): the maximum number of elements (gradients are added while they fit, see
            :meth:`can_add_grad_view`).
        dtype (torch.dtype): dtype of the buffer and of every gradient.
        device (torch.device): device of the buffer and of every gradient.
        destination (int): the global rank that receives the reduced bucket.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: _Device, destination: int) -> None:
        super().__init__(size, dtype, device)
        self._max_size = size
        self._is_collapsed = False
        self.params_checked_in = 0
        self.destination = destination
        self.sent = True
        self.callback: Optional[Callable[..., None]] = None
        # Start of each gradient's slice, by id(param): lets the owner re-attach a gradient that was replaced.
        self._offsets: Dict[int, int] = {}

    def reset_checked_in(self) -> None:
        """Start a new backward: no gradient checked in, not sent."""
        self.params_checked_in = 0
        self.sent = False

    @property
    def all_checked_in(self) -> bool:
        """Whether every gradient of the bucket has been checked in during this backward."""
        return len(self._params) == self.params_checked_in

    def can_add_grad_view(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient fits (strictly below the maximum size) and is not in the bucket yet."""
        return self._fill + param.numel() < self._max_size and id(param) not in self._param_ids

    def to(
        self,
        device: Optional[_Device],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move and/or cast the buffer (rebuilding a collapsed one); with ``keep_param_alignment`` the gradients
        follow it (without copying their values).

        Raises:
            FairscaleTypeError: ``dtype`` differs from the gradients' parameters' while ``keep_param_alignment`` is
                set (nothing changed): a gradient must have its parameter's dtype, which the bucket does not change.
        """
        if dtype is not None and keep_param_alignment:
            others = sorted({str(p.dtype) for p in self._params if p.dtype != dtype})
            if others:
                raise FairscaleTypeError(
                    "GradBucket.to: Different types for the bucket and the gradient: cannot cast the bucket to "
                    f"{dtype} while it holds gradients of {', '.join(others)} parameters (a gradient has its "
                    "parameter's dtype, and the bucket does not convert parameters); "
                    "convert the parameters first and build a bucket of their dtype, or pass "
                    "keep_param_alignment=False to cast the buffer alone"
                )
        was_collapsed = self._is_collapsed
        if was_collapsed:
            self.rebuild()
        self._move(
            device,
            dtype,
            non_blocking,
            (lambda: self._reattach_grads(copy_values=False, who="GradBucket.to")) if keep_param_alignment else None,
            # Back to how the call found it: collapsed again, once the gradients are views of the old buffer.
            self.collapse if was_collapsed else None,
        )

    def zero(self) -> None:
        """Set every gradient of the bucket to zero (in place)."""
        if self.buffer is not None:
            self.buffer.fill_(0.0)

    @torch.no_grad()
    def add_grad(self, param: Tensor) -> None:
        """Make ``param.grad`` a view of the next free slice (a zero gradient is created when there is none).

        An existing gradient keeps its value and stays the same tensor object (its ``.data`` is swapped). The errors
        are also ``AssertionError`` s, what upstream raised.

        Raises:
            FairscaleValueError: the gradient was added already, does not fit, or its parameter is on another
                device.
            FairscaleTypeError: its parameter has another dtype.
            FairscaleRuntimeError: the bucket is collapsed (call :meth:`rebuild` first).
        """
        if id(param) in self._param_ids:
            raise FairscaleValueError(
                "GradBucket.add_grad: the parameter's gradient is already in the bucket and cannot be checked in "
                "twice; add each parameter once (can_add_grad_view(param) tells whether it may be added)"
            )
        created = param.grad is None
        if created:
            param.grad = torch.zeros_like(param)
        try:
            self._add_grad_as_view(param, keep_existing_value=True, who="GradBucket.add_grad")
        except BaseException:
            if created:  # a refused call leaves the parameter as it was (an optimizer skips a None gradient)
                param.grad = None
            raise
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def collapse(self) -> None:
        """Release the buffer: gradients become ``None`` until :meth:`rebuild`.

        Raises:
            FairscaleRuntimeError: a gradient of the bucket was set to ``None`` outside of it (nothing is released).
        """
        if self._is_collapsed:
            return
        # Checked for every gradient before releasing any, so that an error leaves the bucket as it was.
        released = sum(1 for param in self._params if param.grad is None)
        if released:
            raise FairscaleRuntimeError(
                f"GradBucket.collapse: cannot collapse, {released} gradient(s) of the bucket have already been "
                "released (set to None outside the bucket, e.g. by zero_grad(set_to_none=True)); keep the "
                "gradients of bucketed parameters until collapse(), or give one back first with "
                "param.grad = bucket.slot(param)"
            )
        for param in self._params:
            assert param.grad is not None  # checked above; narrows the type for mypy
            # A view (what ShardedDDP's reducer assigns: param.grad = slot(param)) cannot be detached in place;
            # dropping the reference is what releases it.
            if not param.grad._is_view():
                param.grad.detach_()
            param.grad = None
        self.buffer = torch.zeros(0, dtype=self.buffer.dtype if self.buffer is not None else None)
        self._fill = 0
        self.params_checked_in = 0
        self._is_collapsed = True

    @torch.no_grad()
    def rebuild(self) -> None:
        """Allocate the buffer again after :meth:`collapse` and re-create the (zero) gradient views.

        Raises:
            FairscaleRuntimeError: the bucket holds no gradient (its dtype and device come from the first one).
        """
        if len(self._params) == 0:
            raise FairscaleRuntimeError(
                "GradBucket.rebuild: cannot rebuild a buffer with no parameters (the buffer takes the dtype and "
                "device of the first one); add_grad() a parameter before rebuilding"
            )
        if not self._is_collapsed:
            return
        first = self._params[0]
        self.buffer = torch.zeros(self._max_size, dtype=first.dtype, device=first.device)
        self._reattach_grads(copy_values=False, who="GradBucket.rebuild")
        self._is_collapsed = False

    @torch.no_grad()
    def shrink(self) -> None:
        """Cut the buffer to the gradients it holds (freeing the rest of the storage); values are kept.

        Raises:
            FairscaleRuntimeError: the bucket is collapsed (or has no buffer), or holds no gradient.
        """
        buffer = self._live_buffer("GradBucket.shrink")
        if buffer.numel() > 0 and not self._params:
            # A zero-size buffer is what marks a collapsed bucket, which rebuild() cannot rebuild without parameters.
            raise FairscaleRuntimeError(
                "GradBucket.shrink: the bucket holds no gradient, so there is nothing to shrink to (an empty buffer "
                "could never take a gradient again); add_grad() first, or drop the bucket"
            )
        if buffer.numel() == 0:
            raise FairscaleRuntimeError(
                "GradBucket.shrink: cannot shrink a collapsed bucket (its buffer is empty); call rebuild() first"
            )
        # clone(): a slice would keep the whole original storage alive.
        self.buffer = buffer[: self._fill].clone()
        self._reattach_grads(copy_values=True, who="GradBucket.shrink")
        self._max_size = self._fill

    @torch.no_grad()
    def _reattach_grads(self, copy_values: bool, *, who: str) -> None:
        self._fill = 0
        for param in self._params:
            self._add_grad_as_view(param, keep_existing_value=copy_values, who=who)

    @torch.no_grad()
    def _add_grad_as_view(self, param: Tensor, keep_existing_value: bool = True, *, who: str) -> None:
        if self.buffer is not None and self.buffer.numel() == 0:
            raise FairscaleRuntimeError(
                f"{who}: cannot add a gradient to a collapsed bucket (its buffer is empty); call rebuild() first"
            )
        buffer = self._check_fits(param, "gradient", who)
        start = self._fill
        end = self._check_room(
            param.numel(), buffer, "gradient", who, "check can_add_grad_view(param) first, or use a bigger bucket"
        )
        view = buffer[start:end].view_as(param)
        self._offsets[id(param)] = start
        if param.grad is not None:
            if keep_existing_value:
                view.copy_(param.grad.data.flatten().view_as(param))
            param.grad.data = view
        else:
            param.grad = view
        self._fill = end

    def slot(self, param: Tensor) -> Tensor:
        """The slice of the buffer that ``param``'s gradient should be a view of (shaped like ``param``).

        Raises:
            FairscaleRuntimeError: the bucket has no buffer.
        """
        buffer = self._live_buffer("GradBucket.slot")
        start = self._offsets[id(param)]
        return buffer[start : start + param.numel()].view_as(param)
