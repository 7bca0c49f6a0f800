# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""wgit after an add that was interrupted or killed at the worst moment, and ``status`` on a checkpoint folder that was
moved to another disk and linked back.

* A rollback cut short (a second Ctrl-C, a SIGKILL) dropped the store references before it put the metadata back: the
  metadata named a deleted object, and the next add and commit recorded it.
* An add killed between its metadata write and git's index write: ``status`` said "added", and every commit left the
  change out.
* Killed adds left object-sized temporary files in the store that nothing removed.
* One checkpoint reached through a link leading out of the repository made the whole ``status`` fail.

Needs pygit2; each test works in its own temporary directory, with real files, git, locks and killed processes.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("pygit2")

import pygit2  # noqa: E402

import fairscale  # noqa: E402
from fairscale.experimental.wgit import cli  # noqa: E402
from fairscale.experimental.wgit.repo import Repo, RepoStatus  # noqa: E402
from fairscale.experimental.wgit.sha1_store import SHA1_Store  # noqa: E402

_KEY = "wgit_testing/ck.pt"
_V1 = {"w": torch.arange(4.0), "b": torch.ones(3), "step": 1}
_V2 = {"w": torch.arange(4.0) * 10, "b": torch.full((3,), 2.0), "step": 2}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialized repository directory (the current directory) holding ``ck.pt`` (version 1)."""
    directory = tmp_path / "wgit_testing"
    directory.mkdir()
    monkeypatch.chdir(directory)
    torch.save(_V1, directory / "ck.pt")
    Repo(directory, init=True)
    return directory


def _child(cwd: Path, script: str, *args: str) -> int:
    """Run ``script`` (which patches a call to die or be interrupted, then runs wgit) in a child process."""
    root = str(Path(fairscale.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, "-c", script, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, timeout=180).returncode


def _store_state(work: Path) -> Tuple[List[str], bytes]:
    store = work / ".wgit" / "sha1_store"
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")), (store / "metadata.json").read_bytes()


def _committed(work: Path, key: str = _KEY) -> bytes:
    git = pygit2.Repository(str(work / ".wgit" / ".git"))
    return git.revparse_single(f"HEAD:{key}").data


def _load(work: Path, metadata: bytes) -> Dict[str, Any]:
    """The checkpoint a metadata file's bytes name, its tensors read back from the store."""
    store = SHA1_Store(work / ".wgit" / "sha1_store")
    state = store.get(json.loads(metadata)["SHA1"])
    return {k: store.get(v.dense_sha1) if hasattr(v, "dense_sha1") else v for k, v in state.items()}


def _equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# ------------------------------------------------------------------------------------- a rollback cut short (1)

# argv[1] "kill": the re-add fails on git's index lock and the process dies (os._exit: no cleanup, as a SIGKILL)
# right after the rollback dropped its first store reference. "ctrl-c": two real SIGINTs, the first while git
# stages, the second at the same point of the rollback.
_ROLLBACK_CUT_SHORT = r"""
import os, signal, sys
import pygit2
from fairscale.experimental.wgit import cli
from fairscale.experimental.wgit.sha1_store import SHA1_Store
how = sys.argv[1]
# Python leaves SIGINT ignored when it starts with it ignored (a job sent to the background by a non-interactive
# shell, e.g. `nohup pytest ... &`): the interrupts below would then do nothing and the add succeed.
signal.signal(signal.SIGINT, signal.default_int_handler)
real_add_all, real_delete = pygit2.Index.add_all, SHA1_Store._delete
def add_all(self, *args, **kwargs):
    if how == "ctrl-c":
        os.kill(os.getpid(), signal.SIGINT)
    return real_add_all(self, *args, **kwargs)
def delete(self, sha1, name):
    real_delete(self, sha1, name)
    if how == "ctrl-c":
        os.kill(os.getpid(), signal.SIGINT)
    else:
        os._exit(137)
pygit2.Index.add_all = add_all
SHA1_Store._delete = delete
cli.main(["add", "ck.pt"])
"""


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_a_rollback_cut_short_never_leaves_metadata_naming_a_deleted_object(work: Path, how: str) -> None:
    cli.main(["add", "ck.pt"])
    cli.main(["commit", "-m", "v1"])
    tracked = (work / ".wgit" / _KEY).read_bytes()
    torch.save(_V2, work / "ck.pt")
    lock = work / ".wgit" / ".git" / "index.lock"
    if how == "kill":
        lock.write_text("")  # left by an interrupted git: the add fails when git writes its index
    assert _child(work, _ROLLBACK_CUT_SHORT, how) != 0
    lock.unlink(missing_ok=True)  # as the command line's message says
    assert (work / ".wgit" / _KEY).read_bytes() == tracked  # put back before any reference was dropped
    assert Repo(work).status() == {_KEY: RepoStatus.CHANGES_NOT_ADDED}
    torch.save({"v": torch.ones(2)}, work / "other.pt")
    cli.main(["add", "other.pt"])  # stages every change of .wgit
    cli.main(["commit", "-m", "other"])
    assert _committed(work) == tracked
    assert _equal(_load(work, _committed(work)), _V1)
    cli.main(["add", "ck.pt"])  # the new version can be added again
    cli.main(["commit", "-m", "v2"])
    assert _equal(_load(work, _committed(work)), _V2)


