# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How concentrated a tensor's energy is: the share of ``sum |t|`` held by its top-k% entries along a dim."""

from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["EnergyConcentrationProfile"]


class EnergyConcentrationProfile:
    """Measure the energy share of the top ``p`` % of entries along ``dim``, for each ``p`` in ``top_k_percents``.

    Args:
        dim (int): the dim along which entries are ranked.
        top_k_percents (Sequence[float]): strictly increasing percents in ``(0, 100]``.
    """

    def __init__(self, dim: int, top_k_percents: Sequence[float]) -> None:
        assert isinstance(dim, int), f"dim must be an int, got {dim!r}"
        self.dim = dim
        self.percents: List[float] = []
        last = 0.0
        for p in top_k_percents:
            assert isinstance(p, (int, float)), f"percents must be numbers, got {p!r}"
            assert 0 < p <= 100, f"percents must be in (0, 100], got {p}"
            assert p > last, "percents must be strictly increasing"
            self.percents.append(float(p))
            last = p

    def measure(self, in_tensor: Tensor) -> List[Tensor]:
        """One 0-d tensor per percent: ``sum(top-k |t| along dim) / sum(|t|)``."""
        assert in_tensor.is_floating_point(), "measure needs a floating point tensor"
        assert self.dim < in_tensor.ndim, f"dim {self.dim} is out of range for a {in_tensor.ndim}-D tensor"
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
