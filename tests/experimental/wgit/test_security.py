# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""wgit and a ``.wgit`` directory or checkpoint from someone else: no write outside the repository, no code run.

Each attack plants something in a repository (symbolic links inside ``.wgit``, a store key with ``..``, a pickle
whose ``__reduce__`` creates a marker directory) and checks that wgit refuses with a clear error, that the marker
never appears, and that nothing outside the repository (nor the user's checkpoint) changed. Without links: a
``.git`` that sends git to another repository, and named pipes in place of files wgit reads (which used to block it
forever). Then store objects and checkpoints of a few bytes that asked for unbounded memory (``bytearray(n)``),
poisoned an allowed class (pickle's BUILD), took ``2**depth`` steps (a list shared at every level) or nested past the
recursion limit, and metadata files that made ``status`` look outside the repository or fail with a traceback. The
store and repository-opening checks need no optional package; the end-to-end ``wgit`` checks need pygit2.
"""

import collections
import hashlib
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

import fairscale
from fairscale.experimental.wgit.repo import Repo, RepoStatus
from fairscale.experimental.wgit.safety import UnsafeRepositoryError, UntrustedContentError, check_tree, open_regular
from fairscale.experimental.wgit.sha1_store import SHA1_Store


class _Payload:
    """Unpickling it calls ``os.makedirs(marker)``: stands for any code a hostile pickle could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[str]]:
        return (os.makedirs, (self.marker,))


def _snapshot(root: Path) -> Dict[str, Tuple[str, int]]:
    """Every entry below ``root`` (links not followed): content hash (or link target) and modification time."""
    out: Dict[str, Tuple[str, int]] = {}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(directory, name)
            st = path.lstat()
            if path.is_symlink():
                out[str(path.relative_to(root))] = ("link:" + os.readlink(path), st.st_mtime_ns)
            elif path.is_file():
                out[str(path.relative_to(root))] = (hashlib.sha1(path.read_bytes()).hexdigest(), st.st_mtime_ns)
            else:
                out[str(path.relative_to(root))] = ("dir", 0)
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the repository with files an attacker would like wgit to overwrite or delete."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "victim.txt").write_text("precious")
    (directory / "store").mkdir()
    header = '{"created_on": "x", "original_size": 0, "deduped_size": 0, "compressed_size": 0}'
    (directory / "store" / "metadata.json").write_text(header)
    return directory


def _sha1_of(obj: Any, tmp_path: Path) -> str:
    """The key ``obj`` gets in a store (computed in a scratch store)."""
    return SHA1_Store(tmp_path / "scratch", init=True).add(obj)


# ------------------------------------------------------------------------------------------ pickle payloads


@pytest.mark.parametrize("compress", [True, False])
def test_store_get_never_runs_a_pickle_payload(tmp_path: Path, compress: bool) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.ones(3), compress=compress)
    marker = tmp_path / "PAYLOAD_RAN"
    object_file = tmp_path / "store" / key[:2] / key[2:4] / key
    payload = pickle.dumps({"w": _Payload(marker)})
    if compress:
        import gzip

        payload = gzip.compress(payload)
    object_file.write_bytes(payload)  # what a crafted repository would hold
    with pytest.raises(UntrustedContentError, match="os.makedirs|posix.makedirs"):
        store.get(key)
    assert not marker.exists(), "SHA1_Store.get ran code from a store object"
    # Objects wgit wrote still load (numpy arrays in plain containers, wgit's records).
    good = store.add({"a": torch.arange(4.0), "b": [torch.zeros(2, dtype=torch.int64), 7], "c": "text"})
    loaded = store.get(good)
    assert torch.equal(loaded["a"], torch.arange(4.0)) and loaded["b"][1] == 7 and loaded["c"] == "text"


def test_store_add_file_never_runs_a_pickle_payload(tmp_path: Path) -> None:
    store = SHA1_Store(tmp_path / "store", init=True)
    marker = tmp_path / "PAYLOAD_RAN"
    as_torch_save = tmp_path / "evil.pt"
    torch.save({"w": _Payload(marker)}, as_torch_save)
    as_pickle = tmp_path / "evil.pkl"
    as_pickle.write_bytes(pickle.dumps(_Payload(marker)))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint " * 8)
    for path in (as_torch_save, as_pickle, garbage):
        with pytest.raises(UntrustedContentError, match="incorrect input") as info:
            store.add(path)
        assert isinstance(info.value, AssertionError)  # upstream asserted on plain pickles
        assert "weights_only=True" in str(info.value)
    assert not marker.exists(), "SHA1_Store.add ran code from a checkpoint"


# ------------------------------------------------------------------------------------------ the SHA1 store


def test_store_refuses_links_and_keys_that_lead_outside(tmp_path: Path, outside: Path) -> None:
    before = _snapshot(outside)
    tensor = torch.full((5,), 2.0)
    key = _sha1_of(tensor, tmp_path)

    # A first-level object directory that is a link to a directory outside.
    store = SHA1_Store(tmp_path / "s1", init=True)
    os.symlink(outside, tmp_path / "s1" / key[:2])
    with pytest.raises(UnsafeRepositoryError, match="symbolic link"):
        store.add(tensor)

    # metadata.json is a link to a file outside: adding would overwrite it.
    store = SHA1_Store(tmp_path / "s2", init=True)
    (tmp_path / "s2" / "metadata.json").unlink()
    os.symlink(outside / "store" / "metadata.json", tmp_path / "s2" / "metadata.json")
    with pytest.raises(UnsafeRepositoryError, match="symbolic link"):
        SHA1_Store(tmp_path / "s2").add(tensor)

    # The scratch directory is a link: it used to be wiped and written into.
    SHA1_Store(tmp_path / "s3", init=True)
    os.rmdir(tmp_path / "s3" / "tmp")
    os.symlink(outside, tmp_path / "s3" / "tmp")
    with pytest.raises(UnsafeRepositoryError, match="symbolic link"):
        SHA1_Store(tmp_path / "s3")

    # A hard link planted in the store (metadata.json sharing the outside file's inode): writes replace the file
    # (a new one, renamed over it), so the outside file keeps its content.
    SHA1_Store(tmp_path / "s5", init=True)
    (tmp_path / "s5" / "metadata.json").unlink()
    os.link(outside / "store" / "metadata.json", tmp_path / "s5" / "metadata.json")
    SHA1_Store(tmp_path / "s5").add(tensor)

    # Keys are SHA1s: anything with a path in it is refused by every method, and the file it names stays.
    store = SHA1_Store(tmp_path / "s4", init=True)
    victim = outside / "victim.txt"
    for key in ("..//" + str(victim).lstrip("/"), "../../outside/victim.txt", "0" * 39, "A" * 40):
        for method in (store.get, store.delete, store.size_info, store.names):
            with pytest.raises(ValueError, match="not a SHA1"):
                method(key)
    assert _snapshot(outside) == before


