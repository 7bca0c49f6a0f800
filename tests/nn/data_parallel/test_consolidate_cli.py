# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The consolidate command line on files it cannot use: one ``error: <file>: <problem>`` line, a non-zero exit
status, no traceback, and never a line of code run from a file (it loads with ``torch.load(weights_only=True)``).

Each case is a directory of per-rank files (or a file given to ``reshard``) that is empty, truncated, garbage,
hostile (a pickle whose ``__reduce__`` would create a marker directory) or of the wrong layout.
"""

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel.consolidate import find_rank_files, main

REPO_ROOT = Path(__file__).resolve().parents[3]


class _Payload:
    """Unpickling it would create ``marker`` (what a hostile checkpoint's code could do instead)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[str]]:
        return (os.makedirs, (self.marker,))


def _torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_cases(root: Path, marker: str) -> Dict[str, Path]:
    """name -> the rank-0 file of a one-rank checkpoint directory of that case."""
    files: Dict[str, Path] = {}

    def put(name: str, data: bytes) -> None:
        directory = root / name
        directory.mkdir()
        path = directory / "ckpt-rank-0.pt"
        path.write_bytes(data)
        files[name] = path

    good = _torch_save_bytes({"weights": {"w": torch.ones(4)}, "meta": {}})
    put("empty", b"")
    put("truncated", good[: len(good) // 2])
    put("garbage", b"not a checkpoint at all " * 8)
    put("hostile_torch_save", _torch_save_bytes({"weights": _Payload(marker), "meta": {}}))
    put("hostile_plain_pickle", pickle.dumps({"weights": _Payload(marker), "meta": {}}))
    put("not_a_dict", _torch_save_bytes([torch.ones(2)]))
    put("weights_not_a_dict", _torch_save_bytes({"weights": 5, "meta": {}}))
    put("meta_wrong_layout", _torch_save_bytes({"weights": {"w": torch.ones(2)}, "meta": {"param_metadata": 5}}))
    return files


def _layouts_body(rank: int, world_size: int, directory: str) -> None:
    from _models import ModelWithBatchNorm, NestedWrappedModule, TransformerWithSharedParams, build, wrap_model

    cases = [
        (NestedWrappedModule, "nested", {}),
        (NestedWrappedModule, "leaf", {"flatten_parameters": False}),
        (TransformerWithSharedParams, "nested", {}),
        (ModelWithBatchNorm, "nested", {"mixed_precision": True}),
    ]
    for i, (model_cls, mode, kwargs) in enumerate(cases):
        fsdp = wrap_model(build(model_cls)[0], kwargs, mode)
        ckpt = {"weights": fsdp.local_state_dict(), "meta": fsdp.local_metadata_dict()}
        os.makedirs(os.path.join(directory, str(i)), exist_ok=True)
        torch.save(ckpt, os.path.join(directory, str(i), f"ckpt-rank-{rank}.pt"))


def _one_error_line(err: str, path: Path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"error: {path}: "), lines[0]
    assert "Traceback" not in err
    return lines[0][len(f"error: {path}: ") :]


def test_unusable_rank_files_give_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = str(tmp_path / "PAYLOAD_RAN")
    problems: Dict[str, str] = {}
    for name, path in _write_cases(tmp_path, marker).items():
        out = tmp_path / f"{name}-full.pt"
        assert main(["consolidate", str(path.parent), str(out)]) != 0, name
        problems[name] = _one_error_line(capsys.readouterr().err, path)
        assert not out.exists(), name
    assert not os.path.exists(marker), "a checkpoint's pickled code ran"
    assert "empty" in problems["empty"]
    assert "truncated or corrupt" in problems["truncated"]
    assert "truncated or corrupt" in problems["garbage"] or "not a torch.save" in problems["garbage"]
    for name in ("hostile_torch_save", "hostile_plain_pickle"):
        assert "refused" in problems[name] and "weights_only" in problems[name], problems[name]
    assert "posix.makedirs" in problems["hostile_torch_save"] or "os.makedirs" in problems["hostile_torch_save"]
    assert "expected a dict with 'weights'" in problems["not_a_dict"]
    assert "'weights' must be a dict" in problems["weights_not_a_dict"]
    assert "metadata" in problems["meta_wrong_layout"]
    # The per-file layout check refuses malformed files only: real files of every wrapping still consolidate.
    real = tmp_path / "real"
    run_distributed(_layouts_body, 2, str(real))
    for case in sorted(os.listdir(real)):
        assert main(["consolidate", str(real / case), str(real / f"{case}.pt")]) == 0, capsys.readouterr()


def test_reshard_inputs_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = str(tmp_path / "PAYLOAD_RAN")
    cases = _write_cases(tmp_path, marker)
    out_dir = str(tmp_path / "out")
    good_meta = tmp_path / "meta.pt"
    good_meta.write_bytes(_torch_save_bytes({"weights": {}, "meta": {"param_metadata": [], "buffer_names": []}}))
    for name in ("empty", "truncated", "hostile_torch_save", "hostile_plain_pickle"):
        # A bad --meta file, then a bad full state dict.
        argv = ["reshard", str(cases["truncated"]), "--meta", str(cases[name]), "--world-size", "2"]
        assert main(argv + ["--out-dir", out_dir]) != 0
        _one_error_line(capsys.readouterr().err, cases[name])
        argv = ["reshard", str(cases[name]), "--meta", str(good_meta), "--world-size", "2", "--out-dir", out_dir]
        assert main(argv) != 0
        _one_error_line(capsys.readouterr().err, cases[name])
    # A directory where a file is expected, and a file that does not exist.
    argv = ["reshard", str(tmp_path), "--meta", str(good_meta), "--world-size", "2", "--out-dir", out_dir]
    assert main(argv) != 0
    assert "is a directory" in _one_error_line(capsys.readouterr().err, tmp_path)
    missing = tmp_path / "missing.pt"
    argv = ["reshard", str(missing), "--meta", str(missing), "--world-size", "2", "--out-dir", out_dir]
    assert main(argv) != 0
    assert "no such file" in _one_error_line(capsys.readouterr().err, missing)
    # The output cannot be written (a file stands where the output directory should be).
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    full = tmp_path / "full.pt"
    full.write_bytes(_torch_save_bytes({}))
    argv = ["reshard", str(full), "--meta", str(good_meta), "--world-size", "2", "--out-dir", str(blocker / "x")]
    assert main(argv) != 0
    _one_error_line(capsys.readouterr().err, blocker / "x")
    assert not os.path.exists(marker)


def test_command_line_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """``python -m ...``: the exit status and stderr a shell user sees."""
    marker = str(tmp_path / "PAYLOAD_RAN")
    path = _write_cases(tmp_path, marker)["hostile_plain_pickle"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd: List[str] = [sys.executable, "-m", "fairscale.nn.data_parallel.consolidate", "consolidate"]
    done = subprocess.run(cmd + [str(path.parent), str(tmp_path / "o.pt")], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert "refused" in _one_error_line(done.stderr, path)
    assert not os.path.exists(marker)


def test_outputs_never_replace_inputs_nor_leave_their_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    real = tmp_path / "real"
    run_distributed(_layouts_body, 2, str(real))
    shards = real / "0"
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    # consolidate over one of its own inputs (it wrote the full dict over rank 0's shard and exited 0), and into a
    # missing directory (a traceback).
    assert main(["consolidate", str(shards), str(shards / "ckpt-rank-0.pt")]) == 1
    assert "is one of the per-rank files being consolidated" in _one_error_line(
        capsys.readouterr().err, shards / "ckpt-rank-0.pt"
    )
    assert main(["consolidate", str(shards), str(tmp_path / "no" / "full.pt")]) == 1
    assert "does not exist; create it first" in _one_error_line(capsys.readouterr().err, tmp_path / "no" / "full.pt")
    full = tmp_path / "full.pt"
    assert main(["consolidate", str(shards), str(full)]) == 0
    capsys.readouterr()
    meta = ["--meta", str(shards / "ckpt-rank-0.pt")]
    # reshard: a prefix that leaves --out-dir, an --out-dir that holds per-rank files already (old and new files would
    # be consolidated together; here they were the inputs), a full dict of another shape (it wrote shards that
    # disagreed with their metadata and exited 0), and a value that is not a tensor.
    for extra, needle in (
        (["--out-dir", str(tmp_path / "o1"), "--prefix", "../escaped"], "must be a plain file name part"),
        (["--out-dir", str(shards), "--prefix", "ckpt"], "already holds per-rank files of prefix 'ckpt'"),
    ):
        assert main(["reshard", str(full), *meta, "--world-size", "3", *extra]) == 1
        assert needle in _one_error_line(capsys.readouterr().err, full)
    state = torch.load(full, weights_only=True)
    key = next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    for name, value, needle in (
        ("shape", torch.zeros(1, 1), "has shape (1, 1), but the metadata records"),
        ("int", 3, "is a int, not a tensor"),
    ):
        bad = tmp_path / f"full_{name}.pt"
        torch.save({**state, key: value}, bad)
        out = tmp_path / f"out_{name}"
        assert main(["reshard", str(bad), *meta, "--world-size", "2", "--out-dir", str(out)]) == 1
        assert needle in _one_error_line(capsys.readouterr().err, bad)
        assert not out.exists(), "a refused reshard wrote files"
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before
    assert not (tmp_path / "escaped-rank-0.pt").exists()


def test_rank_files_must_be_inside_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A received checkpoint directory whose ckpt-rank-1.pt is a symlink to a file of the user's own: it was read and
    # merged into the output without a word (found by a security review).
    received, private = tmp_path / "received", tmp_path / "private.pt"
    received.mkdir()
    private.write_bytes(_torch_save_bytes({"weights": {"secret": torch.tensor([42.0])}, "meta": {}}))
    (received / "ckpt-rank-0.pt").write_bytes(_torch_save_bytes({}))
    os.symlink(private, received / "ckpt-rank-1.pt")
    out = tmp_path / "full.pt"
    assert main(["consolidate", str(received), str(out)]) == 1
    assert "leads out of the checkpoint directory" in _one_error_line(
        capsys.readouterr().err, received / "ckpt-rank-1.pt"
    )
    assert not out.exists()
    # A symlink that stays inside the directory is followed, and a match that is not a file is refused.
    os.remove(received / "ckpt-rank-1.pt")
    os.rename(received / "ckpt-rank-0.pt", received / "store.bin")
    os.symlink(received / "store.bin", received / "ckpt-rank-0.pt")
    assert find_rank_files(str(received)) == [str(received / "ckpt-rank-0.pt")]
    (received / "ckpt-rank-1.pt").mkdir()
    with pytest.raises(ValueError, match="is not a regular file"):
        find_rank_files(str(received))


def _one_rank_checkpoint(rank: int, world_size: int, path: str) -> None:
    from _models import NestedWrappedModule, build, wrap_model

    fsdp = wrap_model(build(NestedWrappedModule)[0], {}, "nested")
    torch.save({"weights": fsdp.local_state_dict(), "meta": fsdp.local_metadata_dict()}, path)


def test_inputs_that_cost_or_mislead(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """From a security review (session 50): a directory name with glob characters matched another directory's files;
    an instance listed many times in the metadata (a few bytes per repeat) cost a full pass per repeat; a file's
    keys were printed whole in the one error line (a 963-byte file made a 100 MB line)."""
    literal, other = tmp_path / "run[1]", tmp_path / "run1"
    literal.mkdir()
    other.mkdir()
    run_distributed(_one_rank_checkpoint, 1, str(literal / "ckpt-rank-0.pt"))
    (other / "ckpt-rank-0.pt").write_bytes(_torch_save_bytes({}))
    assert find_rank_files(str(literal)) == [str(literal / "ckpt-rank-0.pt")]
    assert main(["consolidate", str(literal), str(tmp_path / "full.pt")]) == 0, capsys.readouterr()
    # The same instance twice.
    ckpt = torch.load(literal / "ckpt-rank-0.pt", weights_only=True)
    ckpt["meta"]["param_metadata"] = list(ckpt["meta"]["param_metadata"]) * 2
    repeated = tmp_path / "repeated"
    repeated.mkdir()
    torch.save(ckpt, repeated / "ckpt-rank-0.pt")
    assert main(["consolidate", str(repeated), str(tmp_path / "full2.pt")]) == 1
    assert "repeats the instance" in _one_error_line(capsys.readouterr().err, repeated / "ckpt-rank-0.pt")
    # Long keys are shortened in the message.
    long_keys = tmp_path / "long"
    long_keys.mkdir()
    (long_keys / "ckpt-rank-0.pt").write_bytes(
        _torch_save_bytes({"k" * 100000: 1, **{f"key{i}": i for i in range(20)}})
    )
    assert main(["consolidate", str(long_keys), str(tmp_path / "full3.pt")]) == 1
    line = _one_error_line(capsys.readouterr().err, long_keys / "ckpt-rank-0.pt")
    assert "expected a dict with 'weights'" in line and len(line) < 600, line[:300]


def test_a_missing_directory_or_a_file_is_named_as_such(tmp_path: Path) -> None:
    """Both said "no file matches '*.pt'" (a new user's first hour, session 50)."""
    with pytest.raises(ValueError, match="does not exist"):
        find_rank_files(str(tmp_path / "missing"))
    (tmp_path / "ckpt-rank-0.pt").write_bytes(_torch_save_bytes({}))
    with pytest.raises(ValueError, match="is not a directory"):
        find_rank_files(str(tmp_path / "ckpt-rank-0.pt"))
