# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A repository that stays consistent: a failed re-add puts the metadata back, a checkpoint added through a path
with a symbolic link in it is found by ``status``, ``status`` works from any directory and lists a metadata file
directly in ``.wgit``, and an interrupted ``wgit init`` is finished by the next one.

Needs pygit2; each test works in its own temporary directory, with real git locks, links and killed processes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

pytest.importorskip("pygit2")

import pygit2  # noqa: E402

import fairscale  # noqa: E402
from fairscale.experimental.wgit import cli  # noqa: E402
from fairscale.experimental.wgit.repo import Repo, RepoStatus  # noqa: E402
from fairscale.experimental.wgit.safety import UnsafeRepositoryError  # noqa: E402
from fairscale.experimental.wgit.sha1_store import SHA1_Store  # noqa: E402

_KEY = "wgit_testing/ck.pt"


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialized repository directory (the current directory) holding ``ck.pt``."""
    directory = tmp_path / "wgit_testing"
    directory.mkdir()
    monkeypatch.chdir(directory)
    torch.save({"w": torch.arange(4.0), "step": 3}, directory / "ck.pt")
    Repo(directory, init=True)
    return directory


def _wgit(cwd: Path, *args: str) -> "subprocess.CompletedProcess[str]":
    """The real ``wgit`` command line, in a child process run from ``cwd``."""
    root = str(Path(fairscale.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, "-m", "fairscale.experimental.wgit", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=180, env=env)


def _wgit_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, cwd: Path, *args: str
) -> "subprocess.CompletedProcess[str]":
    """The ``wgit`` command line in this process (a child per call costs seconds on 2 cores), run from ``cwd``;
    the result as :func:`_wgit` gives it."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        cli.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["wgit", *args], code, captured.out, captured.err)


def _store_state(work: Path) -> Tuple[List[str], bytes]:
    store = work / ".wgit" / "sha1_store"
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")), (store / "metadata.json").read_bytes()


def _committed(work: Path, path: str) -> bytes:
    git = pygit2.Repository(str(work / ".wgit" / ".git"))
    return git.revparse_single(f"HEAD:{path}").data


# ------------------------------------------------------------------------ a failed re-add puts everything back


def test_a_readd_failing_at_git_puts_the_metadata_and_the_index_back(work: Path) -> None:
    """A re-add failing on git's index lock kept the new metadata, whose object the rollback deleted: status said
    "added", and the next commit (from memory, or by a later add) recorded an object the store no longer had."""
    repo = Repo(work)
    repo.add("ck.pt")
    repo.commit("first")
    metadata = work / ".wgit" / _KEY
    tracked, store_before = metadata.read_bytes(), _store_state(work)
    torch.save({"w": torch.full((4,), 7.0), "step": 4}, work / "ck.pt")  # a new version
    lock = work / ".wgit" / ".git" / "index.lock"
    lock.write_text("")  # left by an interrupted git
    with pytest.raises(pygit2.GitError, match="locked"):
        repo.add("ck.pt")
    assert metadata.read_bytes() == tracked and _store_state(work) == store_before
    assert repo.status() == {_KEY: RepoStatus.CHANGES_NOT_ADDED}
    lock.unlink()
    repo.commit("after the failed add")  # the same Repo: what git staged in memory must not reach the commit
    assert _committed(work, _KEY) == tracked
    torch.save({"v": torch.zeros(2)}, work / "other.pt")
    out = _wgit(work, "add", "other.pt")  # stages every change of .wgit
    assert out.returncode == 0, out.stderr
    assert _wgit(work, "commit", "-m", "other").returncode == 0
    assert _committed(work, _KEY) == tracked
    sha1 = json.loads(tracked)["SHA1"]
    assert Repo(work)._sha1_store.get(sha1)["step"] == 3  # the committed metadata's object is still there
    repo.add("ck.pt")  # once the lock is gone, the re-add works
    assert repo.status()[_KEY] == RepoStatus.CHANGES_ADDED_NOT_COMMITED


# ------------------------------------------------------------------------------- paths through symbolic links