# ------------------------------------------------------------------------------------------ opening a repository


def _fake_wgit(directory: Path) -> None:
    """What Repo recognises as a .wgit directory (the git repository itself is not needed to be refused)."""
    (directory / ".git").mkdir(parents=True)
    (directory / ".gitignore").write_text("sha1_store\n")
    SHA1_Store(directory / "sha1_store", init=True)


def test_repo_refuses_linked_wgit_internals(tmp_path: Path, outside: Path) -> None:
    # .wgit itself is a link to a directory outside (that looks like a repository).
    _fake_wgit(outside / "elsewhere")
    before = _snapshot(outside)
    work = tmp_path / "a"
    work.mkdir()
    os.symlink(outside / "elsewhere", work / ".wgit")
    with pytest.raises(UnsafeRepositoryError, match=r"\.wgit is a symbolic link"):
        Repo(work)
    with pytest.raises(UnsafeRepositoryError, match=r"\.wgit is a symbolic link"):
        Repo(work, init=True)

    # A real .wgit whose SHA1 store is a link to a store outside.
    work = tmp_path / "b"
    (work / ".wgit").mkdir(parents=True)
    (work / ".wgit" / ".git").mkdir()
    (work / ".wgit" / ".gitignore").write_text("sha1_store\n")
    os.symlink(outside / "store", work / ".wgit" / "sha1_store")
    with pytest.raises(UnsafeRepositoryError, match="sha1_store"):
        Repo(work)

    # A link deep inside .wgit/.git (git would write its objects outside).
    work = tmp_path / "c"
    _fake_wgit(work / ".wgit")
    os.symlink(outside, work / ".wgit" / ".git" / "objects")
    with pytest.raises(UnsafeRepositoryError, match="objects"):
        Repo(work)

    # init=True over a half-made .wgit whose .git is a link.
    work = tmp_path / "d"
    (work / ".wgit").mkdir(parents=True)
    os.symlink(outside, work / ".wgit" / ".git")
    with pytest.raises(UnsafeRepositoryError, match=r"\.git"):
        Repo(work, init=True)
    assert _snapshot(outside) == before


def test_repo_refuses_a_metadata_link_to_the_users_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant that overwrote the checkpoint being added: its metadata file was a link to the checkpoint."""
    work = tmp_path / "wgit_testing"
    _fake_wgit(work / ".wgit")
    checkpoint = work / "model.pt"
    torch.save(nn.Linear(2, 2).state_dict(), checkpoint)
    (work / ".wgit" / "wgit_testing").mkdir()
    os.symlink(checkpoint, work / ".wgit" / "wgit_testing" / "model.pt")
    before = _snapshot(work)
    monkeypatch.chdir(work)
    with pytest.raises(UnsafeRepositoryError, match="model.pt"):
        Repo(work).add("model.pt")
    assert _snapshot(work) == before


def test_metadata_path_stays_inside_wgit_when_run_from_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``/`` upstream's rule gave an absolute path, and the metadata overwrote the checkpoint itself."""
    monkeypatch.chdir("/")
    rel = Repo._rel_file_path(Path("/tmp/some/model.pt"))
    assert not rel.is_absolute() and ".." not in rel.parts


# ------------------------------------------------------------------------------------------ end to end (pygit2)


@pytest.fixture
def repo_dir(checkpoint_dir: Path) -> Path:
    """A working directory with one checkpoint and no repository yet (conftest.py)."""
    return checkpoint_dir


