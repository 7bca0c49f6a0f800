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
from typing import Any, List, Tuple

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
    def __init__(self, f: io.BytesIO, numel: int, key: Any, kind: Any) -> None:
        super().__init__(f, protocol=2)
        self.numel, self.key, self.kind = numel, key, kind

    def persistent_id(self, obj: Any) -> Any:
        return ("storage", self.kind, self.key, "cpu", self.numel, None) if isinstance(obj, _Storage) else None


def _legacy_checkpoint(
    path: Path, declared: int, key: Any = "k0", keys: Any = None, viewed: int = 4, kind: Any = torch.FloatStorage
) -> Path:
    """A legacy (non-zip) checkpoint of one tensor of ``viewed`` floats whose storage (of type ``kind``) declares
    ``declared`` elements, under ``key``, followed by the list ``keys`` of storage keys (``[key]`` by default)."""
    f = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(header, f, protocol=2)
    _LegacyPickler(f, declared, key, kind).dump({"w": _Tensor(_Storage(), viewed)})
    f.write(pickle.dumps([key] if keys is None else keys, protocol=2) if not isinstance(keys, bytes) else keys)
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
        "tensors": [torch.ones(3, dtype=torch.bfloat16), torch.arange(10.0)[2:5]],
        "param": torch.nn.Parameter(torch.ones(2)),
        "wide": torch.ones(5, dtype=torch.complex128),
    }
    path = tmp_path / "ck.pt"
    torch.save(checkpoint, path, _use_new_zipfile_serialization=zip_format)
    loaded = _load_in_thread(path)
    expected = torch.load(path, weights_only=True)
    assert not isinstance(loaded, Exception), loaded
    assert repr(loaded) == repr(expected)


