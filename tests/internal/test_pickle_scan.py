# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``fairscale.internal.pickle_scan.load_torch_file``: a ``torch.save`` file scanned, then loaded weights-only.

What the consolidate tool's per-rank files and DCP's saved objects hold loads as ``torch.load`` loads it; a file whose
pickle would make torch's weights-only loader hash ``2**depth`` tuples (a tuple shared at every level as a dict key,
about 1 KB) is refused at once, and so are the other crafted files below (no mocks: real ``torch.save`` files, and
pickles written byte by byte as a hostile file would be). A hash of a tuple never releases the GIL, so the bomb is
loaded in a subprocess with a timeout: a hang fails the test instead of hanging it.
"""

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _pickle_bombs import hash_bomb, with_data_pkl

from fairscale.internal.errors import FairscaleValueError
from fairscale.internal.pickle_scan import (
    FileWindow,
    PickleScanError,
    UnreadableFileError,
    load_torch_file,
    scan_torch_save,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or a != a)  # NaN equals itself here


def _plain_data() -> Any:
    """What per-rank FSDP files (local_state_dict + local_metadata_dict) and DCP's saved objects hold."""
    flat = torch.arange(12.0)
    return {
        "weights": {
            "flat_param_0": flat[:10],  # a view sharing its storage with the next entry
            "flat_param_1": flat[10:],
            "scalar": torch.tensor(3.5),  # 0-dim
            "count": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
            "half": torch.ones(3, dtype=torch.float16),
            "bf16": torch.randn(2, 3).to(torch.bfloat16),
            "mask": torch.tensor([True, False]),
            "transposed": torch.randn(3, 2).t(),
        },
        "meta": {
            "param_metadata": [
                {
                    "fsdp_path": "layers.0",
                    "params": {
                        "flat_param_0": {
                            "names": ["weight", "bias"],
                            "shapes": [torch.Size([2, 4]), torch.Size([2])],
                            "numels": [8, 2],
                            "padding": 0,
                        }
                    },
                    "no_broadcast_optim_state": False,
                }
            ],
            "buffer_names": [],
        },
        "param_groups": [
            {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [0, 1]},
            {"lr": float("nan"), "foreach": None, "maximize": False, "params": ["a.weight", "a.bias"]},
        ],
        "step": 12,
        "name": "run-3",
        "nothing": None,
        "big": 2**70,
        "negative": -5,
        "device": torch.device("cpu"),
    }


@pytest.mark.parametrize("zip_format", [True, False])
def test_plain_files_load_as_torch_loads_them(tmp_path: Path, zip_format: bool) -> None:
    path = tmp_path / "ckpt-rank-0.pt"
    torch.save(_plain_data(), path, _use_new_zipfile_serialization=zip_format)
    expected = torch.load(path, weights_only=True)
    loaded = load_torch_file(path)
    assert _same(loaded, expected), (loaded, expected)
    assert loaded["weights"]["flat_param_1"].untyped_storage().data_ptr() == (
        loaded["weights"]["flat_param_0"].untyped_storage().data_ptr()
    )  # the views still share their storage
    # A file object from its start (DCP's saved objects come as io.BytesIO), and a str path.
    assert _same(load_torch_file(io.BytesIO(path.read_bytes()), "an object"), expected)
    assert _same(load_torch_file(str(path)), expected)


def test_a_hash_bomb_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bomb.pt"
    path.write_bytes(hash_bomb(60))  # about 1.2 KB; torch.load(weights_only=True) would hash 2**60 tuples
    script = tmp_path / "load.py"
    script.write_text(
        "import sys\n"
        "from fairscale.internal.pickle_scan import PickleScanError, load_torch_file\n"
        "try:\n    load_torch_file(sys.argv[1], 'the bomb')\n"
        "except PickleScanError as e:\n    print('refused', type(e).__name__, e.reason)\n"
    )
    process = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        stdout, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("loading a 1 KB hash bomb did not return within 120 s")
    assert process.returncode == 0, stdout
    _, kind, reason = stdout.split(" ", 2)
    assert kind == "PickleScanError", stdout  # the 120 s timeout is the hang guard (no timing is asserted)
    assert "take more than" in reason and "steps to hash" in reason, reason
    # The same file as an object in memory: refused in-process too, named as the caller names it.
    with pytest.raises(PickleScanError, match="^refusing the saved object 'lr': its dict keys") as info:
        load_torch_file(io.BytesIO(path.read_bytes()), "the saved object 'lr'")
    assert isinstance(info.value, FairscaleValueError) and isinstance(info.value, AssertionError)
    assert info.value.what == "the saved object 'lr'" and info.value.reason.startswith("its dict keys")


