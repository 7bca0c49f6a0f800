# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""wgit's Repo and command line (need ``pip install pygit2``): init, add (per tensor or whole file), commit,
the status life cycle, log, and the unimplemented checkout. Each test works in its own temporary directory."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("pygit2")

from fairscale.experimental.wgit import cli  # noqa: E402
from fairscale.experimental.wgit.repo import Repo, RepoStatus  # noqa: E402


@pytest.fixture
def repo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "wgit_testing"
    work.mkdir()
    monkeypatch.chdir(work)
    for i, n in enumerate([3, 4, 5, 5]):
        torch.save({"model": nn.Linear(1, n).state_dict(), "step": 100}, work / f"checkpoint_{i}.pt")
    return work


def test_api_life_cycle(repo_dir: Path) -> None:
    repo = Repo(repo_dir, init=True)
    assert (repo_dir / ".wgit" / ".git").exists() and (repo_dir / ".wgit" / "sha1_store").is_dir()
    assert repo.status() == {"": RepoStatus.CLEAN}
    state = repo.add("checkpoint_0.pt")
    assert state is not None and state["step"] == 100
    assert repo.status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED}
    repo.commit("first")
    assert repo.status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CLEAN}
    os.utime(repo_dir / "checkpoint_0.pt", (1, 1))
    assert repo.status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_NOT_ADDED}
    assert repo.add("checkpoint_1.pt", per_tensor=False) is None
    with pytest.raises(ValueError, match="Only support sparsity"):
        repo.add("checkpoint_2.pt", per_tensor=False, sparsify=True)
    with pytest.raises(NotImplementedError, match="checkout is not implemented"):
        repo.checkout("0" * 40)
    # Identical tensors are stored once.
    repo.add("checkpoint_2.pt")
    repo.add("checkpoint_3.pt")
    head = (repo_dir / ".wgit" / ".git" / "logs" / "HEAD").read_text().splitlines()[0]
    assert head.split()[-1] == "first"


def test_status_of_a_deleted_checkpoint_or_a_foreign_metadata_file(repo_dir: Path) -> None:
    # A deleted (or moved) checkpoint is a change not added, as git reports a deleted file; it raised
    # FileNotFoundError. A metadata file whose path is not a string is not wgit's: nothing to compare (was TypeError).
    repo = Repo(repo_dir, init=True)
    repo.add("checkpoint_0.pt")
    repo.commit("first")
    os.remove(repo_dir / "checkpoint_0.pt")
    assert repo.status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_NOT_ADDED}
    (repo_dir / ".wgit" / "wgit_testing" / "checkpoint_0.pt").write_text('{"SHA1": "x", "file_path": 42}')
    assert repo.status()["wgit_testing/checkpoint_0.pt"] != RepoStatus.CHANGES_NOT_ADDED


def test_cli(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    cli.main(["init"])
    cli.main(["add", "--no_per_tensor", "checkpoint_0.pt"])
    cli.main(["commit", "-m", "msg"])
    capsys.readouterr()
    cli.main(["status"])
    assert capsys.readouterr().out == "{'wgit_testing/checkpoint_0.pt': <RepoStatus.CLEAN: 1>}\n"
    cli.main(["log", "-f", "checkpoint_0.pt"])
    assert capsys.readouterr().out == "wgit log of the file: checkpoint_0.pt\n"
    cli.main(["version"])
    assert capsys.readouterr().out == "0.0.1\n"


def test_no_repo_exits(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        Repo(tmp_path)
