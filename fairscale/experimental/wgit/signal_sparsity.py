# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Sparse signal representations of weights: a few large frequency components (SST, "sparse signal tensor") plus a
few large residual deltas (DST, "delta sparse tensor"), whose sum approximates (or exactly restores) the tensor.

Pure torch; importable without wgit's optional packages.
"""

import numbers
from enum import Enum
from typing import Any, Optional, Tuple, cast

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

__all__ = ["Algo", "SignalSparsity", "random_sparse_mask"]


class Algo(Enum):
    FFT = 0
    DCT = 1


def _is_sparsity_enabled(top_k_element: Optional[int], top_k_percent: Optional[float]) -> bool:
    return top_k_element is not None or top_k_percent is not None


def _get_k_for_topk(top_k_percent: Optional[float], top_k_element: Optional[int], top_k_total_size: int) -> int:
    """k from a percent (Python rounding, so 2.5 gives 2) or an element count; at least 1."""
    # AssertionError subclasses where upstream asserted: they hold under ``python -O``.
    if top_k_total_size <= 0:
        raise FairscaleValueError("cannot pick top-k of an empty tensor (the dim has size 0)")
    if top_k_element is None:
        if top_k_percent is None:
            raise FairscaleValueError("top-k needs top_k_percent or top_k_element")
        k = round(top_k_total_size * top_k_percent / 100.0)
    else:
        if top_k_element > top_k_total_size:
            raise ValueError("top_k_element for sst or dst is larger than max number of elements along top_k_dim")
        k = top_k_element
    return max(k, 1)


def _scatter_topk_to_sparse_tensor(
    top_k_tensor: Tensor, to_be_sparsify_tensor: Tensor, k: int, dim: Optional[int]
) -> Tensor:
    """Keep the values of ``to_be_sparsify_tensor`` at the top-``k`` positions of ``top_k_tensor`` along ``dim``."""
    if top_k_tensor.shape != to_be_sparsify_tensor.shape:
        raise FairscaleValueError(
            f"ranking and values must have the same shape, got {tuple(top_k_tensor.shape)} and "
            f"{tuple(to_be_sparsify_tensor.shape)}"
        )
    if dim is None and top_k_tensor.ndim > 1:
        flat = _scatter_topk_to_sparse_tensor(top_k_tensor.reshape(-1), to_be_sparsify_tensor.reshape(-1), k, 0)
        return flat.reshape(to_be_sparsify_tensor.shape)
    # dim None on a 1-D tensor reaches topk as None and fails there, as upstream.
    _, indices = torch.topk(top_k_tensor, k, dim=dim)  # type: ignore[arg-type]
    result = torch.zeros_like(to_be_sparsify_tensor)
    return result.scatter_(dim, indices, to_be_sparsify_tensor.gather(dim, indices))  # type: ignore[arg-type]


def _check_dim_type(name: str, dim: Any, allow_none: bool = True) -> None:
    """Refuse a dim that is not an int (or ``None`` where allowed): a float one failed deep inside with "tuple
    indices must be integers"."""
    if (dim is None and allow_none) or (isinstance(dim, numbers.Integral) and not isinstance(dim, bool)):
        return
    raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {dim!r} ({type(dim).__name__})")


def _check_dim(tensor: Tensor, dim: Optional[int], name: str) -> None:
    """Refuse a dim the tensor does not have (it failed with a bare ``IndexError: tuple index out of range``)."""
    if dim is not None and not -tensor.ndim <= dim < tensor.ndim:
        valid = f"in [{-tensor.ndim}, {tensor.ndim - 1}]" if tensor.ndim else "None (a 0-d tensor has no dim)"
        raise ValueError(
            f"{name}={dim} is out of range for a tensor of {tensor.ndim} dimension(s) (shape {tuple(tensor.shape)}): "
            f"use a dim {valid}"
        )


def _top_k_total_size(tensor: Tensor, dim: Optional[int], name: str) -> int:
    _check_dim(tensor, dim, name)
    return tensor.numel() if dim is None else tensor.shape[dim]