def test_a_checkpoint_added_through_a_linked_path_is_found_by_status_and_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The repository reached through a link (``/home`` -> ``/nfs/home``, a shell's ``$PWD``): the path was recorded
    as given, and every later status and add refused wgit's own metadata as outside the repository. (In this process:
    the working directory is the resolved one either way; what the link changes is the paths given.)"""
    real = tmp_path / "data" / "wgit_testing"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    torch.save({"w": torch.ones(3)}, real / "ck.pt")

    def wgit(cwd: Path, *args: str) -> "subprocess.CompletedProcess[str]":
        return _wgit_here(monkeypatch, capsys, cwd, *args)

    assert wgit(link, "init").returncode == 0
    for path in (str(link / "ck.pt"), "../../link/ck.pt", "ck.pt"):
        out = wgit(link, "add", path)
        assert out.returncode == 0, (path, out.stderr)
        assert json.loads((real / ".wgit" / _KEY).read_text())["file_path"] == "ck.pt"
        assert wgit(link, "commit", "-m", path).returncode == 0
        out = wgit(link, "status")
        assert out.returncode == 0 and out.stdout == "{'wgit_testing/ck.pt': <RepoStatus.CLEAN: 1>}\n", out.stderr
    os.utime(real / "ck.pt", (1, 1))
    assert wgit(real, "status").stdout == "{'wgit_testing/ck.pt': <RepoStatus.CHANGES_NOT_ADDED: 2>}\n"


def test_a_link_in_the_repository_is_tracked_as_itself_and_a_link_out_is_still_refused(
    work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = Repo(work)
    os.mkdir(work / "run")
    os.rename(work / "ck.pt", work / "run" / "ck_100.pt")
    (work / "latest.pt").symlink_to(work / "run" / "ck_100.pt")
    repo.add("latest.pt")
    metadata = work / ".wgit" / "wgit_testing" / "run" / "ck_100.pt"  # upstream's name rule: the resolved path
    assert json.loads(metadata.read_text())["file_path"] == "latest.pt"
    repo.commit("c")
    monkeypatch.chdir(tmp_path)  # status looks at it from any directory
    assert repo.status() == {"wgit_testing/run/ck_100.pt": RepoStatus.CLEAN}
    monkeypatch.chdir(work)
    torch.save({"w": torch.ones(1)}, tmp_path / "outside.pt")
    (work / "out.pt").symlink_to(tmp_path / "outside.pt")
    with pytest.raises(ValueError, match="is not inside the repository's directory"):
        repo.add("out.pt")
    json_text = json.dumps({"SHA1": "0" * 40, "last_modified_time_stamp": 1.0, "file_path": "out.pt"})
    metadata.write_text(json_text)  # a metadata file naming the link that leads out: not looked at through it
    assert repo.status() == {"wgit_testing/run/ck_100.pt": RepoStatus.CHANGES_NOT_ADDED}
    with pytest.raises(UnsafeRepositoryError, match="the symbolic link .*out.pt"):  # an add over it: still refused
        repo.add("latest.pt")


# ------------------------------------------------------------------------ status from any current directory


def test_status_reads_recorded_paths_against_the_repository_not_the_current_directory(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script whose current directory is elsewhere was told that a repository wgit wrote is unsafe."""
    assert _wgit(work, "add", "ck.pt").returncode == 0
    assert _wgit(work, "commit", "-m", "c").returncode == 0
    for cwd in (work.parent, Path("/"), work / ".wgit"):
        monkeypatch.chdir(cwd)
        assert Repo(work).status() == {_KEY: RepoStatus.CLEAN}, cwd
    os.utime(work / "ck.pt", (1, 1))
    assert Repo(work).status() == {_KEY: RepoStatus.CHANGES_NOT_ADDED}


