# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The consolidate tool scans each per-rank file before ``torch.load(weights_only=True)``.

A per-rank file of about 1 KB whose pickle uses a tuple shared at every level as a dict key made torch's weights-only
loader hash ``2**60`` tuples: ``python -m fairscale.nn.data_parallel.consolidate`` never returned (a security review,
session 50). Now it exits at once with one ``error: <file>: refused: ...`` line. The bomb runs in a fresh interpreter
with a timeout (a tuple's hash never releases the GIL, so nothing in-process could stop it).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fairscale.nn.data_parallel.consolidate import main

# The hostile files shared with the scan's own tests live in tests/internal; that folder is on sys.path however this
# file is run.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "internal"))
from _pickle_bombs import hash_bomb  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_a_hash_bomb_rank_file_is_refused_at_once(tmp_path: Path) -> None:
    rank_file = tmp_path / "ckpt-rank-0.pt"
    rank_file.write_bytes(hash_bomb(60))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fairscale.nn.data_parallel.consolidate", "consolidate"]
    try:
        done = subprocess.run(
            cmd + [str(tmp_path), str(tmp_path / "full.pt")], capture_output=True, text=True, env=env, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("consolidate of a 1 KB hash-bomb rank file did not return within 60 s")
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    prefix = f"error: {rank_file}: refused: "
    assert lines[0].startswith(prefix), lines[0]
    assert "take more than" in lines[0] and "steps to hash" in lines[0] and "weights_only" in lines[0], lines[0]
    assert not (tmp_path / "full.pt").exists()


def test_a_hash_bomb_given_to_reshard_is_refused_in_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The scan takes milliseconds: ``main`` itself returns (a 20-level bomb, 2**20 hashing steps inside torch, took
    about a second before, and so stays harmless should the scan be missing)."""
    meta = tmp_path / "ckpt-rank-0.pt"
    meta.write_bytes(hash_bomb(20))
    full = tmp_path / "full.pt"
    torch.save({"w": torch.ones(2)}, full)
    argv = ["reshard", str(full), "--meta", str(meta), "--world-size", "2", "--out-dir", str(tmp_path / "out")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {meta}: refused: its dict keys and set members take more than"), err
    assert not (tmp_path / "out").exists()