class _ThenInterrupt:
    """Calls ``fn``, then raises ``KeyboardInterrupt`` (Ctrl-C just after the call returned)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.fn(*args, **kwargs)
        raise KeyboardInterrupt


def test_an_add_interrupted_after_git_wrote_its_index_puts_the_index_back(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback re-read git's index from disk, which held the new metadata: the next commit recorded it, naming
    objects the rollback had deleted."""
    repo = Repo(work)
    repo.add("ck.pt")
    repo.commit("v1")
    tracked, store_before = (work / ".wgit" / _KEY).read_bytes(), _store_state(work)
    torch.save(_V2, work / "ck.pt")
    with monkeypatch.context() as patch:
        patch.setattr(repo._pygit, "add", _ThenInterrupt(repo._pygit.add))
        with pytest.raises(KeyboardInterrupt):
            repo.add("ck.pt")
    assert (work / ".wgit" / _KEY).read_bytes() == tracked and _store_state(work) == store_before
    assert repo.status() == {_KEY: RepoStatus.CHANGES_NOT_ADDED}
    assert pygit2.Repository(str(work / ".wgit" / ".git")).status() == {}  # the index matches the file again
    Repo(work).commit("after the interrupted add")
    assert _committed(work) == tracked and _equal(_load(work, tracked), _V1)