def _in_subprocess(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter (a hang fails the test; a crash too, instead of killing pytest)."""
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} did not return within 120 s")
    assert done.returncode == 0, done  # a segfault is -11
    return done.stdout


# {((...(0,)...),): 1}: a key 300,000 tuples deep (Python hashes tuples recursively in C: a segfault).
_DEEP_KEY = b"\x80\x02}(K\x00" + b"\x85" * 300_000 + b"K\x01u."


def test_keys_nested_deeper_than_python_can_hash_are_refused(tmp_path: Path) -> None:
    _refused_in_subprocess(_zip_checkpoint(tmp_path / "deep.pt", _DEEP_KEY), "nest more than 100 deep")
    # The same key in a store object: wgit's own unpickler hashed it too.
    (tmp_path / "deep.pkl").write_bytes(_DEEP_KEY)
    code = (
        "import sys\nfrom fairscale.experimental.wgit.store_pickle import load_store_object\n"
        "try:\n    load_store_object(open(sys.argv[1], 'rb'), 'object', limit=10**7)\n"
        "except ValueError as e:\n    print(e)\n"
    )
    assert "nest more than 100 deep" in _in_subprocess(code, str(tmp_path / "deep.pkl"))


def test_what_torch_would_run_otherwise_is_refused(tmp_path: Path) -> None:
    """Bypasses of the first scan (a review): each hung, crashed or took gigabytes inside torch's loader."""
    # Python 2 names, which torch maps (__builtin__.set is builtins.set): set([tower]) hashed forever.
    alias = b"\x80\x02c__builtin__\nset\n](" + _TOWER + b"e\x85R."
    _refused_in_subprocess(_zip_checkpoint(tmp_path / "alias.pt", alias), "take more than")
    # _rebuild_from_type_v2(bytearray, ...) ran bytearray(n) unchecked: 1.5 GB from 1 KB.
    from_type = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(c__builtin__\nbytearray\nctorch\nTensor\n"
    from_type += b"J\x00\x00\x10\x00\x85}tR."
    _refused(_zip_checkpoint(tmp_path / "from_type.pt", from_type), "_rebuild_from_type_v2 with arguments")
    # A device tensor copied from one memoized CPU tensor, again and again.
    device = b"\x80\x02ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\n(K\x00K\x00K\x00K\x00tR."
    _refused(_zip_checkpoint(tmp_path / "device.pt", device), "_rebuild_device_tensor_from_cpu_tensor, which")
    # _codecs.encode in a quadratic codec (punycode): the scan itself took 40 s.
    codec = b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x08\x00\x00\x00punycode\x86R."
    _refused(_zip_checkpoint(tmp_path / "codec.pt", codec), "_codecs.encode(str, 'latin1') only")
    # torch finds <archive>/data.pkl whatever its case: an upper-case one beside another data.pkl.
    with zipfile.ZipFile(tmp_path / "case.pt", "w") as z:
        z.writestr("archive/DATA.PKL", b"\x80\x02}.")
        z.writestr("archive/x/data.pkl", b"\x80\x02}.")
    _refused(tmp_path / "case.pt", "without the one <archive>/data.pkl")
    # Legacy pickles (a hash bomb) followed by a zip: torch reads the pickles, zipfile finds the zip.
    torch.save({"w": torch.ones(1)}, tmp_path / "real.pt")
    polyglot = b"\x80\x02}q\x00(" + _TOWER + b"K\x01u." + (tmp_path / "real.pt").read_bytes()
    (tmp_path / "polyglot.pt").write_bytes(polyglot)
    _refused_in_subprocess(tmp_path / "polyglot.pt", "take more than")


def test_legacy_keys_and_views_are_checked(tmp_path: Path) -> None:
    # The fifth pickle, the list of storage keys: torch looks each up (a tower key hashed forever).
    keys = b"\x80\x02](" + _TOWER + b"e."
    _refused_in_subprocess(_legacy_checkpoint(tmp_path / "keys.pt", 4, keys=keys), "list of storage keys")
    _refused(_legacy_checkpoint(tmp_path / "key.pt", 4, key=("k", 0)), "refers to a storage as a tuple")
    # A view of 10**7 floats over a storage of one: torch's legacy loader grew the storage to the view's size.
    _refused(_legacy_checkpoint(tmp_path / "grown.pt", 1, viewed=10**7), "its tensors would take more than")
    # A broadcast view torch.save writes (64 MB over one float in a file of 1 KB): wgit would copy it whole.
    torch.save(torch.zeros(1).expand(2**12, 2**12), tmp_path / "expanded.pt")
    _refused(tmp_path / "expanded.pt", "its tensors would take more than")


def test_checkpoints_of_many_sizes_and_tied_tensors_load(tmp_path: Path) -> None:
    shared = torch.randn(64, 64)
    checkpoint = {"shapes": [torch.Size([1] * 12) for _ in range(2000)], "a": shared, "b": shared, "c": shared[1:]}
    torch.save(checkpoint, tmp_path / "ck.pt")
    loaded = _load_in_thread(tmp_path / "ck.pt")
    assert not isinstance(loaded, Exception), loaded
    assert repr(loaded) == repr(torch.load(tmp_path / "ck.pt", weights_only=True))


def test_zips_two_readers_would_read_apart_are_refused(tmp_path: Path) -> None:
    """A second directory hidden in the end record's comment showed zipfile a harmless data.pkl and torch (miniz,
    which reads the directory at the offset recorded) another one: a hash bomb, or 2 GB allocated (a review)."""
    path = _zip_checkpoint(tmp_path / "comment.pt", pickle.dumps({"w": 1}, protocol=2))
    with zipfile.ZipFile(path, "a") as z:
        z.comment = b"PK\x01\x02 a directory could hide here"
    _refused(path, "carries a comment")
    path = _zip_checkpoint(tmp_path / "moved.pt", pickle.dumps({"w": 1}, protocol=2))
    data = bytearray(path.read_bytes())
    offset = struct.unpack_from("<L", data, len(data) - 6)[0]  # the end record's directory offset
    struct.pack_into("<L", data, len(data) - 6, offset - 1)  # zipfile shifts every entry by one; miniz does not
    path.write_bytes(bytes(data))
    _refused(path, "not where its end record says")
    torch.save({"w": torch.ones(2)}, tmp_path / "real.pt")  # torch's own zips (with zip64 records) pass
    assert torch.equal(_load_in_thread(tmp_path / "real.pt")["w"], torch.ones(2))


def test_tensor_attributes_that_shadow_its_methods_are_refused(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.detach = torch.Tensor  # type: ignore[method-assign]  # torch's loader would setattr it: wgit calls it
    torch.save({"p": param}, tmp_path / "shadow.pt")
    _refused(tmp_path / "shadow.pt", "it sets the attribute(s) ['detach'] of a tensor")
    kept = torch.nn.Parameter(torch.ones(3))
    kept.tag = "encoder"  # an attribute of its own: kept, as torch keeps it
    torch.save({"p": kept}, tmp_path / "tagged.pt")
    assert _load_in_thread(tmp_path / "tagged.pt")["p"].tag == "encoder"


def test_views_count_their_dtype(tmp_path: Path) -> None:
    # _rebuild_tensor_v3 (dtypes without a typed storage) names the dtype: a uint64 view was counted one byte per
    # element (eight times less).
    torch.save(torch.zeros(1, dtype=torch.uint64).expand(2**16), tmp_path / "small.pt")  # 512 KB: within the limit
    assert _load_in_thread(tmp_path / "small.pt").shape == (2**16,)
    torch.save(torch.zeros(1, dtype=torch.uint64).expand(2**18), tmp_path / "large.pt")  # 2 MB of a 1.5 KB file
    _refused(tmp_path / "large.pt", "its tensors would take more than")


def _rewritten(src: Path, dst: Path, change: Any) -> Path:
    """``src`` (a torch.save zip) rewritten entry by entry, ``change(info, data)`` giving each one's (info, data)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            new, data = change(zipfile.ZipInfo(info.filename), z.read(info))
            out.writestr(new, data)
    return dst


def _mark(name: str, **attrs: Any) -> Any:
    def change(info: zipfile.ZipInfo, data: bytes) -> Any:
        if info.filename.endswith(name):
            for key, value in attrs.items():
                setattr(info, key, value)
        return info, data

    return change


def test_entries_torch_reads_otherwise_than_zipfile_are_refused(tmp_path: Path) -> None:
    """miniz extracts nothing for an entry marked a directory (torch unpickled uninitialized memory), ignores the
    Unicode path extra field that zipfile (3.12+) renames entries by, and reads data/<key> for a storage (a review)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "real.pt")
    real = tmp_path / "real.pt"
    _refused(_rewritten(real, tmp_path / "dir.pt", _mark("data.pkl", external_attr=0x10)), "is a directory")
    unicode_path = struct.pack("<HHB", 0x7075, 5, 1) + b"\0\0\0\0"
    _refused(_rewritten(real, tmp_path / "extra.pt", _mark("data.pkl", extra=unicode_path)), "extra fields")

    def shorter(info: zipfile.ZipInfo, data: bytes) -> Any:
        return info, data[:8] if info.filename.endswith("data/0") else data

    _refused(_rewritten(real, tmp_path / "short.pt", shorter), "declares 16 bytes, with a record of 8 bytes")
    folder_key = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
    folder_key += (
        b"X\x02\x00\x00\x000/X\x03\x00\x00\x00cpuK\x04tQK\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR."
    )
    _refused(_zip_checkpoint(tmp_path / "folder.pt", folder_key), "it names a storage '0/'")
    torch.save({"w": torch.ones(2)}, tmp_path / "proto4.pt", pickle_protocol=4)  # torch's loader refuses it too
    _refused(
        tmp_path / "proto4.pt",
        "uses a pickle opcode torch's weights-only loader does not read (a pickle_protocol other",
    )


def test_legacy_files_torch_would_read_otherwise_are_refused(tmp_path: Path) -> None:
    """A fourth review: a storage left out of the key list kept uninitialized memory (wgit stored it), a storage
    type that is not a storage class was counted 1 byte per element, and a tar header made torch's loader parse it
    (quadratic in some Python releases: minutes for 400 KB)."""
    _refused(_legacy_checkpoint(tmp_path / "unlisted.pt", 4, keys=[]), "not the list of the storages its objects use")
    _refused(_legacy_checkpoint(tmp_path / "kind.pt", 4, kind=torch.nn.Parameter), "not a torch storage class")
    header = bytearray(512)
    header[0:14] = b"K\x01." * 4 + b"]."  # five tiny pickles in tar's name field: the legacy scan passed them
    header[100:136] = b"0000644\x000000000\x000000000\x00" + b"%011o\x00" % 2000
    header[136:148], header[156:157], header[257:265] = b"00000000000\x00", b"x", b"ustar\x0000"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\x00 " % sum(header)
    (tmp_path / "tar.pt").write_bytes(bytes(header) + b"1" * 2000 + b"\0" * 1584)
    _refused(tmp_path / "tar.pt", "it starts with a tar header")


def test_tensors_the_store_cannot_keep_are_refused_before_torch_rebuilds_them(tmp_path: Path) -> None:
    """A fifth review: torch's rebuilds of sparse and quantized tensors did costly work with the file's arguments (a
    layout hashed as a tuple tower: forever; quantizer scales as memoized lists: gigabytes), a BUILD on a storage
    swapped the storage torch filled (a tensor of uninitialized memory), and a view's dimensions cost memory
    however few its elements."""
    for name, tensor, hint in (
        ("sparse", torch.eye(3).to_sparse(), ".to_dense()"),
        ("quantized", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8), ".dequantize()"),
    ):
        torch.save({"t": tensor}, tmp_path / f"{name}.pt")
        _refused(tmp_path / f"{name}.pt", f"it holds a {name} tensor (save {hint}), which wgit's store cannot keep")
    tower = b"K\x00\x85q\x010" + b"h\x01h\x01\x86q\x010" * 40 + b"h\x01"  # built in the memo, then pushed alone
    layout = b"\x80\x02ctorch.serialization\n_get_layout\n" + tower + b"\x85R."  # _get_layout(tower): hashed
    _refused(_zip_checkpoint(tmp_path / "layout.pt", layout), "it holds a sparse tensor")
    built = b"\x80\x02ctorch\nFloatStorage\n}X\x01\x00\x00\x00aK\x01sb."  # BUILD on an opaque value
    _refused(_zip_checkpoint(tmp_path / "built.pt", built), "(pickle's BUILD), which torch.save never writes")
    torch.save(torch.zeros([1] * 64), tmp_path / "dims.pt")  # torch's own limit: fine
    assert _load_in_thread(tmp_path / "dims.pt").dim() == 64


class _View:
    def __init__(self, storage: _Storage, size: Tuple[int, ...], stride: Tuple[int, ...]) -> None:
        self.storage, self.size, self.stride = storage, size, stride

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, self.size, self.stride, False, {}))


