# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Arguments that cannot work are refused up front with a message naming them: ``SHA1_Store`` sizes (a read size of
0 hashed every object as the empty string's SHA1, and lost all but the first), ``SignalSparsity`` dims and ``algo``,
and ``random_sparse_mask``'s dim. Valid values keep working and give the same results."""

import hashlib
import pickle
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from fairscale.experimental.wgit.signal_sparsity import Algo, SignalSparsity, random_sparse_mask
from fairscale.experimental.wgit.sha1_store import SHA1_Store, _to_np

# ------------------------------------------------------------------------------------------ SHA1_Store sizes


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sha1_buf_size": 0}, ValueError, "sha1_buf_size must be at least 1, got 0"),
        ({"sha1_buf_size": -5}, ValueError, "sha1_buf_size must be at least 1, got -5"),
        ({"sha1_buf_size": 1.5}, TypeError, r"sha1_buf_size must be an int, got 1\.5"),
        ({"sha1_buf_size": "10"}, TypeError, "sha1_buf_size must be an int, got '10'"),
        ({"sha1_buf_size": True}, TypeError, "sha1_buf_size must be an int"),
        ({"pgzip_block_size": 0}, ValueError, "pgzip_block_size must be at least 1"),
        ({"pgzip_threads": -1}, ValueError, "pgzip_threads must be at least 0"),
        ({"pgzip_threads": 2.0}, TypeError, "pgzip_threads must be an int"),
    ],
)
def test_store_refuses_bad_sizes_before_creating_anything(
    tmp_path: Path, kwargs: Dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        SHA1_Store(tmp_path / "store", init=True, **kwargs)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("kwargs", [{"sha1_buf_size": 1}, {"sha1_buf_size": 7, "pgzip_threads": 0}, {}])
def test_store_keys_are_the_sha1_of_the_pickled_object_for_any_read_size_it_takes(
    tmp_path: Path, kwargs: Dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="sha1_buf_size"):  # 0 hashed every object as b""
        SHA1_Store(tmp_path / "store", init=True, **{**kwargs, "sha1_buf_size": 0})
    store = SHA1_Store(tmp_path / "store", init=True, **kwargs)
    objects = [torch.ones(3), torch.zeros(5), {"w": torch.arange(4.0)}]
    keys = [store.add(obj) for obj in objects]
    assert keys == [hashlib.sha1(pickle.dumps(_to_np(obj))).hexdigest() for obj in objects]
    assert len(set(keys)) == 3
    for key, obj in zip(keys, objects):
        got = store.get(key)
        assert torch.equal(got["w"], obj["w"]) if isinstance(obj, dict) else torch.equal(got, obj)


# ------------------------------------------------------------------------------------- SignalSparsity arguments


@pytest.mark.parametrize(
    "kwargs, call",
    [
        ({"sst_top_k_dim": 2, "sst_top_k_percent": 50}, "dense_to_sst"),
        ({"sst_top_k_dim": -3, "sst_top_k_percent": 50}, "lossy_compress"),
        ({"dst_top_k_dim": -3, "dst_top_k_element": 1}, "lossy_compress"),
        ({"dst_top_k_dim": 2, "dst_top_k_element": 1}, "dense_sst_to_dst"),
        # The SST's inverse transform runs along sst_top_k_dim even when SST is off.
        ({"sst_top_k_dim": 5, "dst_top_k_element": 1}, "dense_sst_to_dst"),
    ],
)
def test_sparsity_names_a_dim_the_tensor_does_not_have(kwargs: Dict[str, Any], call: str) -> None:
    dense = torch.randn(4, 6)
    sparsity = SignalSparsity(**kwargs)
    name = next(key for key in kwargs if key.endswith("_dim"))
    with pytest.raises(ValueError, match=rf"{name}={kwargs[name]} is out of range for a tensor of 2 dimension"):
        if call == "dense_sst_to_dst":
            sparsity.dense_sst_to_dst(dense, None)
        else:
            getattr(sparsity, call)(dense)


def test_sparsity_names_an_sst_dim_the_sst_does_not_have() -> None:
    sparsity = SignalSparsity(sst_top_k_dim=1, sst_top_k_element=2)
    with pytest.raises(ValueError, match=r"sst_top_k_dim=1 is out of range for a tensor of 1 dimension"):
        sparsity.sst_dst_to_dense(torch.ones(4, dtype=torch.complex64))


@pytest.mark.parametrize("name", ["sst_top_k_dim", "dst_top_k_dim"])
@pytest.mark.parametrize("dim", [1.0, "1", True])
def test_sparsity_refuses_a_dim_that_is_not_an_int(name: str, dim: Any) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be an int or None, got {dim!r}"):
        SignalSparsity(**{name: dim, "sst_top_k_percent": 50})


@pytest.mark.parametrize("algo", [0, 1, "FFT", None])
def test_sparsity_refuses_an_algo_that_is_not_an_algo(algo: Any) -> None:
    """FFT's own value 0, or "FFT", selected DCT and failed later with "DCT has not been implemented"."""
    with pytest.raises(TypeError, match=rf"algo must be an Algo .*got {algo!r}"):
        SignalSparsity(algo=algo, sst_top_k_percent=50)


def test_valid_dims_and_algo_give_the_same_results_and_others_are_refused() -> None:
    with pytest.raises(ValueError, match="dst_top_k_dim=-3"):
        SignalSparsity(dst_top_k_dim=-3, dst_top_k_element=1).dense_sst_to_dst(torch.randn(4, 6), None)
    torch.manual_seed(0)
    dense = torch.randn(4, 6)
    negative = SignalSparsity(Algo.FFT, sst_top_k_dim=-1, sst_top_k_element=2, dst_top_k_dim=-2, dst_top_k_element=1)
    positive = SignalSparsity(Algo.FFT, sst_top_k_dim=1, sst_top_k_element=2, dst_top_k_dim=0, dst_top_k_element=1)
    for got, want in zip(negative.lossy_compress(dense), positive.lossy_compress(dense)):
        assert got is not None and want is not None and torch.equal(got, want)
    sst = positive.dense_to_sst(dense)
    reference = torch.fft.fft(dense, dim=1)
    kept = sst != 0
    assert torch.equal(sst[kept], reference[kept]) and int(kept.sum()) == 8  # 2 per row
    with pytest.raises(NotImplementedError, match="DCT"):  # still accepted, fails when used (upstream's behaviour)
        SignalSparsity(Algo.DCT, sst_top_k_percent=50).dense_to_sst(dense)


def test_random_sparse_mask_checks_its_dim() -> None:
    dense = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"dim=2 is out of range for a tensor of 2 dimension\(s\) \(shape \(4, 6\)\)"):
        random_sparse_mask(dense, 50, 2)
    with pytest.raises(TypeError, match="dim must be an int, got None"):
        random_sparse_mask(dense, 50, None)  # type: ignore[arg-type]
    mask = random_sparse_mask(dense, 50, -2)
    assert torch.equal(mask.sum(dim=0), torch.full((6,), 2.0))