def test_a_rollback_that_cannot_put_the_metadata_back_keeps_the_references(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk still full when the rollback writes the metadata back: the references were dropped anyway, and the
    metadata left in place named deleted objects."""
    from fairscale.experimental.wgit import add_undo

    repo = Repo(work)
    repo.add("ck.pt")
    repo.commit("v1")
    torch.save(_V2, work / "ck.pt")
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as patch:
        patch.setattr(repo._pygit, "add", _Raise(disk_full))
        patch.setattr(add_undo, "replace_file", _Raise(disk_full))
        with pytest.raises(OSError) as info:
            repo.add("ck.pt")
    assert any("keeps the 3 references" in note for note in info.value.__notes__)  # two tensors and the dict
    left = (work / ".wgit" / _KEY).read_bytes()  # the new metadata, which could not be replaced
    assert json.loads(left)["last_modified_time_stamp"] == os.stat(work / "ck.pt").st_mtime
    assert _equal(_load(work, left), _V2)  # every object it names is still in the store


class _Raise:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


# ---------------------------------------------------------------- an add killed before git staged its change (2)

# The process dies (os._exit, as a SIGKILL) when git starts staging: after the metadata file was written.
_KILLED_BEFORE_STAGING = r"""
import os
import pygit2
from fairscale.experimental.wgit import cli
def add_all(self, *args, **kwargs):
    os._exit(137)
pygit2.Index.add_all = add_all
cli.main(["add", "ck.pt"])
"""


@pytest.mark.parametrize("first", [True, False], ids=["first add", "re-add"])
def test_the_change_of_an_add_killed_before_staging_is_committed(
    work: Path, capsys: pytest.CaptureFixture, first: bool
) -> None:
    version = _V1
    if not first:
        cli.main(["add", "ck.pt"])
        cli.main(["commit", "-m", "v1"])
        torch.save(_V2, work / "ck.pt")
        version = _V2
    assert _child(work, _KILLED_BEFORE_STAGING) == 137
    assert Repo(work).status() == {_KEY: RepoStatus.CHANGES_ADDED_NOT_COMMITED}
    capsys.readouterr()
    cli.main(["commit", "-m", "the killed add"])
    err = capsys.readouterr().err
    assert "also staging metadata changes that no wgit add staged" in err and _KEY in err, err
    written = (work / ".wgit" / _KEY).read_bytes()
    assert _committed(work) == written and _equal(_load(work, written), version)
    assert Repo(work).status() == {_KEY: RepoStatus.CLEAN}
    cli.main(["commit", "-m", "nothing staged"])  # as upstream: an empty commit, and nothing said
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------- what killed adds leave in the store (3)

# The process dies (os._exit, as a SIGKILL) when it renames a file whose name matches argv[1] into place.
_KILLED_AT_RENAME = r"""
import os, re, sys
from fairscale.experimental.wgit import cli
real_replace, pattern = os.replace, re.compile(sys.argv[1])
def replace(src, dst, *args, **kwargs):
    if pattern.match(os.path.basename(str(src))):
        os._exit(137)
    return real_replace(src, dst, *args, **kwargs)
os.replace = replace
cli.main(["add", sys.argv[2]])
"""
_OBJECT_TMP = r"^\.[0-9a-f]{40}\.[0-9a-f]{32}\.tmp$"
_METADATA_TMP = r"^\.metadata\.json\.[0-9a-f]{32}\.tmp$"


def test_an_add_removes_the_temporary_files_killed_adds_left_a_day_ago(work: Path) -> None:
    store = work / ".wgit" / "sha1_store"
    torch.save({"a": torch.arange(1000.0)}, work / "a.pt")
    torch.save({"b": torch.arange(2000.0)}, work / "b.pt")
    assert _child(work, _KILLED_AT_RENAME, _OBJECT_TMP, "a.pt") == 137  # while its object is put in place
    assert _child(work, _KILLED_AT_RENAME, _METADATA_TMP, "b.pt") == 137  # while the store's metadata is
    leftovers = [p for p in store.rglob("*") if p.is_file() and p.parent.name != "tmp" and p.name.endswith(".tmp")]
    assert sorted(bool(re.match(_OBJECT_TMP, p.name)) for p in leftovers) == [False, True], leftovers
    object_tmp = next(p for p in leftovers if re.match(_OBJECT_TMP, p.name))
    pickles = list((store / "tmp").iterdir())  # each killed add's pickle of its object
    assert len(pickles) == 2
    day_and_more = time.time() - 25 * 3600
    for path in leftovers + pickles:
        os.utime(path, (day_and_more, day_and_more))
    running = store / (".metadata.json." + "e" * 32 + ".tmp")  # as another add's, written now: kept
    shutil.copy(leftovers[0], running)
    Repo(work).add("ck.pt")
    assert not any(p.exists() for p in leftovers + pickles) and running.exists()
    folder = object_tmp.parent  # made for an object never put in place: gone unless another object is there
    assert not folder.exists() or all(re.match(r"^[0-9a-f]{40}$", p.name) for p in folder.iterdir())
    for name in ("a.pt", "b.pt"):  # the killed adds' checkpoints are added as if nothing had happened
        cli.main(["add", name])
    cli.main(["commit", "-m", "all"])
    assert _equal(_load(work, _committed(work, "wgit_testing/b.pt")), {"b": torch.arange(2000.0)})


# ------------------------------------------------------------------------ a checkpoint folder linked back in (4)


def test_status_lists_a_checkpoint_linked_back_from_elsewhere_and_says_what_to_do(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (work / "runs").mkdir()
    os.replace(work / "ck.pt", work / "runs" / "ck.pt")
    torch.save({"v": torch.ones(2)}, work / "other.pt")
    for args in (["add", "runs/ck.pt"], ["add", "other.pt"], ["commit", "-m", "both"]):
        cli.main(args)
    clean = {"wgit_testing/other.pt": RepoStatus.CLEAN, "wgit_testing/runs/ck.pt": RepoStatus.CLEAN}
    (tmp_path / "scratch").mkdir()
    os.replace(work / "runs", tmp_path / "scratch" / "runs")  # moved to another disk, linked back
    (work / "runs").symlink_to(Path("..") / "scratch" / "runs")
    capsys.readouterr()
    cli.main(["status"])
    out, err = capsys.readouterr()
    assert out == str({**clean, "wgit_testing/runs/ck.pt": RepoStatus.CHANGES_NOT_ADDED}) + "\n"
    metadata = work / ".wgit" / "wgit_testing" / "runs" / "ck.pt"
    # The link's target as written: wgit looks at nothing outside the repository's directory, not even to resolve it.
    assert f"the symbolic link {work.resolve() / 'runs'} (to {Path('..') / 'scratch' / 'runs'})" in err, err
    assert f"remove {metadata.resolve()} and run wgit commit" in err and "Move the checkpoint back" in err, err
    # The first way out: the folder moved back in place of the link.
    (work / "runs").unlink()
    os.replace(tmp_path / "scratch" / "runs", work / "runs")
    assert Repo(work).status() == clean
    # The second: stop tracking it.
    os.replace(work / "runs", tmp_path / "scratch" / "runs")
    (work / "runs").symlink_to(tmp_path / "scratch" / "runs")
    metadata.unlink()
    cli.main(["commit", "-m", "untrack runs/ck.pt"])
    assert Repo(work).status() == {"wgit_testing/other.pt": RepoStatus.CLEAN}
    with pytest.raises(KeyError):
        _committed(work, "wgit_testing/runs/ck.pt")