class _OrderedDictOf:
    def __init__(self, items: Any) -> None:
        self.items = items

    def __reduce__(self) -> Any:
        return (collections.OrderedDict, (self.items,))


def test_views_outside_their_storage_and_repeated_containers_are_refused(tmp_path: Path) -> None:
    """A sixth review: a legacy storage declared with 0 elements and viewed again larger was handed out unregistered,
    grown and never filled (uninitialized memory stored), or grown to a gigabyte by one stride; a dict as an
    OrderedDict pair re-hashed its key at each use; a dict copied through the memo cost 35 s of counting."""
    for name, size, stride in (("empty", (64,), (1,)), ("stride", (2,), (2**28,))):
        f = io.BytesIO()
        for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(header, f, protocol=2)
        storage = _Storage()
        _LegacyPickler(f, 0, "0", torch.FloatStorage).dump(
            {"e": _View(storage, (0,), (1,)), "w": _View(storage, size, stride)}
        )
        f.write(pickle.dumps(["0"], protocol=2) + struct.pack("<q", 0))
        (tmp_path / f"{name}.pt").write_bytes(f.getvalue())
        _refused(tmp_path / f"{name}.pt", "with a view reaching element")
    pairs = b"\x80\x02ccollections\nOrderedDict\n](}(K\x01NK\x02Nue\x85R."  # OrderedDict([{1: None, 2: None}])
    _refused(_zip_checkpoint(tmp_path / "pairs.pt", pairs), "an OrderedDict of items that are not (key, value) pairs")
    keys = {i: None for i in range(2**14)}
    copies = pickle.dumps([_OrderedDictOf(keys) for _ in range(70)], protocol=2)  # 70 copies of 2**14 keys, 70 KB
    _refused_in_subprocess(_zip_checkpoint(tmp_path / "copies.pt", copies), "take more than 1000000 steps")
