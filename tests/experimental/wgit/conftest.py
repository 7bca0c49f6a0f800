# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""wgit tests' shared set-up: a working directory with one checkpoint, the current directory of the test."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn


@pytest.fixture
def checkpoint_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``<tmp>/wgit_testing`` holding ``checkpoint_0.pt`` (a small model's state and a step), made the current
    directory; skips where pygit2 (wgit's git binding) is missing."""
    pytest.importorskip("pygit2")
    work = tmp_path / "wgit_testing"
    work.mkdir()
    monkeypatch.chdir(work)
    torch.save({"model": nn.Linear(1, 3).state_dict(), "step": 1}, work / "checkpoint_0.pt")
    return work
