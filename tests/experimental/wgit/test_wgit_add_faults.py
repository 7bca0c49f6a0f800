# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``wgit add`` on checkpoints it cannot store, adds that fail halfway, and commands that must write nothing.

An add checks what it can before it stores anything: tensors with no numpy dtype (bfloat16, float8, sparse, ...), a
checkpoint that is not a dict (or, as a whole, a tensor), a file name that is not UTF-8, a metadata path blocked by a
tracked file. An add that fails anyway (disk full, a git error) is rolled back: the store's ``metadata.json`` and
objects are as before. Opening a repository (``wgit status``) writes nothing, so it neither disturbs an add running
elsewhere nor fails on a read-only repository; a crashed add's temporary metadata file is neither listed nor staged;
the recorded modification time is the loaded file's; a relative ``parent_dir`` keeps naming the same repository.
Needs pygit2; each test works in its own temporary directory.
"""

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("pygit2")

import pygit2  # noqa: E402

import fairscale  # noqa: E402
from fairscale.experimental.wgit import repo as repo_module  # noqa: E402
from fairscale.experimental.wgit.repo import Repo, RepoStatus  # noqa: E402
from fairscale.experimental.wgit.sha1_store import SHA1_Store  # noqa: E402
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError  # noqa: E402

_LEFTOVER = ".ck.pt." + "0123456789abcdef" * 2 + ".tmp"  # what replace_file leaves when killed before its rename


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialized repository directory (the current directory) holding ``ck.pt``."""
    directory = tmp_path / "wgit_testing"
    directory.mkdir()
    monkeypatch.chdir(directory)
    torch.save({"w": torch.arange(4.0), "b": torch.ones(2), "step": 3}, directory / "ck.pt")
    Repo(directory, init=True)
    return directory


