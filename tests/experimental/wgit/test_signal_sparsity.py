# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SignalSparsity and EnergyConcentrationProfile (pure torch): upstream's documented values, perfect
reconstruction, percent/element equivalence, the validation errors and the random mask."""

import numpy as np
import pytest
import torch

from fairscale.experimental.wgit import Algo, EnergyConcentrationProfile, SignalSparsity, random_sparse_mask

INPUTS = [
    (torch.arange(12).sin().reshape(4, 3), None),
    (torch.arange(50, 62).sin().reshape(4, 3) / 100, 0),
    (torch.tensor([[1.0, 5, 3, 7, 2], [0, 4, 9, 6, 8], [3, 1, 1, 5, 2]]), 1),
    (torch.arange(12).cos().reshape(3, 2, 2), 1),
]


def test_perfect_reconstruction_and_percent_equivalence() -> None:
    for dense, dim in INPUTS:
        total = dense.numel() if dim is None else dense.shape[dim]
        full = SignalSparsity(sst_top_k_dim=dim, sst_top_k_element=total, dst_top_k_dim=dim, dst_top_k_element=total)
        recon, sst, dst = full.lossy_compress(dense)
        assert recon is dense and sst is None and dst is dense
        sst_only = SignalSparsity(sst_top_k_dim=dim, sst_top_k_percent=100)
        sst_full = sst_only.dense_to_sst(dense)
        expected = (
            torch.fft.fft(dense.reshape(-1)).reshape(dense.shape) if dim is None else torch.fft.fft(dense, dim=dim)
        )
        assert torch.equal(sst_full, expected)
        torch.testing.assert_close(sst_only.sst_dst_to_dense(sst_full), dense)
        # SST + DST with k < total reconstruct exactly when DST keeps the whole residual.
        lossy = SignalSparsity(sst_top_k_dim=dim, sst_top_k_element=1, dst_top_k_dim=dim, dst_top_k_percent=100)
        torch.testing.assert_close(lossy.lossy_compress(dense)[0], dense, rtol=1e-5, atol=1e-6)
        # Percent and element forms agree.
        by_element = SignalSparsity(sst_top_k_dim=dim, sst_top_k_element=1, dst_top_k_dim=dim, dst_top_k_element=1)
        by_percent = SignalSparsity(
            sst_top_k_dim=dim, sst_top_k_percent=100 / total, dst_top_k_dim=dim, dst_top_k_percent=100 / total
        )
        for a, b in zip(by_element.lossy_compress(dense), by_percent.lossy_compress(dense)):
            torch.testing.assert_close(a, b)


def test_documented_values() -> None:
    dst_only = SignalSparsity(dst_top_k_element=2)
    recon, sst, dst = dst_only.lossy_compress(torch.tensor([0.5, 0.6, 0.7, 0.8]))
    assert sst is None
    torch.testing.assert_close(recon, torch.tensor([0.0, 0.0, 0.7, 0.8]))
    sst_only = SignalSparsity(sst_top_k_element=3)
    recon, sst, dst = sst_only.lossy_compress(torch.tensor([0.5, 0.6, 0.7, 0.8, 0.9]))
    assert dst is None
    torch.testing.assert_close(recon, torch.tensor([0.6, 0.7618, 0.7, 0.6382, 0.8]), atol=1e-4, rtol=0)
    # SST ranks by |Re F| (upstream), not by the complex magnitude.
    x = torch.tensor([1.0, 2.0, 0.0, 0.0])
    f = torch.fft.fft(x)
    kept = SignalSparsity(sst_top_k_element=1).dense_to_sst(x)
    assert torch.count_nonzero(kept) == 1 and kept[f.real.abs().argmax()] == f[f.real.abs().argmax()]


def test_validation_errors() -> None:
    with pytest.raises(ValueError):
        SignalSparsity(sst_top_k_element=1, sst_top_k_percent=10)
    with pytest.raises(ValueError):
        SignalSparsity(dst_top_k_element=1, dst_top_k_percent=10)
    with pytest.raises(ValueError):
        SignalSparsity(sst_top_k_percent=0)
    with pytest.raises(ValueError):
        SignalSparsity(dst_top_k_percent=101)
    with pytest.raises(ValueError):
        SignalSparsity(sst_top_k_element=0)
    with pytest.raises(ValueError, match="larger than max number of elements"):
        SignalSparsity(sst_top_k_element=5).dense_to_sst(torch.ones(3))
    with pytest.raises(ValueError, match="different shapes"):
        SignalSparsity(dst_top_k_element=1).dense_sst_to_dst(torch.ones(3), torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(AssertionError, match="both-None-case"):
        SignalSparsity().sst_dst_to_dense(None, None)
    with pytest.raises(NotImplementedError, match="DCT"):
        SignalSparsity(algo=Algo.DCT, sst_top_k_element=1).dense_to_sst(torch.ones(3))
    assert SignalSparsity().dense_to_sst(torch.ones(3)) is None  # disabled


def test_wrong_types_and_empty_tensors_are_refused_with_what_is_wrong() -> None:
    # A float or bool count passed the range check and failed inside torch.topk; a string percent failed a comparison.
    for bad in (2.5, True):
        with pytest.raises(ValueError, match=f"sst: top_k_element must be an int, got {bad!r}"):
            SignalSparsity(sst_top_k_element=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst: top_k_percent must be a number in"):
        SignalSparsity(dst_top_k_percent="50")  # type: ignore[arg-type]
    assert SignalSparsity(sst_top_k_element=np.int64(2)).dense_to_sst(torch.ones(4)) is not None  # numpy ints work
    # An empty tensor reached torch's fft error before the package's own message.
    with pytest.raises(ValueError, match="empty tensor"):
        SignalSparsity(sst_top_k_element=1).dense_to_sst(torch.ones(0))
    with pytest.raises(ValueError, match="empty tensor"):
        SignalSparsity(dst_top_k_element=1).dense_sst_to_dst(torch.ones(0), torch.ones(0, dtype=torch.complex64))


def test_random_sparse_mask() -> None:
    torch.manual_seed(0)
    mask = random_sparse_mask(torch.randn(4, 10), 30, dim=1)
    assert mask.sum(dim=1).tolist() == [3.0] * 4 and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert random_sparse_mask(torch.randn(5, 3), 1, dim=0).sum(dim=0).tolist() == [1.0] * 3


def test_energy_concentration_profile() -> None:
    values = EnergyConcentrationProfile(0, [1, 5, 10, 100]).measure(torch.ones(100))
    torch.testing.assert_close(torch.stack(values), torch.tensor([0.01, 0.05, 0.1, 1.0]))
    x = torch.tensor([0.1, 0.2, 0.1, 0.45]).repeat(100, 1)
    profile = EnergyConcentrationProfile(0, [1, 3, 33, 66, 90])
    expected = torch.tensor([0.01, 0.03, 0.33, 0.66, 0.9])
    torch.testing.assert_close(torch.stack(profile.measure(x)), expected)
    torch.testing.assert_close(torch.stack(profile.measure_fft(torch.fft.ifft(x, dim=0))), expected)
    with pytest.raises(AssertionError):
        EnergyConcentrationProfile(0, [5, 1])