def test_wgit_add_never_runs_a_checkpoints_code(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from fairscale.experimental.wgit import cli

    marker = repo_dir.parent / "PAYLOAD_RAN"
    torch.save({"model": {"w": torch.ones(2)}, "extra": _Payload(marker)}, repo_dir / "evil.pt")
    cli.main(["init"])
    cli.main(["add", "checkpoint_0.pt"])
    for argv in (["add", "evil.pt"], ["add", "--no_per_tensor", "evil.pt"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("fatal: ") and "weights_only=True" in err and "Traceback" not in err, err
    assert not marker.exists(), "wgit add ran code from a checkpoint"
    capsys.readouterr()
    cli.main(["status"])
    assert "evil" not in capsys.readouterr().out


def test_wgit_add_refuses_a_planted_link_and_changes_nothing_outside(
    repo_dir: Path, outside: Path, capsys: pytest.CaptureFixture
) -> None:
    from fairscale.experimental.wgit import cli

    cli.main(["init"])
    cli.main(["add", "checkpoint_0.pt"])
    cli.main(["commit", "-m", "first"])
    # Someone swaps the metadata file for a link to a file outside, and the store's object directories too.
    metadata = repo_dir / ".wgit" / "wgit_testing" / "checkpoint_0.pt"
    metadata.unlink()
    os.symlink(outside / "victim.txt", metadata)
    before = _snapshot(outside)
    checkpoint_bytes = (repo_dir / "checkpoint_0.pt").read_bytes()
    with pytest.raises(SystemExit):
        cli.main(["add", "checkpoint_0.pt"])
    assert "symbolic link" in capsys.readouterr().err
    assert _snapshot(outside) == before
    assert (repo_dir / "checkpoint_0.pt").read_bytes() == checkpoint_bytes


def test_planted_names_reach_the_terminal_escaped(repo_dir: Path, outside: Path, capsys: pytest.CaptureFixture) -> None:
    """A planted link whose name holds a terminal escape sequence was written raw in wgit's fatal message (it could
    retitle or clear the user's terminal; security review, session 42)."""
    from fairscale.experimental.wgit import cli

    cli.main(["init"])
    os.symlink(outside / "victim.txt", repo_dir / ".wgit" / "x\x1b]0;PWNED\x07\x1b[2J")
    with pytest.raises(SystemExit):
        cli.main(["status"])
    err = capsys.readouterr().err
    assert "symbolic link" in err and "\x1b" not in err and "\x07" not in err, err
    assert "x\\x1b]0;PWNED\\x07" in err, err


# ------------------------------------------------------------------------------------------ a .git that leads elsewhere


def _redirect_git(how: str, git_dir: Path, outside: Path) -> None:
    """Make ``.wgit/.git`` send git to ``outside`` the way a hostile ``.wgit`` could, with no symbolic link."""
    import pygit2

    victim = outside / "victim"
    pygit2.init_repository(str(victim), False)  # a project repository whose branch wgit must not move
    if how == "commondir":  # a linked-worktree git dir whose refs and objects are the victim's
        shutil.rmtree(git_dir)
        git_dir.mkdir()
        (git_dir / "HEAD").write_text("ref: refs/heads/master\n")
        (git_dir / "commondir").write_text(f"{victim / '.git'}\n")
    elif how == "gitfile":  # the repository moved outside, a "gitdir:" file left in its place
        moved = outside / "moved.git"
        shutil.move(str(git_dir), str(moved))
        pygit2.Repository(str(moved)).config["core.worktree"] = str(git_dir.parent)
        git_dir.write_text(f"gitdir: {moved}\n")
    elif how == "alternates":
        (git_dir / "objects" / "info").mkdir(parents=True, exist_ok=True)
        (git_dir / "objects" / "info" / "alternates").write_text(f"{victim / '.git' / 'objects'}\n")
    elif how == "worktree":
        pygit2.Repository(str(git_dir)).config["core.worktree"] = str(victim)
    elif how == "bare":
        pygit2.Repository(str(git_dir)).config["core.bare"] = True
    elif how == "include":
        (outside / "extra.config").write_text("[user]\n\tname = someone\n")
        with open(git_dir / "config", "a") as f:
            f.write(f"[include]\n\tpath = {outside / 'extra.config'}\n")
    elif how == "excludesfile":  # read by every status and commit: a named pipe there blocked every command
        pygit2.Repository(str(git_dir)).config["core.excludesFile"] = str(outside / "excludes")
    elif how == "hard-linked reflog":  # git appends its reflog in place: through the link, to the outside file
        (outside / "reflog").write_text("victim\n")
        reflog = git_dir / "logs" / "HEAD"
        reflog.parent.mkdir(parents=True, exist_ok=True)
        reflog.unlink(missing_ok=True)
        os.link(outside / "reflog", reflog)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("commondir", "commondir: it names another repository"),
        ("gitfile", r"\.git: it is not a directory"),
        ("alternates", "alternates: it makes git read objects from other repositories"),
        ("worktree", "core.worktree"),
        ("bare", "core.bare"),
        ("include", "includes other configuration files"),
        ("excludesfile", "makes git read other files"),
        ("hard-linked reflog", "is a hard link"),
    ],
)
def test_wgit_refuses_a_git_dir_that_sends_git_elsewhere(
    repo_dir: Path, outside: Path, capsys: pytest.CaptureFixture, how: str, reason: str
) -> None:
    """No link anywhere, yet git would have moved another repository's branch or written its objects."""
    from fairscale.experimental.wgit import cli

    cli.main(["init"])
    _redirect_git(how, repo_dir / ".wgit" / ".git", outside)
    before = _snapshot(outside)
    with pytest.raises(UnsafeRepositoryError, match=reason):
        Repo(repo_dir)
    for argv in (["add", "checkpoint_0.pt"], ["commit", "-m", "by wgit"], ["status"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 1 and err.startswith("fatal: wgit: refusing") and "Traceback" not in err, err
    assert _snapshot(outside) == before


# ------------------------------------------------------------------------------------------ files that block


_FIFO_SCRIPT = """
import os, sys, torch
from pathlib import Path
from fairscale.experimental.wgit.repo import Repo, RepoStatus
from fairscale.experimental.wgit.sha1_store import SHA1_Store

def attempt(label, fn):
    try:
        fn()
        print(label, "accepted")
    except Exception as e:
        print(label, type(e).__name__, "named pipe" in str(e))

root = Path(sys.argv[1])
store = SHA1_Store(root / "store", init=True)
key = store.add(torch.ones(2), compress=False)
obj = root / "store" / key[:2] / key[2:4] / key
obj.unlink()
os.mkfifo(obj)
attempt("object", lambda: store.get(key))
os.unlink(root / "store" / "metadata.json")
os.mkfifo(root / "store" / "metadata.json")
attempt("metadata", lambda: SHA1_Store(root / "store"))
attempt("repo", lambda: Repo(root / "work"))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_named_pipes_are_refused_without_blocking(tmp_path: Path) -> None:
    """A named pipe planted in place of a file wgit reads: opening it for reading used to block forever."""
    _fake_wgit(tmp_path / "work" / ".wgit")
    # Opening a repository checks all of .wgit first (nothing is opened: this cannot block).
    os.mkfifo(tmp_path / "work" / ".wgit" / ".git" / "HEAD")
    with pytest.raises(UnsafeRepositoryError, match=r"\.git/HEAD inside \.wgit is a named pipe \(FIFO\)"):
        check_tree(tmp_path / "work" / ".wgit", ".wgit")
    os.unlink(tmp_path / "work" / ".wgit" / ".git" / "HEAD")
    os.unlink(tmp_path / "work" / ".wgit" / "sha1_store" / "metadata.json")
    os.mkfifo(tmp_path / "work" / ".wgit" / "sha1_store" / "metadata.json")
    # In a child process: without the check it blocks, and only a process can be stopped after a timeout.
    root = str(Path(fairscale.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _FIFO_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=180, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail("wgit blocked reading a named pipe")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [
        "object UnsafeRepositoryError True",
        "metadata UnsafeRepositoryError True",
        "repo UnsafeRepositoryError True",
    ], out.stdout


def test_a_socket_in_the_git_dir_is_accepted(tmp_path: Path) -> None:
    """git's file-system monitor keeps a socket in .git on some systems: opening one fails at once (it cannot block
    as a pipe does), so the tree check lets it pass; reading one as a file is still refused."""
    _fake_wgit(tmp_path / "work" / ".wgit")
    path = tmp_path / "work" / ".wgit" / ".git" / "fsmonitor--daemon.ipc"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        check_tree(tmp_path / "work" / ".wgit", ".wgit")
        with pytest.raises(UnsafeRepositoryError, match="socket"):
            open_regular(path, "the monitor's socket")
    finally:
        server.close()


def test_a_directory_the_tree_check_cannot_list_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory wgit can enter but not list (mode 0300, kept by tar) hid a planted link from the walk, and git wrote
    through it, outside the repository (security review, session 42). Root lists every directory, so the refusal
    of the listing is simulated for one directory."""
    _fake_wgit(tmp_path / "work" / ".wgit")
    hidden = tmp_path / "work" / ".wgit" / ".git" / "logs"
    hidden.mkdir(parents=True)
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        if Path(path) == hidden:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(UnsafeRepositoryError, match="directory wgit cannot list"):
        check_tree(tmp_path / "work" / ".wgit", ".wgit")


# ------------------------------------------------------------------------------------------ memory, time and nesting


def _plant(store_dir: Path, blob: bytes) -> str:
    """``blob`` as an uncompressed object of the store at ``store_dir`` (its key is its SHA1: anyone can name it)."""
    sha1 = hashlib.sha1(blob).hexdigest()
    (store_dir / sha1[:2] / sha1[2:4]).mkdir(parents=True, exist_ok=True)
    (store_dir / sha1[:2] / sha1[2:4] / sha1).write_bytes(blob)
    return sha1


class _Reduce:
    """Pickles as ``func(*args)`` (then ``BUILD`` with ``state``): how a hostile object calls an allowed global."""

    def __init__(self, func: Any, args: Tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> Tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


# A float64 dtype's state naming a subarray of 62,500,000 items: 16 of them make 8 GB.
_SUBARRAY = (3, "<", ("<f8", (62_500_000,)), None, None, -1, -1, 0)
_HUGE = 10**14  # bytes no machine has: the unpatched store raised MemoryError (smaller: it took the memory)


def _hostile_objects() -> Dict[str, Tuple[bytes, str]]:
    """Store objects of a few dozen bytes that made wgit allocate ``_HUGE`` bytes, with the refusal expected."""
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's _reconstruct, at this numpy's module path
    scalar = np.float64(1).__reduce__()[0]  # numpy's scalar, likewise
    size = _HUGE.to_bytes(8, "little")
    return {
        "bytearray(n)": (
            b"\x80\x02cbuiltins\nbytearray\n\x8a\x08" + size + b"\x85R.",
            r"builtins.bytearray\(100000000000000,\): pickle writes bytearray\(bytes\) only",
        ),
        "BINBYTES8": (b"\x80\x04\x8e" + size + b".", "declares 100000000000000 bytes of data, more than"),
        "BYTEARRAY8": (b"\x80\x05\x96" + size + b".", "a bytearray of 100000000000000 bytes"),
        "FRAME": (b"\x80\x04\x95" + size + b".", "declares 100000000000000 bytes of data"),
        "empty array of n items": (
            pickle.dumps(_Reduce(reconstruct, (np.ndarray, (_HUGE,), b"b")), protocol=4),
            "the array would take 100000000000000 bytes",
        ),
        "array of objects": (
            pickle.dumps(_Reduce(reconstruct, (np.ndarray, (_HUGE,), np.dtype(object))), protocol=4),
            "an array of Python objects",
        ),
        "ndarray(shape)": (pickle.dumps(_Reduce(np.ndarray, ((_HUGE,),)), protocol=4), "numpy.ndarray, which wgit"),
        "complex(str)": (pickle.dumps(_Reduce(complex, ("1+2j",)), protocol=4), r"complex\(float, float\) only"),
        # Found by a security review (session 42): numpy's dtype BUILD took any fields, flags and subarray. An object
        # field hidden by flags 0 passed the object check and its pointer came from the file (a segfault when read);
        # a subarray made a 177-byte object an 8 GB array.
        "dtype with a hidden object field": (
            pickle.dumps(
                {
                    "w": _Reduce(
                        scalar,
                        (
                            _Reduce(
                                np.dtype,
                                ("V8", False, True),
                                (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0),
                            ),
                            (0x4141414141414141).to_bytes(8, "little"),
                        ),
                    )
                },
                protocol=4,
            ),
            "structured, subarray or void dtype|plain numeric dtype",
        ),
        "dtype with a subarray": (
            pickle.dumps(
                _Reduce(reconstruct, (np.ndarray, (16,), _Reduce(np.dtype, ("f8", False, True), _SUBARRAY))),
                protocol=4,
            ),
            "plain numeric dtype",
        ),
        "OrderedDict hiding its items": (
            pickle.dumps(_Reduce(collections.OrderedDict, (), {"items": set()}), protocol=4),
            "torch's _metadata only",
        ),
        # Found by a security fuzz (session 46): a dtype BUILT again after an array used it (item size 2**28), then
        # pickle's SETITEM wrote into that array: numpy wrote 2**28 bytes into an 8-byte buffer (a segfault).
        "dtype built again after use": (_dtype_rebuilt_after_use(reconstruct), "sets a dtype's state once"),
        "item assigned into an array": (_array_then(reconstruct, b"K\x00K\x01s"), "assigns items into a numpy"),
        "array of strings": (pickle.dumps(np.array([b"ab"]), protocol=4), "an array of |S2 never comes from a tensor"),
        # The same data repeated through pickle's memo: bytearray(<memoized 100 bytes>) for 5 bytes a copy (2.4 GB
        # from a 1.9 KB compressed object; each call passed the check on its own).
        "bytearray repeated through the memo": (
            b"\x80\x03cbuiltins\nbytearray\nq\x00B"
            + (100).to_bytes(4, "little")
            + b"\0" * 100
            + b"\x85q\x01"
            + b"h\x00h\x01R" * 8
            + b".",
            "its values take more than",
        ),
    }


def _array_then(reconstruct: Any, tail: bytes) -> bytes:
    """A pickle (written by hand, as no pickler writes these) of a 1-item array of d = dtype('f8'), then ``tail``
    with the array on the stack and d in memo 1."""
    module = reconstruct.__module__.encode()
    blob = b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00f8\x89\x88\x87Rq\x01"  # d = dtype('f8', False, True)
    blob += b"c" + module + b"\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"  # an empty array
    blob += b"(K\x01K\x01\x85h\x01\x89C\x08AAAAAAAAtb"  # BUILD it: one item of d
    return blob + tail + b"."


def _dtype_rebuilt_after_use(reconstruct: Any) -> bytes:
    """d BUILT again, with an item size of 2**28, after the array used it."""
    size = (1 << 28).to_bytes(4, "little")
    return _array_then(reconstruct, b"h\x01(K\x03X\x01\x00\x00\x00<NNNJ" + size + b"K\x01K\x00tb0")


@pytest.mark.parametrize("kind", list(_hostile_objects()))
def test_store_get_allocates_no_more_than_the_object_holds(tmp_path: Path, kind: str) -> None:
    """A tiny object called an allowed global (bytearray(n), numpy's empty array) or declared data it does not hold,
    and the store allocated that much (1.2 GB from 35 bytes, or a bare MemoryError)."""
    blob, message = _hostile_objects()[kind]
    store = SHA1_Store(tmp_path / "store", init=True)
    key = _plant(tmp_path / "store", blob)
    assert len(blob) < 200
    with pytest.raises(UntrustedContentError, match=message):
        store.get(key)


def _tuple_tower(depth: int) -> bytes:
    """Protocol 4 pickle opcodes leaving t on the stack, t = (t, t) ``depth`` times from ``()`` (6 bytes a level
    through the memo): hashing it hashes ``2**depth`` tuples, as a tuple's hash is not cached."""
    return b"\x80\x04)\x94" + b"h\x00h\x00\x86q\x00" * depth


_HASH_BOMBS = {
    "dict key (SETITEM)": b"}\x94h\x00K\x01s.",
    "dict key (DICT, protocol 1)": b"(h\x00K\x01d.",
    "set member (ADDITEMS)": b"\x8f(h\x00\x90.",
    "frozenset member (FROZENSET)": b"(h\x00\x91.",
    "set(list) member": b"\x8c\x08builtins\x8c\x03set\x93]h\x00a\x85R.",
    "OrderedDict key": b"\x8c\x0bcollections\x8c\x0bOrderedDict\x93]h\x00K\x01\x86a\x85R.",
}


@pytest.mark.parametrize("kind", list(_HASH_BOMBS))
def test_store_get_refuses_keys_that_take_forever_to_hash(tmp_path: Path, kind: str) -> None:
    """A 400-byte object whose dict key or set member is a tuple shared at every level (60 levels) hashed 2**60
    tuples: store.get never returned (a security fuzz, session 46). Ordinary tuple keys still load."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = _plant(tmp_path / "store", _tuple_tower(60) + _HASH_BOMBS[kind])
    with pytest.raises(UntrustedContentError, match="take more than [0-9]+ steps to hash and compare"):
        store.get(key)
    ordinary = {(i, (str(i), (i,))): {frozenset({(i, i)}), (i, ())} for i in range(500)}
    assert store.get(_plant(tmp_path / "store", pickle.dumps(ordinary, protocol=4))) == ordinary
    # One 20-item key shared through the memo by 1000 dicts (2 bytes a use, 21 steps): what wgit writes, loaded.
    shared = [{tuple(range(20)): i} for i in range(1000)]
    assert store.get(_plant(tmp_path / "store", pickle.dumps(shared, protocol=4))) == shared


def _equal_frozenset_towers(depth: int) -> bytes:
    """Two equal, distinct towers F = frozenset({(F', 0), (F', 1)}) as members of one frozenset: a frozenset caches
    its hash, but the second member is compared with the first member by member, ``2**depth`` steps."""
    towers = []
    for _ in range(2):
        f = frozenset({0})
        for _ in range(depth):
            f = frozenset({(f, 0), (f, 1)})
        towers.append(f)
    body = pickle.dumps(towers, protocol=3)  # b"\x80\x03]q\x00(" <F> <G> b"e."
    return b"\x80\x03(" + body[len(b"\x80\x03]q\x00(") : -2] + b"\x91."


def _rehashed_by_ordered_dict(key_items: int, calls: int) -> bytes:
    """OrderedDict(d) called ``calls`` times on one memoized dict d whose key is a tuple of ``key_items`` zeros."""
    ordered_dict = b"\x8c\x0bcollections\x8c\x0bOrderedDict\x93q\x01"
    key = b"(" + b"K\x00" * key_items + b"tq\x02"
    return b"\x80\x03" + ordered_dict + key + b"}q\x03h\x02K\x00s0" + b"h\x01h\x03\x85R0" * calls + b"N."


def _big_int_key(digit_bytes: int, uses: int) -> bytes:
    """{L: 0} assigned ``uses`` times with L an int of ``digit_bytes`` bytes (its hash reads every digit)."""
    big = b"\x8b" + digit_bytes.to_bytes(4, "little") + b"\x01" * digit_bytes + b"q\x01"  # LONG4, memo 1
    return b"\x80\x03}q\x00(" + big + b"K\x00" + b"h\x01K\x00" * (uses - 1) + b"u."


@pytest.mark.parametrize(
    "kind, blob",
    [
        ("equal frozenset towers", _equal_frozenset_towers(60)),
        ("OrderedDict(a dict) again and again", _rehashed_by_ordered_dict(2000, 20000)),
        ("a big int key used again and again", _big_int_key(100_000, 2000)),
        # All hash to 0 (int hashes are not randomized): each key probes past every earlier one.
        ("keys of one hash", pickle.dumps({k * (2**61 - 1): 0 for k in range(6000)}, protocol=4)),
    ],
)
def test_store_get_refuses_keys_that_take_forever_to_compare(tmp_path: Path, kind: str, blob: bytes) -> None:
    """Work that hashing a tuple once per use did not count (found by a review, session 47): equal frozenset towers
    compared member by member (a 4 KB object never loaded), keys hashed again by OrderedDict(a dict), an int's
    hash reading all its digits at each use."""
    store = SHA1_Store(tmp_path / "store", init=True)
    with pytest.raises(UntrustedContentError, match="steps to hash and compare"):
        store.get(_plant(tmp_path / "store", blob))


def test_store_get_refuses_a_huge_shape_without_multiplying_it(tmp_path: Path) -> None:
    """numpy's _reconstruct with a shape of 1000 copies of one memoized 80,000-bit int: the whole product was worked
    out before the size check (70 s for a 12 KB object), and its message could not be made (an int past 4300 digits
    for str). Refused at once, saying why (found by a review, session 47)."""
    import numpy as np

    module = np.ndarray.__reduce__(np.zeros(1))[0].__module__.encode()
    big = 2**80000 + 1
    digits = big.to_bytes((big.bit_length() + 8) // 8, "little", signed=True)
    blob = (
        b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x0c_reconstruct\x93\x8c\x05numpy\x8c\x07ndarray\x93("
    )
    blob += b"\x8b" + len(digits).to_bytes(4, "little") + digits + b"\x94" + b"h\x00" * 999 + b"tC\x01b\x87R."
    store = SHA1_Store(tmp_path / "store", init=True)
    with pytest.raises(UntrustedContentError, match="the array would take at least more than 2\\*\\*64 bytes"):
        store.get(_plant(tmp_path / "store", blob))


def test_store_get_reads_no_more_than_the_recorded_size(tmp_path: Path) -> None:
    """A compressed object may expand a thousand times: what is read is capped by the size the store records."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add(torch.zeros(64, 64), compress=True)
    assert torch.equal(store.get(key), torch.zeros(64, 64))
    metadata = tmp_path / "store" / "metadata.json"
    data = json.loads(metadata.read_text())
    data[key]["deduped_size"] = 1024  # smaller than the array's 16 KiB
    metadata.write_text(json.dumps(data))
    with pytest.raises(UntrustedContentError, match="bytes left of the 1024 bytes it can hold"):
        store.get(key)


def test_store_keeps_every_value_wgit_writes(tmp_path: Path) -> None:
    """The restricted reader still takes what a checkpoint can hold (torch's weights-only values), in every pickle
    protocol a store may have been written with (the writer uses the default; Python 3.14's is 5)."""
    from fairscale.experimental.wgit.repo import _SHA1_Tensor
    from fairscale.experimental.wgit.store_pickle import load_store_object
    from fairscale.experimental.wgit.sha1_store import _from_np, _to_np

    value: Dict[str, Any] = {
        "w": torch.arange(6.0).reshape(2, 3).t(),
        "e": torch.zeros(0, dtype=torch.int64),
        "flags": torch.ones(2, dtype=torch.bool),
        "z": 1 + 2j,
        "raw": bytearray(b"xy"),
        "tags": {1, 2},
        "shape": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.float16,
        "nested": (1, [torch.ones(1)]),
        "record": _SHA1_Tensor(dense_sha1="a" * 40),
    }
    for protocol in (3, 4, 5):
        blob = pickle.dumps(_to_np(value), protocol=protocol)
        loaded = _from_np(load_store_object(io.BytesIO(blob), "x", hashlib.sha1(blob).hexdigest(), limit=len(blob)))
        assert torch.equal(loaded["w"], value["w"]) and torch.equal(loaded["nested"][1][0], torch.ones(1))
        assert {k: v for k, v in loaded.items() if k not in ("w", "e", "flags", "nested")} == {
            k: v for k, v in value.items() if k not in ("w", "e", "flags", "nested")
        }
    key = SHA1_Store(tmp_path / "store", init=True).add(value)
    assert SHA1_Store(tmp_path / "store").get(key)["record"] == value["record"]


def test_store_get_sets_no_state_on_a_class(tmp_path: Path) -> None:
    """pickle's BUILD with slot state sets attributes on whatever it is given: on the allowed class _SHA1_Tensor, a
    store object replaced its __init__ for the whole process."""
    import numpy as np

    from fairscale.experimental.wgit.repo import _SHA1_Tensor

    store = SHA1_Store(tmp_path / "store", init=True)
    poison = (
        b"\x80\x02cfairscale.experimental.wgit.repo\n_SHA1_Tensor\nN}X\x08\x00\x00\x00__init__cbuiltins\nfrozenset\n"
        b"s\x86b0}."
    )
    record = _SHA1_Tensor()
    record.__setstate__ = frozenset  # type: ignore[attr-defined]  # a later BUILD on it would call frozenset(state)
    extra_field = pickle.dumps(record)
    shared_dtype = pickle.dumps(_Reduce(np.dtype, ("f4", False, False), (3, ">", None, None, None, -1, -1, 0)))
    init = _SHA1_Tensor.__dict__["__init__"]
    try:
        for blob, message in (
            (poison, "the state of the class fairscale.experimental.wgit.repo._SHA1_Tensor"),
            (extra_field, "records have the fields"),
            (shared_dtype, r"dtype\(str, align, True\) only"),
        ):
            with pytest.raises(UntrustedContentError, match=message):
                store.get(_plant(tmp_path / "store", blob))
        assert _SHA1_Tensor(dense_sha1="x").dense_sha1 == "x"
    finally:
        _SHA1_Tensor.__init__ = init  # type: ignore[method-assign]


def _shared_at_every_level(depth: int, leaf: Any) -> List[Any]:
    """``[x, x]`` nested ``depth`` times: ``depth + 1`` lists, ``2**depth`` paths to the leaf."""
    x = [leaf]
    for _ in range(depth):
        x = [x, x]
    return x


def test_store_walks_a_shared_container_once(tmp_path: Path) -> None:
    """_to_np and _from_np walked each path: a list shared at every level (a store object or a checkpoint of a few
    hundred bytes) took 2**depth steps. Each container is now converted once, and stays shared."""
    store = SHA1_Store(tmp_path / "store", init=True)
    key = store.add({"w": _shared_at_every_level(12, torch.ones(2))})
    loaded = store.get(key)["w"]
    lists = []
    while isinstance(loaded, list) and len(loaded) == 2:
        assert loaded[0] is loaded[1]
        lists.append(loaded)
        loaded = loaded[0]
    assert len(lists) == 12 and torch.equal(loaded[0], torch.ones(2))


def test_store_refuses_nesting_too_deep_or_a_cycle(tmp_path: Path) -> None:
    """Lists nested 5000 deep, or inside themselves, raised RecursionError from the store's walks."""
    store = SHA1_Store(tmp_path / "store", init=True)
    deep = b"\x80\x02" + b"]" * 5001 + b"a" * 5000 + b"."
    cycle = b"\x80\x02]q\x00h\x00a."
    for blob, message in ((deep, "nests containers more than 100 deep"), (cycle, "a container inside itself")):
        with pytest.raises(UntrustedContentError, match=message):
            store.get(_plant(tmp_path / "store", blob))
    nested: Any = [torch.ones(1)]
    for _ in range(2000):
        nested = [nested]
    with pytest.raises(ValueError, match="nests containers more than 100 deep"):
        store.add({"w": nested})


def test_wgit_add_walks_a_shared_container_once(repo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per tensor, wgit add walked every path to every element: 2**depth steps for a list shared at every level (a
    checkpoint of 1.6 KB took hours). Each container is now walked once."""
    from fairscale.experimental.wgit import repo as repo_module

    depth = 10
    torch.save({"w": _shared_at_every_level(depth, torch.ones(2))}, repo_dir / "dag.pt")
    repo = Repo(repo_dir, init=True)
    walk = repo_module._recursive_apply_to_elements
    calls = []

    def counting_walk(data: Any, *args: Any) -> None:
        calls.append(id(data))
        walk(data, *args)

    monkeypatch.setattr(repo_module, "_recursive_apply_to_elements", counting_walk)
    returned = repo.add("dag.pt")
    assert returned is not None
    assert len(set(calls)) == depth + 2  # the dict and the lists
    assert len(calls) <= 2 * (depth + 2)  # each reached from each of its (two) parents at most: was 2**(depth + 1)
    assert returned["w"][0] is returned["w"][1]
    state = Repo(repo_dir)._sha1_store.get(
        json.loads((repo_dir / ".wgit" / "wgit_testing" / "dag.pt").read_text())["SHA1"]
    )
    assert state["w"][0] is state["w"][1]  # the metadata stored keeps the sharing


def test_wgit_add_refuses_a_deep_checkpoint_in_one_line(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Lists nested 1000 deep: torch.load accepts them, then copy.deepcopy raised RecursionError (a traceback)."""
    from fairscale.experimental.wgit import cli

    nested: Any = [torch.ones(1)]
    for _ in range(1000):
        nested = [nested]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # torch.save itself recurses
    try:
        torch.save({"w": nested}, repo_dir / "deep.pt")
    finally:
        sys.setrecursionlimit(limit)
    cli.main(["init"])
    with pytest.raises(SystemExit):
        cli.main(["add", "deep.pt"])
    err = capsys.readouterr().err
    assert err.startswith("fatal: incorrect input deep.pt: it nests containers more than 100 deep"), err


# ------------------------------------------------------------------------------------------ metadata a clone holds


def _tracked(repo_dir: Path) -> Path:
    """A repository tracking checkpoint_0.pt; returns its metadata file."""
    from fairscale.experimental.wgit import cli

    cli.main(["init"])
    cli.main(["add", "checkpoint_0.pt"])
    cli.main(["commit", "-m", "first"])
    return repo_dir / ".wgit" / "wgit_testing" / "checkpoint_0.pt"


def _record(metadata: Path, file_path: str) -> None:
    data = json.loads(metadata.read_text())
    data["file_path"] = file_path
    metadata.write_text(json.dumps(data))


def test_status_looks_only_at_checkpoints_inside_the_repository(
    repo_dir: Path, outside: Path, capsys: pytest.CaptureFixture
) -> None:
    """status stat-ed whatever path a (cloned) metadata file named: it told whether /root/... exists."""
    from fairscale.experimental.wgit import cli

    metadata = _tracked(repo_dir)
    os.symlink(outside, repo_dir / "link")
    for path in ("/root", str(outside / "victim.txt"), "../outside/victim.txt", "link/victim.txt"):
        _record(metadata, path)
        if path.startswith("link/"):  # inside, led out by a link: listed (not looked at), the other entries too
            assert Repo(repo_dir).status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_NOT_ADDED}
            assert "the symbolic link" in capsys.readouterr().err
        else:
            with pytest.raises(UnsafeRepositoryError, match="which is outside the repository's directory"):
                Repo(repo_dir).status()
        with pytest.raises(SystemExit):  # and wgit add, which looks for another checkpoint tracked there
            cli.main(["add", "checkpoint_0.pt"])
        assert capsys.readouterr().err.startswith("fatal: wgit: refusing the metadata file")
    _record(metadata, "checkpoint_0.pt")  # inside: looked at, as before (the metadata file itself changed)
    assert Repo(repo_dir).status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED}
    _record(metadata, "gone.pt")
    assert Repo(repo_dir).status() == {"wgit_testing/checkpoint_0.pt": RepoStatus.CHANGES_NOT_ADDED}


def test_status_through_a_link_tells_nothing_about_paths_outside(
    repo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A link ``a -> ../PROBE/../<repo>/checkpoint_0.pt`` resolved inside by realpath (a ``..`` after a missing name is
    read lexically), but the kernel's stat needs PROBE: status told whether PROBE exists (a security fuzz, session 46).
    Links whose every step stays inside are followed as before."""
    metadata = _tracked(repo_dir)
    (repo_dir / "sub").mkdir()
    for target, inside in (
        (f"../PROBE/../{repo_dir.name}/checkpoint_0.pt", False),
        (f"{tmp_path}/PROBE/../{repo_dir.name}/checkpoint_0.pt", False),
        ("sub/../checkpoint_0.pt", True),
        (str(repo_dir.resolve() / "sub" / ".." / "checkpoint_0.pt"), True),
    ):
        (repo_dir / "a").unlink(missing_ok=True)
        (repo_dir / "a").symlink_to(target)
        _record(metadata, "a")
        seen = []
        for probe_exists in (False, True):
            if probe_exists:
                (tmp_path / "PROBE").mkdir()
            seen.append(Repo(repo_dir).status())
            if probe_exists:
                (tmp_path / "PROBE").rmdir()
            assert ("the symbolic link" in capsys.readouterr().err) != inside, target
        expected = RepoStatus.CHANGES_ADDED_NOT_COMMITED if inside else RepoStatus.CHANGES_NOT_ADDED
        assert seen == [{"wgit_testing/checkpoint_0.pt": expected}] * 2, (target, seen)


def test_links_spelled_through_an_alias_of_the_repository_are_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repository below a linked folder (/home -> /nfs/home): a link whose absolute target uses the path the user
    works in (``ln -s "$PWD/ck.pt" latest.pt``), or that steps out and back in by the repository's own name, was
    called linked out by the step-by-step walk (found by a review). Neither makes wgit look outside."""
    (tmp_path / "real" / "repo").mkdir(parents=True)
    (tmp_path / "alias").symlink_to("real")
    logical = tmp_path / "alias" / "repo"
    monkeypatch.chdir(logical)
    monkeypatch.setenv("PWD", str(logical))
    torch.save({"w": torch.ones(2)}, logical / "ck.pt")
    for name, target in (("latest.pt", f"{logical}/ck.pt"), ("back.pt", "../repo/ck.pt")):
        repo = Repo(logical, init=not (logical / ".wgit").exists())
        (logical / name).symlink_to(target)
        repo.add(name)
        repo.commit(name)
        assert set(Repo(logical).status().values()) == {RepoStatus.CLEAN}, (name, Repo(logical).status())
        Repo(logical).add(name)  # a second add looks for another checkpoint tracked there: it follows the link too
        (logical / "sub").mkdir(exist_ok=True)
        real = tmp_path / "real" / "repo"
        # Opened by its resolved path: from elsewhere with the logical spelling given, from the repository with only
        # $PWD logical, from a folder inside it ($PWD's logical parent), and with a stale $PWD (nothing to follow).
        for opened, cwd, pwd, clean in (
            (logical, real, "", True),
            (real, logical, logical, True),
            (real, logical / "sub", logical / "sub", True),
            (real, logical, "/x/y/z", name == "back.pt"),
        ):
            monkeypatch.chdir(cwd)
            monkeypatch.setenv("PWD", str(pwd))
            statuses = set(Repo(str(opened)).status().values())
            assert (statuses == {RepoStatus.CLEAN}) == clean, (name, opened, cwd, pwd, statuses)
        monkeypatch.chdir(logical)
        monkeypatch.setenv("PWD", str(logical))


def test_hostile_metadata_gives_one_line_not_a_traceback(repo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """JSON nested 100000 deep raised RecursionError (status, and add over it); a path of 5000 characters OSError."""
    from fairscale.experimental.wgit import cli

    metadata = _tracked(repo_dir)
    metadata.write_text("[" * 100000 + "]" * 100000)
    assert list(Repo(repo_dir).status()) == ["wgit_testing/checkpoint_0.pt"]  # not wgit's: nothing to compare
    cli.main(["add", "checkpoint_0.pt"])  # not wgit's: written over
    assert json.loads(metadata.read_text())["file_path"] == "checkpoint_0.pt"
    for path, message in (("a" * 5000, "cannot look at the checkpoint path 'aaa"), ("ck\0.pt", "which is not a path")):
        _record(metadata, path)
        capsys.readouterr()
        with pytest.raises(SystemExit):
            cli.main(["status"])
        err = capsys.readouterr().err
        assert err.startswith("fatal: wgit: ") and message in err and len(err) < 600, err