class SignalSparsity:
    """Top-k sparsification in the frequency domain (SST) and of the residual (DST).

    Args:
        algo (Algo): the transform (only ``Algo.FFT`` is implemented).
        sst_top_k_dim (Optional[int]): dim along which SST keeps its top-k (``None``: the whole tensor).
        sst_top_k_element (Optional[int]): number of SST entries kept per slice.
        sst_top_k_percent (Optional[float]): or the percentage of them, in ``(0, 100]``.
        dst_top_k_dim, dst_top_k_element, dst_top_k_percent: the same for DST.

    Raises:
        ValueError: both an element count and a percent for SST or for DST, a percent outside ``(0, 100]`` or an
            element count ``<= 0``; later, a dim the tensor given does not have.
        TypeError: ``algo`` is not an :class:`Algo`, or a dim is not an int or ``None``.
    """

    def __init__(
        self,
        algo: Algo = Algo.FFT,
        sst_top_k_dim: Optional[int] = -1,
        sst_top_k_element: Optional[int] = None,
        sst_top_k_percent: Optional[float] = None,
        dst_top_k_dim: Optional[int] = -1,
        dst_top_k_element: Optional[int] = None,
        dst_top_k_percent: Optional[float] = None,
    ) -> None:
        self._sst_top_k_dim = sst_top_k_dim
        self._sst_top_k_element = sst_top_k_element
        self._sst_top_k_percent = sst_top_k_percent
        self._dst_top_k_dim = dst_top_k_dim
        self._dst_top_k_element = dst_top_k_element
        self._dst_top_k_percent = dst_top_k_percent
        # Any value but Algo.FFT selected DCT: FFT's own value 0, or "FFT", failed later with "DCT not implemented".
        if not isinstance(algo, Algo):
            raise TypeError(f"algo must be an Algo (Algo.FFT; Algo.DCT is not implemented), got {algo!r}")
        _check_dim_type("sst_top_k_dim", sst_top_k_dim)
        _check_dim_type("dst_top_k_dim", dst_top_k_dim)
        self._validate_conf()
        self._transform, self._inverse_transform = (
            (self._fft_transform, self._ifft_transform) if algo is Algo.FFT else (self._dct, self._idct)
        )

    def _validate_conf(self) -> None:
        for name, element, percent in (
            ("sst", self._sst_top_k_element, self._sst_top_k_percent),
            ("dst", self._dst_top_k_element, self._dst_top_k_percent),
        ):
            if element is not None and percent is not None:
                raise ValueError(f"{name}: top_k_element and top_k_percent can't both be set")
            # Types first: a float or bool count passed the range check and failed later inside torch.topk, a string
            # percent failed the comparison with a TypeError that named neither the argument nor what it takes.
            if element is not None and (isinstance(element, bool) or not isinstance(element, numbers.Integral)):
                raise FairscaleValueError(f"{name}: top_k_element must be an int, got {element!r}")
            if percent is not None and (isinstance(percent, bool) or not isinstance(percent, numbers.Real)):
                raise FairscaleValueError(f"{name}: top_k_percent must be a number in (0, 100], got {percent!r}")
            if percent is not None and not (0 < percent <= 100):
                raise ValueError(f"{name}: top_k_percent must be in (0, 100], got {percent}")
            if element is not None and element <= 0:
                raise ValueError(f"{name}: top_k_element must be positive, got {element}")
        self._sst_enabled = _is_sparsity_enabled(self._sst_top_k_element, self._sst_top_k_percent)
        self._dst_enabled = _is_sparsity_enabled(self._dst_top_k_element, self._dst_top_k_percent)

    @staticmethod
    def _dct(dense: Tensor, dim: Optional[int]) -> Tensor:
        raise NotImplementedError("Support for DCT has not been implemented yet!")

    @staticmethod
    def _idct(sst: Tensor, dim: Optional[int]) -> Tensor:
        raise NotImplementedError("Support for iDCT has not been implemented yet!")

    @staticmethod
    def _fft_transform(dense: Tensor, dim: Optional[int]) -> Tensor:
        if dim is None:
            return torch.fft.fft(dense.reshape(-1)).reshape(dense.shape)
        return torch.fft.fft(dense, dim=dim)

    @staticmethod
    def _ifft_transform(sst: Tensor, dim: Optional[int]) -> Tensor:
        if dim is None:
            return torch.fft.ifft(sst.reshape(-1)).reshape(sst.shape)
        return torch.fft.ifft(sst, dim=dim)

    def dense_to_sst(self, dense: Tensor) -> Optional[Tensor]:
        """The SST of ``dense``: its top-k frequency components (ranked by ``|real part|``), or None if disabled."""
        if not self._sst_enabled:
            return None
        # k first: it refuses an empty tensor, which the transform would fail on with torch's own error.
        k = _get_k_for_topk(
            self._sst_top_k_percent,
            self._sst_top_k_element,
            _top_k_total_size(dense, self._sst_top_k_dim, "sst_top_k_dim"),
        )
        w = self._transform(dense.float(), self._sst_top_k_dim)
        return _scatter_topk_to_sparse_tensor(w.real.abs(), w, k, self._sst_top_k_dim)

    def dense_sst_to_dst(self, dense: Tensor, sst: Optional[Tensor]) -> Optional[Tensor]:
        """The DST: the top-k of ``dense - sst_to_dense(sst)`` by magnitude, or None if disabled."""
        if not self._dst_enabled:
            return None
        if sst is None:
            sst = torch.zeros_like(dense, dtype=torch.complex64)
        if dense.shape != sst.shape:
            raise ValueError("dense and sst have different shapes!")
        k = _get_k_for_topk(  # first: it refuses an empty tensor (see dense_to_sst)
            self._dst_top_k_percent,
            self._dst_top_k_element,
            _top_k_total_size(dense, self._dst_top_k_dim, "dst_top_k_dim"),
        )
        _check_dim(dense, self._sst_top_k_dim, "sst_top_k_dim")  # the SST's inverse transform runs along it
        delta = dense - self._inverse_transform(sst, self._sst_top_k_dim).real
        return _scatter_topk_to_sparse_tensor(delta.abs(), delta, k, self._dst_top_k_dim)

    def sst_dst_to_dense(self, sst: Optional[Tensor], dst: Optional[Tensor] = None) -> Tensor:
        """Reconstruct the dense tensor from its SST and/or DST."""
        if sst is None and dst is None:
            raise AssertionError("both-None-case is not useful")
        if sst is None:
            return cast(Tensor, dst)  # not None: checked just above
        _check_dim(sst, self._sst_top_k_dim, "sst_top_k_dim")
        dense_rt = self._inverse_transform(sst, self._sst_top_k_dim).real
        if dst is not None:
            dense_rt = dense_rt + dst
        return dense_rt

    def lossy_compress(self, dense: Tensor) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(reconstruction, sst, dst)``; ``(dense, None, dense)`` when both would keep every element."""
        if self._keeps_everything(dense):
            return dense, None, dense
        sst = self.dense_to_sst(dense)
        dst = self.dense_sst_to_dst(dense, sst)
        return self.sst_dst_to_dense(sst, dst), sst, dst

    def _keeps_everything(self, dense: Tensor) -> bool:
        if not (self._sst_enabled and self._dst_enabled):
            return False
        sst_total = _top_k_total_size(dense, self._sst_top_k_dim, "sst_top_k_dim")
        dst_total = _top_k_total_size(dense, self._dst_top_k_dim, "dst_top_k_dim")
        sst_k = _get_k_for_topk(self._sst_top_k_percent, self._sst_top_k_element, sst_total)
        dst_k = _get_k_for_topk(self._dst_top_k_percent, self._dst_top_k_element, dst_total)
        return sst_k == sst_total and dst_k == dst_total


def random_sparse_mask(dense: Tensor, percent: float, dim: int) -> Tensor:
    """A 0/1 mask like ``dense`` with ``max(1, round(size * percent / 100))`` random ones per slice along ``dim``."""
    if not 0 < percent <= 100:
        raise FairscaleValueError(f"percent must be in (0, 100], got {percent}")
    _check_dim_type("dim", dim, allow_none=False)
    _check_dim(dense, dim, "dim")
    k = max(1, round(dense.shape[dim] * percent / 100))
    _, indices = torch.rand_like(dense, dtype=torch.float32).topk(k, dim=dim)
    return torch.zeros_like(dense).scatter_(dim, indices, 1)