def _wgit(cwd: Path, *args: str) -> "subprocess.CompletedProcess[str]":
    """The real ``wgit`` command line, in a child process run from ``cwd``."""
    root = str(Path(fairscale.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, "-m", "fairscale.experimental.wgit", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=180, env=env)


def _store_state(work: Path) -> Tuple[List[str], bytes]:
    """Every path in the SHA1 store and the bytes of its ``metadata.json``."""
    store = work / ".wgit" / "sha1_store"
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")), (store / "metadata.json").read_bytes()


def _tree_state(root: Path) -> Dict[str, Tuple[int, int, str]]:
    """Every entry below ``root``: inode, modification time and content hash (directories: their listing)."""
    state: Dict[str, Tuple[int, int, str]] = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        content = ",".join(sorted(os.listdir(path))) if path.is_dir() else hashlib.sha1(path.read_bytes()).hexdigest()
        state[str(path.relative_to(root))] = (st.st_ino, st.st_mtime_ns, content)
    return state


class _FailOnCall:
    """Wraps a callable and raises ``error`` on its ``n``-th call (1-based); the others go through."""

    def __init__(self, fn: Any, n: int, error: BaseException) -> None:
        self.fn, self.n, self.error, self.calls = fn, n, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            raise self.error
        return self.fn(*args, **kwargs)


class _LoadThenRewrite:
    """``load_checkpoint`` that, once the file is loaded, rewrites it as a training loop would (a later mtime)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __call__(self, path: Path) -> Any:
        obj = self.real(path)
        later = os.stat(path).st_mtime + 10
        torch.save({"w": torch.zeros(4), "b": torch.zeros(2), "step": 4}, path)
        os.utime(path, (later, later))
        return obj


# ------------------------------------------------------------------------- tensors the store cannot keep (1)


def _unstorable() -> Dict[str, torch.Tensor]:
    return {
        "bfloat16": torch.ones(3, dtype=torch.bfloat16),
        "float8": torch.ones(3).to(torch.float8_e4m3fn),
        "complex32": torch.ones(3, dtype=torch.complex32),
        "sparse": torch.eye(3).to_sparse(),
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
        "meta": torch.empty(3, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's warnings on complex32, quantized and nested tensors
@pytest.mark.parametrize("kind", ["bfloat16", "float8", "complex32", "sparse", "quantized", "meta", "nested"])
def test_store_refuses_an_unstorable_tensor_before_writing(tmp_path: Path, kind: str) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    store.add(torch.ones(5))
    before = sorted(p.name for p in (tmp_path / "store").rglob("*")), (tmp_path / "store" / "metadata.json").read_text()
    tensor = _unstorable()[kind]
    with pytest.raises(FairscaleTypeError, match=rf"the tensor 'model\.layers\.1' \({tensor.dtype}, {tensor.layout}\)"):
        store.add({"model": {"layers": [torch.ones(2), tensor]}})
    after = sorted(p.name for p in (tmp_path / "store").rglob("*")), (tmp_path / "store" / "metadata.json").read_text()
    assert after == before


def test_store_keeps_conj_and_neg_views_as_their_values(tmp_path: Path) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    values = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    key = store.add({"conj": values.conj(), "neg": torch._neg_view(torch.arange(3.0))})
    got = store.get(key)
    assert torch.equal(got["conj"], torch.tensor([1 - 2j, 3 + 1j], dtype=torch.complex64))
    assert torch.equal(got["neg"], -torch.arange(3.0))


def test_cli_add_of_a_bf16_checkpoint_says_what_to_do_and_stores_nothing(work: Path) -> None:
    torch.save({"a": torch.ones(3), "model": {"b": torch.ones(3, dtype=torch.bfloat16)}}, work / "mixed.pt")
    before = _store_state(work)
    out = _wgit(work, "add", "mixed.pt")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "fatal: " in out.stderr and "'model.b' (torch.bfloat16" in out.stderr and ".float()" in out.stderr
    assert _store_state(work) == before
    assert not (work / ".wgit" / "wgit_testing").exists()


# --------------------------------------------------------------------------- the checkpoint's top level (2)


def test_cli_refuses_a_list_checkpoint_up_front_and_hints_only_what_works(work: Path) -> None:
    torch.save([torch.ones(3), torch.zeros(2)], work / "list.pt")
    torch.save(torch.arange(3.0), work / "t.pt")
    before = _store_state(work)
    out = _wgit(work, "add", "list.pt")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "a dict (a state dict" in out.stderr and "or a single tensor" in out.stderr
    assert "--no_per_tensor" not in out.stderr  # it would fail as well
    assert _store_state(work) == before
    out = _wgit(work, "add", "t.pt")
    assert out.returncode == 1 and "--no_per_tensor" in out.stderr, out.stderr
    assert _store_state(work) == before
    out = _wgit(work, "add", "--no_per_tensor", "t.pt")  # the hint works
    assert out.returncode == 0, out.stderr


def test_api_refuses_what_the_store_cannot_take_as_a_whole(work: Path) -> None:
    torch.save([torch.ones(3)], work / "list.pt")
    torch.save(5, work / "int.pt")
    repo = Repo(work)
    before = _store_state(work)
    for name in ("list.pt", "int.pt"):
        for per_tensor in (True, False):
            with pytest.raises(FairscaleTypeError, match="a dict .* or a single tensor") as info:
                repo.add(name, per_tensor=per_tensor)
            assert "--no_per_tensor" not in str(info.value)
    assert _store_state(work) == before


# ------------------------------------------------------------------------------------ rollback of an add (3)


@pytest.mark.parametrize("fail_at", ["second tensor", "state dict", "metadata", "git"])
def test_a_failed_add_leaves_the_store_as_before(work: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str) -> None:
    repo = Repo(work)
    repo.add("ck.pt")  # "b" is then in the store already: the failed add adds a reference and a name to it
    repo.commit("first")
    os.mkdir(work / "run")
    torch.save({"b": torch.ones(2), "c": torch.arange(7.0), "d": torch.full((3,), 2.0)}, work / "run" / "ck2.pt")
    before = _store_state(work)
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    store = repo._sha1_store
    with monkeypatch.context() as patch:  # undone at the end of the block (the fixture's chdir stays)
        if fail_at in ("second tensor", "state dict"):
            patch.setattr(store, "add", _FailOnCall(store.add, 2 if fail_at == "second tensor" else 4, disk_full))
        elif fail_at == "metadata":
            patch.setattr(repo, "_write_metadata", _FailOnCall(repo._write_metadata, 1, disk_full))
        else:
            patch.setattr(repo._pygit, "add", _FailOnCall(repo._pygit.add, 1, pygit2.GitError("index locked")))
        with pytest.raises((OSError, pygit2.GitError)):
            repo.add("run/ck2.pt")
    assert _store_state(work) == before
    assert not (work / ".wgit" / "wgit_testing" / "run").exists()
    repo.add("run/ck2.pt")  # the same add works once the cause is gone
    assert repo.status()["wgit_testing/run/ck2.pt"] == RepoStatus.CHANGES_ADDED_NOT_COMMITED


def test_store_add_that_fails_to_write_metadata_removes_its_object(tmp_path: Path) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    store.add(torch.ones(1))  # the first add makes the writers' lock file, which stays
    before = sorted(str(p) for p in (tmp_path / "store").rglob("*"))
    store._store_json_dict = _FailOnCall(store._store_json_dict, 1, OSError(errno.ENOSPC, "disk full"))
    with pytest.raises(OSError):
        store.add(torch.arange(9.0))
    assert sorted(str(p) for p in (tmp_path / "store").rglob("*")) == before


def test_non_utf8_file_name_is_refused_before_storing(work: Path) -> None:
    name = os.fsdecode(b"ck\xff.pt")
    (work / "ck.pt").rename(work / name)
    before = _store_state(work)
    with pytest.raises(FairscaleValueError, match=r"file name 'ck\\udcff\.pt' is not valid UTF-8"):
        Repo(work).add(name)
    assert _store_state(work) == before
    assert not (work / ".wgit" / "wgit_testing").exists()


def test_file_and_folder_of_the_same_name_are_refused_before_storing(work: Path) -> None:
    repo = Repo(work)
    torch.save({"x": torch.ones(3)}, work / "model")
    repo.add("model")
    os.remove(work / "model")
    os.mkdir(work / "model")
    torch.save({"w": torch.arange(5.0)}, work / "model" / "w.pt")
    before = _store_state(work)
    with pytest.raises(FairscaleValueError, match="cannot both be tracked"):
        repo.add("model/w.pt")
    assert _store_state(work) == before


# ------------------------------------------------------------------------- opening a store writes nothing (4)


def test_status_and_log_write_nothing_and_keep_another_adds_file(work: Path) -> None:
    Repo(work).add("ck.pt")
    in_progress = work / ".wgit" / "sha1_store" / "tmp" / ("a" * 32)  # another process's add, between its writes
    in_progress.write_bytes(b"pickle being written")
    before = _tree_state(work / ".wgit")
    for args in (["status"], ["log"]):
        out = _wgit(work, *args)
        assert out.returncode == 0, out.stderr
    assert _tree_state(work / ".wgit") == before


def test_add_creates_the_scratch_folder_and_removes_only_day_old_leftovers(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    SHA1_Store(store_dir, init=True)
    (store_dir / "tmp").rmdir()  # a store whose scratch folder is gone: an add makes it again
    store = SHA1_Store(store_dir)
    assert not (store_dir / "tmp").exists()
    store.add(torch.ones(2))
    crashed, running = store_dir / "tmp" / ("c" * 32), store_dir / "tmp" / ("d" * 32)
    crashed.write_bytes(b"left by a crashed add")
    running.write_bytes(b"an add running now")
    day_and_more = time.time() - 25 * 3600
    os.utime(crashed, (day_and_more, day_and_more))
    SHA1_Store(store_dir).add(torch.zeros(2))
    assert not crashed.exists() and running.exists()


# --------------------------------------------------------------------------------- mtime before loading (5)


def test_mtime_is_taken_before_loading(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Repo(work)
    mtime = os.stat(work / "ck.pt").st_mtime
    with monkeypatch.context() as patch:
        patch.setattr(repo_module, "load_checkpoint", _LoadThenRewrite(repo_module.load_checkpoint))
        repo.add("ck.pt")
    repo.commit("c")
    metadata = json.loads((work / ".wgit" / "wgit_testing" / "ck.pt").read_text())
    assert metadata["last_modified_time_stamp"] == mtime
    assert repo.status() == {"wgit_testing/ck.pt": RepoStatus.CHANGES_NOT_ADDED}


# ----------------------------------------------------------------------- a crashed add's temporary file (6)


def test_replace_file_leftover_is_not_listed_nor_committed(work: Path) -> None:
    repo = Repo(work)
    repo.add("ck.pt")
    repo.commit("first")
    (work / ".wgit" / "wgit_testing" / _LEFTOVER).write_text('{"SHA1": "half written')
    out = _wgit(work, "status")
    assert out.returncode == 0 and _LEFTOVER not in out.stdout, out.stdout + out.stderr
    torch.save({"z": torch.ones(1)}, work / "other.pt")
    repo.add("other.pt")
    repo.commit("second")
    git = pygit2.Repository(str(work / ".wgit" / ".git"))
    committed = {entry.name for entry in git.revparse_single("HEAD").tree["wgit_testing"]}
    assert committed == {"ck.pt", "other.pt"}


# ---------------------------------------------------------------------------------- relative parent_dir (7)


def test_relative_parent_dir_keeps_naming_the_same_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("A", "B"):
        (tmp_path / name / "wgit_testing").mkdir(parents=True)
        torch.save({"w": torch.ones(2)}, tmp_path / name / "wgit_testing" / "ck.pt")
    monkeypatch.chdir(tmp_path / "A")
    repo = Repo("wgit_testing", init=True)
    monkeypatch.chdir(tmp_path / "A" / "wgit_testing")  # no wgit_testing/wgit_testing here
    assert repo.status() == {"": RepoStatus.CLEAN}
    monkeypatch.chdir(tmp_path / "B")
    Repo("wgit_testing", init=True)
    with pytest.raises(FairscaleValueError, match="is not inside the repository's directory"):
        repo.add("wgit_testing/ck.pt")  # B's checkpoint is not in A's tree
    assert sorted(p.name for p in (tmp_path / "A" / "wgit_testing" / ".wgit").iterdir()) == [
        ".git",
        ".gitignore",
        "sha1_store",
    ]


# ------------------------------------------------------------------------- one writer at a time, git must commit


def test_a_checkpoint_named_like_wgits_temporary_files_is_refused_on_the_first_add(work: Path) -> None:
    """The first add writes git's exclude rule for wgit's temporary file names: a checkpoint named like one was stored,
    and called clean, yet its metadata was never committed."""
    hex32 = "0" * 32
    # A file, a file git's pattern matches with its '*' empty, a folder on the way (the rule matches any component).
    for name in (f".ck.{hex32}.tmp", f"..{hex32}.tmp", f".run.{hex32}.tmp/ck.pt"):
        (work / name).parent.mkdir(exist_ok=True)
        os.replace(work / "ck.pt", work / name)
        before = _store_state(work)
        with pytest.raises(FairscaleValueError, match="would never be committed: a part of it is named like wgit's"):
            Repo(work).add(name)
        assert _store_state(work) == before
        os.replace(work / name, work / "ck.pt")


def _add_in_thread(store: SHA1_Store, tensor: torch.Tensor, out: List[str]) -> None:
    out.append(store.add(tensor))


def test_adds_from_two_store_objects_take_turns_and_keep_both(tmp_path: Path) -> None:
    """Two writers used to each write back the metadata.json they had read: the later one dropped the other's entry
    (its object then failed to load). A second store object (another process, in effect: flock locks an open file)
    now waits until the first one's change is done."""
    first = SHA1_Store(tmp_path / "store", init=True)
    second = SHA1_Store(tmp_path / "store")
    out: List[str] = []
    with first._writing():
        thread = threading.Thread(target=_add_in_thread, args=(second, torch.arange(5.0), out), daemon=True)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive() and not out, "the second writer did not wait for the first"
        kept = first.add(torch.ones(6))
    thread.join(60)
    assert not thread.is_alive() and len(out) == 1
    entries = json.loads((tmp_path / "store" / "metadata.json").read_text())
    assert kept in entries and out[0] in entries
    assert torch.equal(first.get(out[0]), torch.arange(5.0)) and torch.equal(second.get(kept), torch.ones(6))


@pytest.mark.parametrize("folder", ["sha1_store", "s_.git"])
def test_a_checkpoint_git_would_never_commit_is_refused_before_storing(work: Path, folder: str) -> None:
    """upstream's .gitignore entry ``sha1_store`` matches any folder of that name, and git never tracks ``.git``: the
    add stored the checkpoint and ``status`` called it clean, but no commit held its metadata."""
    os.mkdir(work / folder)
    name = ".git" if folder == "s_.git" else "ck.pt"
    os.replace(work / "ck.pt", work / folder / name)  # moved: torch.save refuses to write a file named .git
    before = _store_state(work)
    with pytest.raises(FairscaleValueError, match="would never be committed"):
        Repo(work).add(f"{folder}/{name}")
    assert _store_state(work) == before