def test_small_shared_keys_are_accepted(tmp_path: Path) -> None:
    """A shared tuple key is fine while its hashing is small (16 tuples): only the cost is refused."""
    key: Any = ()
    for _ in range(4):
        key = (key, key)
    assert load_torch_file(io.BytesIO(hash_bomb(4))) == {key: 1}


def test_what_torch_save_never_writes_is_refused(tmp_path: Path) -> None:
    constructor = with_data_pkl(b"\x80\x02ctorch\nFloatTensor\nJ\x00\x00\x00\x40\x85R.")  # FloatTensor(2**30): 4 GB
    with pytest.raises(PickleScanError, match="it calls torch.FloatTensor, which torch.save does not write"):
        load_torch_file(io.BytesIO(constructor))
    code = with_data_pkl(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.")  # os.system("true")
    with pytest.raises(PickleScanError, match="it calls os.system, which torch.save does not write"):
        load_torch_file(io.BytesIO(code))
    torch.save({"t": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(PickleScanError, match="a sparse tensor .* which fairscale does not load"):
        load_torch_file(tmp_path / "sparse.pt")
    deep: Any = []
    for _ in range(150):
        deep = [deep]
    torch.save(deep, tmp_path / "deep.pt")
    with pytest.raises(PickleScanError, match="nests containers more than 100 deep .fairscale handles"):
        load_torch_file(tmp_path / "deep.pt")


def test_unreadable_files_and_special_files_are_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "good.pt")
    good = (tmp_path / "good.pt").read_bytes()
    for name, data in (("cut.pt", good[: len(good) // 2]), ("garbage.pt", b"not a checkpoint " * 8)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnreadableFileError, match=f"{name} is truncated or corrupt, or not a torch.save file"):
            load_torch_file(tmp_path / name)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.pt")  # reading it would block until someone writes
        with pytest.raises(PickleScanError, match="it is a named pipe .FIFO., not a regular file"):
            load_torch_file(tmp_path / "pipe.pt")
    with pytest.raises(FileNotFoundError):
        load_torch_file(tmp_path / "missing.pt")


def test_a_file_window_seeks_from_its_own_end() -> None:
    """An entry inside a larger file, scanned through a window: zipfile seeks from the end (torch's own view of an
    entry added a negative offset's size, and every DCP entry read as unreadable)."""
    entry = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, entry)
    blob = b"x" * 100 + entry.getvalue() + b"y" * 50
    window = FileWindow(io.BytesIO(blob), 100, len(entry.getvalue()))
    assert window.seek(-4, os.SEEK_END) == len(entry.getvalue()) - 4
    assert window.read() == entry.getvalue()[-4:] and window.read() == b""
    scan_torch_save(window, len(entry.getvalue()))  # accepted
    window.seek(0)
    assert torch.equal(torch.load(window, weights_only=True)["w"], torch.arange(3.0))


def test_a_file_saved_without_crc_checksums_loads() -> None:
    """torch.save writes CRC 0 when told not to compute checksums, and torch's reader checks none: zipfile's check made
    the scan refuse such files (every DCP entry of a checkpoint saved so; a review, session 50)."""
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is None:  # torch without the option: every file has its checksums
        return
    buffer = io.BytesIO()
    setter(False)
    try:
        torch.save({"w": torch.arange(4.0)}, buffer)
    finally:
        setter(True)
    assert torch.equal(load_torch_file(io.BytesIO(buffer.getvalue()))["w"], torch.arange(4.0))


def test_map_location_is_torch_loads() -> None:
    """DCP's saved objects load on the device they were saved from (``map_location=None``), as DCP's planner loads
    them; the consolidate tool's on the CPU (the default)."""
    buffer = io.BytesIO()
    torch.save({"lr": torch.tensor(0.5)}, buffer)
    assert load_torch_file(io.BytesIO(buffer.getvalue()))["lr"].device.type == "cpu"
    assert load_torch_file(io.BytesIO(buffer.getvalue()), map_location=None)["lr"].device.type == "cpu"
    assert load_torch_file(io.BytesIO(buffer.getvalue()), map_location="meta")["lr"].device.type == "meta"
