# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SHA1_Store (no optional package needed: stdlib gzip stands in for pgzip): dedup and reference counts, sizes,
names, compression, get/delete and their errors, the plain-pickle rejection, and the first add's format winning."""

import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.wgit.sha1_store import SHA1_Store

pytest.importorskip("numpy")


def _ref_counts(store: SHA1_Store) -> list:
    store._load_json_dict()
    return sorted(v["ref_count"] for k, v in store._json_dict.items() if isinstance(v, dict))


@pytest.mark.parametrize("compress", [True, False])
def test_add_get_delete(tmp_path: Path, compress: bool) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    module = nn.Linear(100, 100, bias=False)
    nn.init.zeros_(module.weight)
    ckpt = tmp_path / "ckpt.pt"
    torch.save(module.state_dict(), ckpt)
    key = store.add(ckpt, compress=compress)
    assert store.add(ckpt, compress=compress) == key
    tensor_key = store.add(torch.Tensor([1.0, 5.5, 3.4]).repeat(100), compress=compress, name="name1")
    store.add(torch.Tensor([1.0, 5.5, 3.4]).repeat(100), compress=compress, name="name2")
    assert _ref_counts(store) == [2, 2]
    assert store.names(tensor_key) == {"name1": 1, "name2": 1}
    original, deduped, compressed = store.size_info(tensor_key)
    assert original == 2 * deduped
    got = store.get(key)
    assert torch.equal(got["weight"], torch.zeros(100, 100))
    torch.testing.assert_close(store.get(tensor_key), torch.Tensor([1.0, 5.5, 3.4]).repeat(100))
    store.delete(key)
    store.delete(key)
    with pytest.raises(ValueError, match="not found"):
        store.get(key)
    with pytest.raises(ValueError, match="not found"):
        store.delete(key)
    with pytest.raises(ValueError, match="not found"):
        store.size_info(key)
    # A new store object on the same directory sees the same content.
    assert SHA1_Store(tmp_path / "store").names(tensor_key) == {"name1": 1, "name2": 1}


def test_compression_and_format_of_first_add(tmp_path: Path) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.ones(300, 500), compress=True)
    original, deduped, compressed = store.size_info(key)
    assert compressed < original
    store.add(torch.ones(300, 500), compress=False)  # upstream then recorded "uncompressed" and misread the file
    assert torch.equal(store.get(key), torch.ones(300, 500))
    assert store.size_info() == (2 * original, deduped, compressed)


def test_plain_pickle_is_rejected(tmp_path: Path) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    path = tmp_path / "plain.pkl"
    with open(path, "wb") as f:
        pickle.dump({"a": 1}, f)
    with pytest.raises(AssertionError, match="incorrect input"):
        store.add(path)
    with pytest.raises(AssertionError):
        SHA1_Store(tmp_path / "missing")


def test_readonly_json_ctx_gives_the_reference_counts(tmp_path: Path) -> None:
    """Upstream's private reading context (its tests use it): the counts as stored on disk."""
    store = SHA1_Store(tmp_path / "store", init=True)
    sha1 = store.add(torch.ones(3, 4))
    store.add(torch.ones(3, 4))
    other = SHA1_Store(tmp_path / "store")  # another handle, read after the writes
    with other._readonly_json_ctx:
        entry = other._json_dict[sha1]
    assert entry["ref_count"] == 2, entry
