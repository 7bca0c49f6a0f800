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
        """Move and/or cast the buffer (``keep_param_alignment`` is used by the subclasses)."""
        assert self.buffer is not None, "Cannot move a collapsed bucket, please rebuild it"
        self.buffer = self.buffer.to(device, dtype, non_blocking)

    def _check_fits(self, tensor: Tensor, kind: str) -> None:
        assert self.buffer is not None
        assert (
            tensor.dtype == self.buffer.dtype
        ), f"Different types for the bucket and the {kind}, cannot proceed: {tensor.dtype} - {self.buffer.dtype}"
        assert (
            tensor.device == self.buffer.device
        ), f"Different devices for the bucket and the {kind}, cannot proceed: {tensor.device} - {self.buffer.device}"


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
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_params()

    @torch.no_grad()
    def add_param(self, param: Tensor) -> None:
        """Copy ``param``'s value into the next free slice and make ``param.data`` a view of that slice.

        Raises:
            AssertionError: the parameter was added already, its dtype or device differ from the buffer's, or it
                does not fit.
        """
        assert id(param) not in self._param_ids, "The same param cannot be checked in twice"
        self._add_param_as_view(param, keep_existing_value=True)
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def _add_param_as_view(self, param: Tensor, keep_existing_value: bool = True) -> None:
        self._check_fits(param, "param")
        assert self.buffer is not None
        start, end = self._fill, self._fill + param.numel()
        assert end <= self.buffer.numel()
        if keep_existing_value:
            self.buffer[start:end].copy_(param.data.flatten())
        param.data = self.buffer[start:end].view_as(param.data)
        self._fill = end

    @torch.no_grad()
    def _reattach_params(self) -> None:
        """Point every parameter at its slice of the (new) buffer, in check-in order, without copying values."""
        assert self.buffer is not None
        self._fill = 0
        for param in self._params:
            # The values are already in the buffer; only the dtype of .data has to follow before the re-pointing.
            if param.dtype != self.buffer.dtype:
                param.data = param.data.to(dtype=self.buffer.dtype)
            self._add_param_as_view(param, keep_existing_value=False)


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
        follow it (without copying their values)."""
        if self._is_collapsed:
            self.rebuild()
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_grads(copy_values=False)

    def zero(self) -> None:
        """Set every gradient of the bucket to zero (in place)."""
        if self.buffer is not None:
            self.buffer.fill_(0.0)

    @torch.no_grad()
    def add_grad(self, param: Tensor) -> None:
        """Make ``param.grad`` a view of the next free slice (a zero gradient is created when there is none).

        An existing gradient keeps its value and stays the same tensor object (its ``.data`` is swapped).

        Raises:
            AssertionError: the gradient was added already, does not fit, or has another dtype or device.
        """
        assert id(param) not in self._param_ids, "The same gradients cannot be checked in twice"
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        self._add_grad_as_view(param, keep_existing_value=True)
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def collapse(self) -> None:
        """Release the buffer: gradients become ``None`` until :meth:`rebuild`."""
        if self._is_collapsed:
            return
        for param in self._params:
            assert param.grad is not None, "Cannot collapse, the gradient has already been released"
            param.grad.detach_()
            param.grad = None
        self.buffer = torch.zeros(0, dtype=self.buffer.dtype if self.buffer is not None else None)
        self._fill = 0
        self.params_checked_in = 0
        self._is_collapsed = True

    @torch.no_grad()
    def rebuild(self) -> None:
        """Allocate the buffer again after :meth:`collapse` and re-create the (zero) gradient views."""
        assert len(self._params) > 0, "Cannot rebuild a buffer with no parameters"
        if not self._is_collapsed:
            return
        first = self._params[0]
        self.buffer = torch.zeros(self._max_size, dtype=first.dtype, device=first.device)
        self._reattach_grads(copy_values=False)
        self._is_collapsed = False

    @torch.no_grad()
    def shrink(self) -> None:
        """Cut the buffer to the gradients it holds (freeing the rest of the storage); values are kept."""
        assert self.buffer is not None and self.buffer.numel() > 0, "Cannot shrink a collapsed bucket, please rebuild"
        # clone(): a slice would keep the whole original storage alive.
        self.buffer = self.buffer[: self._fill].clone()
        self._reattach_grads(copy_values=True)
        self._max_size = self._fill

    @torch.no_grad()
    def _reattach_grads(self, copy_values: bool) -> None:
        self._fill = 0
        for param in self._params:
            self._add_grad_as_view(param, keep_existing_value=copy_values)

    @torch.no_grad()
    def _add_grad_as_view(self, param: Tensor, keep_existing_value: bool = True) -> None:
        assert (
            self.buffer is not None and self.buffer.numel() > 0
        ), "Cannot add a gradient to a collapsed bucket, please rebuild"
        assert param.dtype == self.buffer.dtype
        assert param.device == self.buffer.device
        start, end = self._fill, self._fill + param.numel()
        assert end <= self.buffer.numel()
        view = self.buffer[start:end].view_as(param)
        self._offsets[id(param)] = start
        if param.grad is not None:
            if keep_existing_value:
                view.copy_(param.grad.data.flatten().view_as(param))
            param.grad.data = view
        else:
            param.grad = view
        self._fill = end

    def slot(self, param: Tensor) -> Tensor:
        """The slice of the buffer that ``param``'s gradient should be a view of (shaped like ``param``)."""
        assert self.buffer is not None
        start = self._offsets[id(param)]
        return self.buffer[start : start + param.numel()].view_as(param)
