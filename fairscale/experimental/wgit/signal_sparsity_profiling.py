# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How concentrated a tensor's energy is: the share of ``sum |t|`` held by its top-k% entries along a dim."""

from typing import List, Sequence

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

__all__ = ["EnergyConcentrationProfile"]


class EnergyConcentrationProfile:
    """Measure the energy share of the top ``p`` % of entries along ``dim``, for each ``p`` in ``top_k_percents``.

    Args:
        dim (int): the dim along which entries are ranked.
        top_k_percents (Sequence[float]): strictly increasing percents in ``(0, 100]``.
    """

    def __init__(self, dim: int, top_k_percents: Sequence[float]) -> None:
        # AssertionError subclasses (upstream asserted), so the checks hold under ``python -O``.
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise FairscaleTypeError(f"dim must be an int, got {dim!r}")
        self.dim = dim
        self.percents: List[float] = []
        last = 0.0
        for p in top_k_percents:
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise FairscaleTypeError(f"percents must be numbers, got {p!r}")
            if not 0 < p <= 100:
                raise FairscaleValueError(f"percents must be in (0, 100], got {p}")
            if p <= last:
                raise FairscaleValueError(f"percents must be strictly increasing, got {p} after {last}")
            self.percents.append(float(p))
            last = p

    def measure(self, in_tensor: Tensor) -> List[Tensor]:
        """One 0-d tensor per percent: ``sum(top-k |t| along dim) / sum(|t|)``."""
        if not in_tensor.is_floating_point():
            raise FairscaleTypeError(f"measure needs a floating point tensor, got {in_tensor.dtype}")
        if not -in_tensor.ndim <= self.dim < in_tensor.ndim:
            raise FairscaleValueError(f"dim {self.dim} is out of range for a {in_tensor.ndim}-D tensor")
        magnitude = in_tensor.abs()
        total = magnitude.sum()
        size = in_tensor.shape[self.dim]
        results = []
        for p in self.percents:
            k = max(1, round(p / 100 * size))
            results.append(magnitude.topk(k, dim=self.dim).values.sum() / total)
        return results

    def measure_fft(self, in_tensor: Tensor) -> List[Tensor]:
        """:meth:`measure` of the real part of the FFT along ``dim``."""
        return self.measure(torch.fft.fft(in_tensor, dim=self.dim).real)
