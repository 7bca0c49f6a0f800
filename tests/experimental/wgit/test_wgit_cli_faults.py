# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``wgit`` command line on a damaged ``.wgit/.git`` and on a checkpoint that is not a file: one ``fatal:`` line
and exit status 1, never a traceback or a hang.

git's own errors (a lock left by an interrupted git, a damaged index) came out of pygit2 as tracebacks, and so did
wgit's refusal of an emptied ``.git``; ``wgit add`` of a named pipe blocked forever inside ``torch.load``.
"""

import os
import threading
from pathlib import Path
from typing import List

import pytest
import torch

from fairscale.experimental.wgit import cli
from fairscale.experimental.wgit.checkpoint_load import load_checkpoint
from fairscale.internal.errors import FairscaleValueError


@pytest.fixture
def repo_dir(checkpoint_dir: Path) -> Path:
    """A wgit repository with one checkpoint added and committed, the current directory for the test."""
    work = checkpoint_dir
    cli.main(["init"])
    cli.main(["add", "checkpoint_0.pt"])
    cli.main(["commit", "-m", "first"])
    return work


def _fails_in_one_line(argv: List[str], capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("fatal: ") and "Traceback" not in err, err
    return err


def test_git_errors_give_one_fatal_line(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    torch.save({"w": torch.ones(2)}, repo_dir / "checkpoint_1.pt")
    lock = repo_dir / ".wgit" / ".git" / "index.lock"
    lock.touch()  # left by a git or wgit that was killed while it staged
    err = _fails_in_one_line(["add", "checkpoint_1.pt"], capsys)
    assert "git refused an operation on .wgit/.git" in err and "index.lock" in err, err
    lock.unlink()
    cli.main(["add", "checkpoint_1.pt"])  # the lock removed, as the message says, the add works
    (repo_dir / ".wgit" / ".git" / "index").write_bytes(b"not an index")
    for argv in (["status"], ["add", "checkpoint_1.pt"], ["commit", "-m", "x"]):
        assert "git refused an operation" in _fails_in_one_line(argv, capsys)


def test_an_emptied_git_dir_gives_one_fatal_line(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    git_dir = repo_dir / ".wgit" / ".git"
    for path in sorted(git_dir.rglob("*"), key=lambda p: -len(p.parts)):  # deepest first
        path.rmdir() if path.is_dir() else path.unlink()
    for argv in (["status"], ["add", "checkpoint_0.pt"], ["init"]):
        assert "holds no git repository" in _fails_in_one_line(argv, capsys)


def _load_in_thread(path: Path, outcome: List[BaseException]) -> None:
    try:
        load_checkpoint(path)
    except BaseException as e:  # noqa: B902  # the test looks at whatever it raised
        outcome.append(e)


def test_a_named_pipe_checkpoint_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "ck.pt"
    os.mkfifo(fifo)
    outcome: List[BaseException] = []
    thread = threading.Thread(target=_load_in_thread, args=(fifo, outcome), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # a writer that closes at once ends the blocked read
        thread.join(30)
        pytest.fail("loading a named pipe as a checkpoint blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], FairscaleValueError), outcome
    assert "named pipe (FIFO), not a regular file" in str(outcome[0])
    with pytest.raises(FairscaleValueError, match="is a directory, not a regular file"):
        load_checkpoint(tmp_path)
    # A link to a checkpoint is the user's own file: followed.
    torch.save({"w": torch.ones(2)}, tmp_path / "real.pt")
    (tmp_path / "link.pt").symlink_to(tmp_path / "real.pt")
    assert torch.equal(load_checkpoint(tmp_path / "link.pt")["w"], torch.ones(2))


def test_adding_the_repository_directory_says_what_it_is(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    # "wgit add ." said the directory was not inside the repository's directory, which it is.
    err = _fails_in_one_line(["add", "."], capsys)
    assert "is the repository's directory itself, not a checkpoint file" in err, err


def test_without_pygit2_the_cli_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The plain install brings the wgit command but not pygit2 (the dev extra does): it printed a traceback (a new
    user's first hour, session 50). ``sys.modules[name] = None`` makes the import fail as a missing package does."""
    monkeypatch.setitem(__import__("sys").modules, "pygit2", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["init"])
    assert info.value.code == 1
    assert capsys.readouterr().err == "fatal: Error: please pip install pygit2 module to use wgit\n"


def test_adding_an_empty_file_says_it_is_empty(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """It said the file "declares 1 bytes of data, more than the 0 bytes left" (session 50)."""
    (repo_dir / "zero.pt").write_bytes(b"")
    assert "zero.pt: it is empty (0 bytes)" in _fails_in_one_line(["add", "zero.pt"], capsys)
