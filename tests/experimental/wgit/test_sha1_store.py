# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SHA1_Store (no optional package needed: stdlib gzip stands in for pgzip): dedup and reference counts, sizes,
names, compression, get/delete and their errors, the plain-pickle rejection, the first add's format winning, and
the refusal of a store changed behind its back (an object that does not hash to its key, damaged metadata)."""

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.wgit.safety import CorruptStoreError, UntrustedContentError, WgitSafetyError
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


def _object_file(store_dir: Path, key: str) -> Path:
    return store_dir / key[:2] / key[2:4] / key


@pytest.mark.parametrize("compress", [True, False])
def test_get_refuses_an_object_that_does_not_hash_to_its_key(tmp_path: Path, compress: bool) -> None:
    """Another array's valid object file in place of this one's: only its hash tells them apart."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.arange(4.0), compress=compress)
    other = store.add(torch.full((4,), 666.0), compress=compress)
    original = _object_file(tmp_path / "store", key).read_bytes()
    _object_file(tmp_path / "store", key).write_bytes(_object_file(tmp_path / "store", other).read_bytes())
    with pytest.raises(CorruptStoreError, match=f"object {key} .* is corrupted: its content hashes to {other}"):
        store.get(key)
    if not compress:  # bytes after the pickle's end are not the stored object either
        _object_file(tmp_path / "store", key).write_bytes(original + b"\0")
        with pytest.raises(CorruptStoreError, match="corrupted"):
            store.get(key)
    assert torch.equal(store.get(other), torch.full((4,), 666.0))


@pytest.mark.parametrize("compress", [True, False])
def test_changes_caught_before_the_hash_are_untrusted_content(tmp_path: Path, compress: bool) -> None:
    """As docs/experimental.rst says: a larger array's object in place of this one's declares more data than the
    file can hold, and a damaged compressed stream fails gzip's CRC, before the hash is known; both raise
    UntrustedContentError, a WgitSafetyError like CorruptStoreError."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.randn(4), compress=compress)
    larger = store.add(torch.randn(5), compress=compress)
    path = _object_file(tmp_path / "store", key)
    original = path.read_bytes()
    path.write_bytes(_object_file(tmp_path / "store", larger).read_bytes())
    with pytest.raises(UntrustedContentError) as info:
        store.get(key)
    assert isinstance(info.value, WgitSafetyError)
    if compress:
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x10
        path.write_bytes(bytes(flipped))
        with pytest.raises(WgitSafetyError):
            store.get(key)


_BAD_ENTRIES = [
    ({"KEY": 5}, "the entry 'KEY' is 5, not an object"),
    ({"KEY": [1, 2]}, "the entry 'KEY' is [1, 2], not an object"),
    ({"KEY": {"ref_count": "x"}}, "the entry 'KEY' has ref_count 'x', not a non-negative integer"),
    ({"KEY": {"original_size": -3}}, "the entry 'KEY' has original_size -3, not a non-negative integer"),
    ({"KEY": {"compressed": "yes"}}, "the entry 'KEY' has compressed 'yes', not true or false"),
    ({"KEY": {"names": {"w": "x"}}}, "the entry 'KEY' has names {'w': 'x'}, not an object of counts"),
    ({"deduped_size": None}, "the store total 'deduped_size' is None, not a non-negative integer"),
]


@pytest.mark.parametrize("patch, message", _BAD_ENTRIES)
def test_damaged_metadata_entries_are_named_on_every_read(tmp_path: Path, patch: dict, message: str) -> None:
    """The file changes after the store was opened: each method reads it again and names the bad entry."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.arange(4.0))
    metadata_file = tmp_path / "store" / "metadata.json"
    metadata = json.loads(metadata_file.read_text())
    metadata.update(json.loads(json.dumps(patch).replace("KEY", key)))
    metadata_file.write_text(json.dumps(metadata))
    expected = f"{metadata_file} is not SHA1 store metadata as wgit writes it: {message.replace('KEY', key)}"
    calls = [lambda: store.get(key), lambda: store.delete(key), lambda: store.add(torch.ones(2))]
    calls += [lambda: store.size_info(key), lambda: store.names(key), lambda: SHA1_Store(tmp_path / "store")]
    for call in calls:
        with pytest.raises(CorruptStoreError, match=re.escape(expected)):
            call()
    with pytest.raises(AssertionError):  # as the store's other refusals of bad metadata
        store.size_info()


@pytest.mark.parametrize(
    "text, message",
    [("[1, 2]", "it holds a JSON list"), ("[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)")],
)
def test_metadata_that_is_not_a_store_header(tmp_path: Path, text: str, message: str) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    (tmp_path / "store" / "metadata.json").write_text(text)
    with pytest.raises(CorruptStoreError, match=re.escape(message)):
        store.size_info()
