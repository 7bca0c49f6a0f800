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
from fairscale.internal.errors import FairscaleValueError  # noqa: E402


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


def test_add_refuses_a_checkpoint_outside_the_repository(repo_dir: Path) -> None:
    # Upstream's naming rule keeps the last parts of the path: /elsewhere/wgit_testing/checkpoint_0.pt was tracked as
    # wgit_testing/checkpoint_0.pt, over the repository's own checkpoint_0.pt; ../outside.pt under a name that
    # status never listed.
    repo = Repo(repo_dir, init=True)
    repo.add("checkpoint_0.pt")
    repo.commit("first")
    metadata = repo_dir / ".wgit" / "wgit_testing" / "checkpoint_0.pt"
    tracked = metadata.read_bytes()
    elsewhere = repo_dir.parent / "elsewhere" / "wgit_testing"
    elsewhere.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, elsewhere / "checkpoint_0.pt")
    torch.save({"w": torch.zeros(2)}, repo_dir.parent / "outside.pt")
    for path in (str(elsewhere / "checkpoint_0.pt"), "../outside.pt"):
        with pytest.raises(FairscaleValueError, match=r"is not inside the repository's directory .*copy or move it"):
            repo.add(path)
    assert metadata.read_bytes() == tracked
    assert sorted(p.name for p in (repo_dir / ".wgit").iterdir()) == [
        ".git",
        ".gitignore",
        "sha1_store",
        "wgit_testing",
    ]
    assert repo.status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CLEAN}


def test_add_refuses_a_checkpoint_that_would_take_the_name_of_another(
    repo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run from a directory as deep as the checkpoints, the naming rule keeps only their file names: the second
    # would have replaced the first one's metadata.
    for run in ("a", "b"):
        (repo_dir / run / "run").mkdir(parents=True)
        torch.save({"w": torch.full((2,), float(ord(run)))}, repo_dir / run / "run" / "ck.pt")
    deep = repo_dir / "q" / "w" / "e"
    deep.mkdir(parents=True)
    repo = Repo(repo_dir, init=True)
    monkeypatch.chdir(deep)
    repo.add(str(repo_dir / "a" / "run" / "ck.pt"))
    metadata = repo_dir / ".wgit" / "ck.pt"
    tracked = metadata.read_bytes()
    with pytest.raises(FairscaleValueError, match=r"ck.pt, which already tracks .*a/run/ck.pt"):
        repo.add(str(repo_dir / "b" / "run" / "ck.pt"))
    assert metadata.read_bytes() == tracked
    repo.add(str(repo_dir / "a" / "run" / "ck.pt"))  # the same checkpoint again is an update, as before


def test_cli_reports_checkout_and_a_damaged_store_in_one_line(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    cli.main(["init"])
    with pytest.raises(SystemExit) as info:
        cli.main(["checkout", "0" * 40])
    err = capsys.readouterr().err
    assert (
        info.value.code == 1
        and err == "fatal: wgit checkout is not implemented (upstream's raised NotImplementedError too)\n"
    )
    store_metadata = repo_dir / ".wgit" / "sha1_store" / "metadata.json"
    store_metadata.write_text("garbage{")
    with pytest.raises(SystemExit):
        cli.main(["status"])
    err = capsys.readouterr().err
    assert err.startswith(f"fatal: {store_metadata} is not valid JSON") and "Restore the file from a backup" in err


def test_the_same_checkpoint_added_again_from_another_directory(
    repo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The metadata keeps the path as given: from another directory it does not name a file there, so it is not taken
    # for another checkpoint.
    (repo_dir / "run").mkdir()
    (repo_dir / "other").mkdir()
    torch.save({"w": torch.zeros(2)}, repo_dir / "run" / "ck.pt")
    repo = Repo(repo_dir, init=True)
    monkeypatch.chdir(repo_dir / "run")
    repo.add("ck.pt")
    monkeypatch.chdir(repo_dir / "other")
    repo.add("../run/ck.pt")
