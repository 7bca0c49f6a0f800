# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A checkpoint one adds is scanned before ``torch.load(weights_only=True)``: files of a few hundred bytes made
torch's loader hash a key forever (``wgit add`` never returned) or allocate gigabytes; now they are refused with
:class:`UntrustedContentError`, and every checkpoint torch.save writes still loads as torch loads it."""

import collections
import io
import pickle
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any, List

import pytest
import torch

from fairscale.experimental.wgit.checkpoint_load import load_checkpoint
from fairscale.experimental.wgit.safety import UntrustedContentError

# A tuple tower t = (t, t) on the stack, 40 levels through pickle's memo: hashing it visits 2**40 tuples.
_TOWER = b"K\x00\x85q\x01" + b"h\x01h\x01\x86q\x01" * 40


def _zip_checkpoint(path: Path, data_pkl: bytes, compression: int = zipfile.ZIP_STORED) -> Path:
    """A torch.save zip checkpoint whose data.pkl is ``data_pkl``."""
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        entries = {info.filename: z.read(info) for info in z.infolist()}
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in entries.items():
            z.writestr(name, data_pkl if name.endswith("data.pkl") else data)
    return path


def _load_into(path: Path, outcome: List[Any]) -> None:
    try:
        outcome.append(load_checkpoint(path))
    except Exception as e:  # noqa: B902  # the test looks at whatever it raised
        outcome.append(e)


def _load_in_thread(path: Path) -> Any:
    """load_checkpoint(path), failing the test instead of hanging it: the result, or the exception raised. (For
    files that may allocate; one that may hash forever needs :func:`_refused_in_subprocess`: a tuple's hash never
    releases the GIL, so no thread could time it out.)"""
    outcome: List[Any] = []
    thread = threading.Thread(target=_load_into, args=(path, outcome), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        pytest.fail(f"loading {path.name} did not return within 60 s")
    return outcome[0]


def _refused(path: Path, match: str) -> None:
    outcome = _load_in_thread(path)
    assert isinstance(outcome, UntrustedContentError), outcome
    assert str(outcome).startswith(f"incorrect input {path}: ") and match in str(outcome), outcome


def _refused_in_subprocess(path: Path, match: str) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from fairscale.experimental.wgit.checkpoint_load import load_checkpoint\n"
        "from fairscale.experimental.wgit.safety import UntrustedContentError\n"
        "try:\n    load_checkpoint(Path(sys.argv[1]))\nexcept UntrustedContentError as e:\n    print(e)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path.name} did not return within 120 s")
    assert done.returncode == 0 and done.stdout.startswith(f"incorrect input {path}: "), done
    assert match in done.stdout, done.stdout


def test_a_dict_key_that_hashes_forever_is_refused(tmp_path: Path) -> None:
    dict_key = b"\x80\x02}q\x00(" + _TOWER + b"K\x01u."  # {tower: 1}
    _refused_in_subprocess(_zip_checkpoint(tmp_path / "dict.pt", dict_key), "take more than")
    counter = b"\x80\x02ccollections\nCounter\n](" + _TOWER + b"e\x85R."  # Counter([tower])
    _refused_in_subprocess(_zip_checkpoint(tmp_path / "counter.pt", counter), "take more than")


def test_wgit_add_of_such_a_file_fails_in_one_line(tmp_path: Path) -> None:
    _zip_checkpoint(tmp_path / "bomb.pt", b"\x80\x02}q\x00(" + _TOWER + b"K\x01u.")
    wgit = [sys.executable, "-m", "fairscale.experimental.wgit"]
    subprocess.run([*wgit, "init"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    try:
        done = subprocess.run([*wgit, "add", "bomb.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("wgit add of the file did not return within 120 s")
    assert done.returncode == 1 and done.stderr.startswith("fatal: incorrect input bomb.pt: "), done
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_calls_that_allocate_what_the_file_asks_are_refused(tmp_path: Path) -> None:
    # torch.FloatTensor(2**20): torch's loader made a 4 MB tensor (4 GB for 2**30) from a 40-byte pickle.
    constructor = b"\x80\x02ctorch\nFloatTensor\nJ\x00\x00\x10\x00\x85R."
    _refused(_zip_checkpoint(tmp_path / "ctor.pt", constructor), "it calls torch.FloatTensor")
    rebuild = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(ctorch\nFloatTensor\nctorch\nTensor\nJ\x00\x00\x10\x00"
    rebuild += b"\x85}tR."  # _rebuild_from_type_v2(torch.FloatTensor, torch.Tensor, (2**20,), {})
    _refused(_zip_checkpoint(tmp_path / "rebuild.pt", rebuild), "it calls torch.FloatTensor")
    # bytes repeated through the memo: _codecs.encode(<the same 10,000 characters>, "latin1") a thousand times.
    encode = b"\x80\x02c_codecs\nencode\nq\x00X\x10\x27\x00\x00" + b"a" * 10000 + b"q\x01X\x06\x00\x00\x00latin1q\x02]("
    encode += b"h\x00h\x01h\x02\x86R" * 1000 + b"e."
    _refused(_zip_checkpoint(tmp_path / "encode.pt", encode), "more than")
    packed = _zip_checkpoint(tmp_path / "packed.pt", pickle.dumps({"w": 1}, protocol=2), zipfile.ZIP_DEFLATED)
    _refused(packed, "is compressed; torch.save stores its entries uncompressed")


class _Storage:
    """Stands for a storage in a legacy checkpoint written by hand (pickled as a persistent id)."""


class _Tensor:
    def __init__(self, storage: _Storage, numel: int) -> None:
        self.storage, self.numel = storage, numel

    def __reduce__(self) -> Any:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, (self.numel,), (1,), False, collections.OrderedDict()),
        )


class _LegacyPickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, numel: int) -> None:
        super().__init__(f, protocol=2)
        self.numel = numel

    def persistent_id(self, obj: Any) -> Any:
        return ("storage", torch.FloatStorage, "k0", "cpu", self.numel, None) if isinstance(obj, _Storage) else None


def _legacy_checkpoint(path: Path, declared: int) -> Path:
    """A legacy (non-zip) checkpoint of one tensor of 4 floats whose storage declares ``declared`` elements."""
    f = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(header, f, protocol=2)
    _LegacyPickler(f, declared).dump({"w": _Tensor(_Storage(), 4)})
    pickle.dump(["k0"], f, protocol=2)
    f.write(struct.pack("<q", 4) + struct.pack("<4f", 1, 2, 3, 4))
    path.write_bytes(f.getvalue())
    return path


def test_a_legacy_storage_larger_than_the_file_is_refused(tmp_path: Path) -> None:
    good = _legacy_checkpoint(tmp_path / "good.pt", 4)
    assert torch.equal(_load_in_thread(good)["w"], torch.tensor([1.0, 2, 3, 4]))  # the file is a real checkpoint
    # torch's legacy loader allocates the declared storage before reading it (40 MB here; any size the file names).
    _refused(_legacy_checkpoint(tmp_path / "big.pt", 10**7), "its storages would take more than")


@pytest.mark.parametrize("zip_format", [True, False])
def test_what_torch_save_writes_loads_as_torch_loads_it(tmp_path: Path, zip_format: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    checkpoint = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "extras": [{1, 2}, 1 + 2j, b"ab", bytearray(b"c"), torch.Size([2, 3]), torch.device("cpu")],
        "counts": collections.Counter("aab"),
        "keys": {(1, (2, 3)): "t", 10**30: "big"},
        "tensors": [torch.ones(3, dtype=torch.bfloat16), torch.eye(3).to_sparse(), torch.arange(10.0)[2:5]],
        "param": torch.nn.Parameter(torch.ones(2)),
        "wide": torch.ones(5, dtype=torch.complex128),
    }
    path = tmp_path / "ck.pt"
    torch.save(checkpoint, path, _use_new_zipfile_serialization=zip_format)
    loaded = _load_in_thread(path)
    expected = torch.load(path, weights_only=True)
    assert not isinstance(loaded, Exception), loaded
    assert repr(loaded) == repr(expected)