def test_older_metadata_relative_to_where_add_ran_is_still_read(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata written by earlier versions (and upstream) holds the path relative to where ``add`` ran (here the
    repository's parent: ``Repo(".../wgit_testing").add("wgit_testing/ck.pt")``); read against the repository only,
    an untouched checkpoint showed as changed for ever."""
    assert _wgit(work, "add", "ck.pt").returncode == 0
    metadata = work / ".wgit" / _KEY
    content = json.loads(metadata.read_text())
    content["file_path"] = "wgit_testing/ck.pt"  # the older format, from the parent directory
    metadata.write_text(json.dumps(content))
    git = pygit2.Repository(str(work / ".wgit" / ".git"))
    git.index.add(_KEY)  # staged as the older version's add did
    git.index.write()
    assert _wgit(work, "commit", "-m", "c").returncode == 0
    monkeypatch.chdir(work.parent)
    assert Repo(work).status() == {_KEY: RepoStatus.CLEAN}
    os.utime(work / "ck.pt", (1, 1))
    assert Repo(work).status() == {_KEY: RepoStatus.CHANGES_NOT_ADDED}


def test_an_add_from_a_sub_directory_is_found_by_the_command_line(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkdir(work / "run")
    torch.save({"w": torch.ones(2)}, work / "run" / "ck.pt")
    repo = Repo(work)
    monkeypatch.chdir(work / "run")  # a training job writing into run/
    repo.add("ck.pt")
    repo.commit("c")
    assert json.loads((work / ".wgit" / "run" / "ck.pt").read_text())["file_path"] == "run/ck.pt"
    out = _wgit(work, "status")
    assert out.returncode == 0 and out.stdout == "{'run/ck.pt': <RepoStatus.CLEAN: 1>}\n", out.stderr
    os.utime(work / "run" / "ck.pt", (1, 1))
    assert Repo(work).status() == {"run/ck.pt": RepoStatus.CHANGES_NOT_ADDED}


def test_status_lists_a_metadata_file_directly_in_wgit(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from deeper than the checkpoint, upstream's name rule gives ``.wgit/<file>``: git committed it, but
    status listed only sub-directories, so it said nothing was tracked and stayed clean after changes."""
    os.mkdir(work / "run")
    os.rename(work / "ck.pt", work / "run" / "ck.pt")
    deep = work / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    repo = Repo(work)
    monkeypatch.chdir(deep)
    repo.add(str(work / "run" / "ck.pt"))
    assert (work / ".wgit" / "ck.pt").is_file()
    assert repo.status() == {"ck.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED}
    repo.commit("c")
    (work / ".wgit" / (".ck.pt." + "ab" * 16 + ".tmp")).write_text("{")  # a killed add's temporary file
    assert repo.status() == {"ck.pt": RepoStatus.CLEAN}
    os.utime(work / "run" / "ck.pt", (1, 1))
    assert repo.status() == {"ck.pt": RepoStatus.CHANGES_NOT_ADDED}


# ------------------------------------------------------------------------------------ an interrupted wgit init

# A child that runs ``wgit init`` and dies (os._exit: no cleanup, as a SIGKILL or a power cut) when it opens the
# first file whose name ends with argv[1]: before the file is created, or just after (argv[2] == "after").
_KILLED_INIT = r"""
import builtins, os, sys
real_open = builtins.open
def dying_open(file, *args, **kwargs):
    if str(file).endswith(sys.argv[1]):
        if sys.argv[2] == "after":
            real_open(file, *args, **kwargs)
        os._exit(137)
    return real_open(file, *args, **kwargs)
builtins.open = dying_open
from fairscale.experimental.wgit import cli
cli.main(["init"])
"""


def _killed_init(cwd: Path, suffix: str, when: str) -> int:
    root = str(Path(fairscale.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-c", _KILLED_INIT, suffix, when]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, timeout=180).returncode


def test_an_init_killed_before_gitignore_is_finished_by_the_next_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Killed between git's init and the .gitignore write: every command, init included, refused the directory."""
    work = tmp_path / "wgit_testing"
    work.mkdir()
    assert _killed_init(work, ".wgit/.gitignore", "before") == 137
    assert sorted(p.name for p in (work / ".wgit").iterdir()) == [".git", "sha1_store"]
    out = _wgit_here(monkeypatch, capsys, work, "init")
    assert out.returncode == 0, out.stderr
    assert (work / ".wgit" / ".gitignore").read_text() == "sha1_store\n"
    torch.save({"w": torch.ones(2)}, work / "ck.pt")
    for args in (["add", "ck.pt"], ["commit", "-m", "c"]):
        assert _wgit_here(monkeypatch, capsys, work, *args).returncode == 0
    assert _wgit_here(monkeypatch, capsys, work, "status").stdout == "{'wgit_testing/ck.pt': <RepoStatus.CLEAN: 1>}\n"
    git = pygit2.Repository(str(work / ".wgit" / ".git"))
    assert sorted(git.revparse_single("HEAD").tree[name].name for name in (".gitignore", "wgit_testing")) == [
        ".gitignore",
        "wgit_testing",
    ]
    assert "sha1_store" not in [entry.name for entry in git.revparse_single("HEAD").tree]


def test_an_init_killed_before_the_store_header_is_finished_by_the_next_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Killed between the store's mkdir and its metadata.json: init said "metadata.json is missing", no hint."""
    work = tmp_path / "wgit_testing"
    work.mkdir()
    # replace_file writes ".metadata.json.<hex>.tmp" first, then renames it: killed while it writes that file.
    assert _killed_init(work, ".tmp", "after") == 137
    assert sorted(p.name for p in (work / ".wgit").iterdir()) == ["sha1_store"]
    assert [p.name.startswith(".metadata.json.") for p in (work / ".wgit" / "sha1_store").iterdir()] == [True]
    out = _wgit_here(monkeypatch, capsys, work, "init")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (work / ".wgit" / "sha1_store").iterdir()) == ["metadata.json", "tmp"]
    torch.save({"w": torch.ones(2)}, work / "ck.pt")
    assert _wgit_here(monkeypatch, capsys, work, "add", "ck.pt").returncode == 0
    assert (
        _wgit_here(monkeypatch, capsys, work, "status").stdout
        == "{'wgit_testing/ck.pt': <RepoStatus.CHANGES_ADDED_NOT_COMMITED: 3>}\n"
    )


def test_init_leaves_a_store_folder_with_other_files_alone_and_says_what_to_do(tmp_path: Path) -> None:
    work = tmp_path / "wgit_testing"
    (work / ".wgit" / "sha1_store" / "ab").mkdir(parents=True)
    (work / ".wgit" / "sha1_store" / "ab" / "data").write_bytes(b"someone's")
    out = _wgit(work, "init")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "metadata.json is missing" in out.stderr and "move it away" in out.stderr
    assert sorted(p.name for p in (work / ".wgit" / "sha1_store").iterdir()) == ["ab"]
    assert (work / ".wgit" / "sha1_store" / "ab" / "data").read_bytes() == b"someone's"


def test_store_init_on_an_empty_folder_creates_the_store(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.arange(3.0))
    assert torch.equal(SHA1_Store(tmp_path / "store").get(key), torch.arange(3.0))
