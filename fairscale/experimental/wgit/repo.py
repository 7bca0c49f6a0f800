# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``Repo``: a wgit repository: checkpoint metadata tracked by git in ``.wgit``, tensors in a SHA1 store.

A repository may come from someone else; what wgit trusts is described in :mod:`fairscale.experimental.wgit.safety`:
it refuses a ``.wgit`` that holds symbolic links, never writes outside ``.wgit``, and loads checkpoints with
``torch.load(weights_only=True)``.
"""

import copy
import json
import os
import reprlib
import stat
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from torch import Tensor

from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

from .add_undo import GIT_EXCLUDED_TMP_RE, REPLACE_TMP_RE, AddUndo, exclude_replace_tmp_files
from .checkpoint_load import load_checkpoint
from .pygit import PyGit, import_pygit2
from .safety import (
    UnsafeRepositoryError,
    check_tree,
    contained,
    open_regular,
    printable,
    replace_file,
    resolve_inside,
)
from .sha1_store import SHA1_Store
from .storable import check_checkpoint_type as _check_checkpoint_type, check_storable

__all__ = ["Repo", "RepoStatus", "SizeInfo"]

SHA1_STORE_DIR_NAME = "sha1_store"
SHA1_KEY = "SHA1"
LAST_MODIFIED_TS_KEY = "last_modified_time_stamp"
REL_PATH_KEY = "file_path"
# Names directly inside .wgit that are wgit's or git's own: a metadata file never goes there.
_RESERVED = frozenset({SHA1_STORE_DIR_NAME, ".git", ".gitignore"})
# Recorded paths in messages: a hostile metadata file may hold one of thousands of characters.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120


@dataclass
class SizeInfo:
    original: int
    deduped: int
    sparsified: int
    gzipped: int


@dataclass
class _SHA1_Tensor:
    """Stands for a tensor stored in the SHA1 store (pickled by this module path)."""

    is_dense: bool = True
    dense_sha1: str = ""
    sst_sha1: str = ""
    dst_sha1: str = ""


class RepoStatus(Enum):
    CLEAN = 1
    CHANGES_NOT_ADDED = 2
    CHANGES_ADDED_NOT_COMMITED = 3


def _recursive_apply_to_elements(
    data: Any, fn: Callable[[Any, str], Any], names: List[str], seen: Optional[Set[int]] = None
) -> None:
    """Replace each element of the dicts and lists in ``data`` (but those) by ``fn(element, its dotted path)``.

    A dict or list reached by several paths (shared) is walked once, by the first (``seen``: ids): a checkpoint that
    shares a list at every level (1.6 KB) took ``2**depth`` steps. The nesting was bounded when the checkpoint was
    loaded (:func:`~fairscale.experimental.wgit.checkpoint_load.load_checkpoint`), so the recursion is too.
    """
    seen = set() if seen is None else seen
    if id(data) in seen:
        return
    seen.add(id(data))
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in list(items):
        path = names + [str(key)]
        if isinstance(value, (dict, list)):
            _recursive_apply_to_elements(value, fn, path, seen)
        else:
            data[key] = fn(value, ".".join(path))


class Repo:
    """A wgit repository at ``parent_dir`` (default: the current directory).

    Args:
        parent_dir (str): where the ``.wgit`` directory is (or will be).
        init (bool): create the repository when none is found.

    Exits with status 1 (after a ``fatal:`` message on stderr) when there is no repository at ``parent_dir``.

    Raises:
        UnsafeRepositoryError: ``.wgit`` is, or holds, a symbolic link (checked before anything is written).
        ImportError: ``pygit2`` is not installed.
    """

    def __init__(self, parent_dir: Union[str, Path] = "", init: bool = False) -> None:
        self._repo_path: Optional[Path] = None
        # Resolved once: a relative parent_dir would otherwise name another directory (another repository, or none)
        # after the program changes its working directory.
        self._wgit_parent = Path(parent_dir).resolve() if parent_dir else Path.cwd()
        # As the user spelled it (absolute, links kept): a checkpoint link's absolute target may use that spelling.
        self._given_parent = Path(os.path.abspath(parent_dir)) if parent_dir else None
        self._dot_wgit_dir_path: Optional[Path] = None
        exists = self._recursive_search(self._wgit_parent)
        if exists and self._repo_path != self._wgit_parent.resolve():
            # A repository found only in an ancestor is refused (upstream's behaviour, through the sanity check
            # below); refused before anything of the ancestor's is opened or written.
            self._sanity_check()
        if not exists and not init:
            sys.stderr.write("fatal: not a wgit repository!\n")
            sys.exit(1)
        dot_wgit = self._wgit_parent.resolve().joinpath(".wgit")
        # Before pygit2 or anything else reads or writes there: a planted link would redirect the writes.
        check_tree(dot_wgit, ".wgit")
        import_pygit2()  # before anything is created on disk: a missing pygit2 leaves no half-made repository
        self._dot_wgit_dir_path = dot_wgit
        store_path = contained(dot_wgit, [SHA1_STORE_DIR_NAME], "the SHA1 store")
        if not exists:
            dot_wgit.mkdir(parents=False, exist_ok=True)
            self._sha1_store = SHA1_Store(store_path, init=True)
            self._pygit = PyGit(dot_wgit, gitignore=[SHA1_STORE_DIR_NAME])
        else:
            self._sha1_store = SHA1_Store(store_path)
            self._pygit = PyGit(dot_wgit)
        self._sanity_check()

    def _recursive_search(self, root: Path) -> bool:
        for directory in [root.resolve()] + list(root.resolve().parents):
            if self._is_valid(directory):
                self._repo_path = directory
                return True
        return False

    @staticmethod
    def _is_valid(directory: Path) -> bool:
        wgit = directory.joinpath(".wgit")
        return wgit.is_dir() and wgit.joinpath(".git").exists() and wgit.joinpath(".gitignore").exists()

    def _sanity_check(self) -> None:
        # A repository found only in an ancestor directory is refused too (upstream's behaviour).
        if not self._is_valid(self._wgit_parent):
            sys.stderr.write("fatal: no wgit repo exists!\n")
            sys.exit(1)

    @property
    def _dot_wgit(self) -> Path:
        if self._dot_wgit_dir_path is None:  # only while __init__ runs
            raise RuntimeError("wgit: the repository is not open")
        return self._dot_wgit_dir_path

    def add(
        self,
        in_file_path: str,
        per_tensor: bool = True,
        gzip: bool = True,
        sparsify: bool = False,
        sparsify_policy: Any = None,
    ) -> Optional[Any]:
        """Track a checkpoint: store it (tensor by tensor when ``per_tensor``) and stage its metadata.

        The checkpoint is loaded with ``torch.load(weights_only=True)``: nothing in it runs. Its modification time is
        taken before it is loaded: a checkpoint rewritten while it is added shows as changed. Everything that can be
        checked is checked before anything is stored (the file name, the checkpoint's type, its tensors' dtypes), and
        an add that fails anyway (e.g. a full disk, git's index locked, Ctrl-C) is rolled back: a metadata file it
        created is removed and one it overwrote gets its bytes back, git's index gets its entry back, and then the
        references it added to the SHA1 store are dropped, so the repository is as before (its ``status`` too). A
        rollback cut short (a second Ctrl-C) leaves at worst unused store references (see
        :mod:`~fairscale.experimental.wgit.add_undo`).

        The metadata records the checkpoint's path relative to the directory that holds ``.wgit``, with the folders
        on its way resolved (a path through a symbolic link to the repository, e.g. ``$PWD/ck.pt``, is recorded as
        inside it), so ``status`` finds it from any directory.

        Returns:
            A copy of the loaded state dict when ``per_tensor``, else ``None``.

        Raises:
            UntrustedContentError: the file is not a ``torch.save`` checkpoint of tensors and plain containers.
            UnsafeRepositoryError: the metadata file (or a directory on its way) is a symbolic link, or would land
                outside ``.wgit`` or in one of its reserved entries.
            FairscaleTypeError: the checkpoint is not a dict (with ``per_tensor``) or not a dict or a tensor
                (without), or holds a tensor that the store cannot keep (e.g. bfloat16) (``AssertionError``).
            FairscaleValueError: the file's name is not UTF-8, the file is not under the directory that holds
                ``.wgit``, or its metadata file already tracks another checkpoint, is in the way of a directory, or
                would never be committed (git ignores it, or it is named ``.git`` or like wgit's temporary files).
        """
        self._sanity_check()
        if sparsify and not per_tensor:
            raise ValueError("Only support sparsity when per_tensor is true")
        file_path = Path(in_file_path)
        _check_utf8(str(in_file_path), "the checkpoint's file name")
        metadata_file = self._metadata_path(self._rel_file_path(self._inside_working_tree(file_path)))
        _check_utf8(str(metadata_file.relative_to(self._dot_wgit)), "its metadata file's name (from its path)")
        self._check_metadata_path_free(metadata_file)
        self._check_git_would_commit(metadata_file)
        self._check_not_tracking_another(metadata_file, file_path)
        recorded = self._recorded_path(file_path)
        # Before loading: a checkpoint rewritten meanwhile must not be recorded with the new file's time.
        mtime = file_path.stat().st_mtime
        checkpoint = load_checkpoint(file_path)
        _check_checkpoint_type(checkpoint, file_path, per_tensor)
        check_storable(checkpoint, str(file_path))
        # One add at a time per repository, its rollback included: a metadata.json written by another add in between
        # was lost (each wrote back the copy it had read), and a rollback must not undo another add's changes.
        with self._sha1_store._writing():
            undo = AddUndo(self._sha1_store, self._pygit, metadata_file, self._dot_wgit)

            def fn(element: Any, name: str) -> Any:
                if not isinstance(element, Tensor):
                    return element
                if sparsify:
                    raise NotImplementedError("sparsified tensors are not supported yet")
                return _SHA1_Tensor(is_dense=True, dense_sha1=undo.store(element, gzip, name))

            try:
                ret_state_dict = None
                if per_tensor:
                    ret_state_dict = copy.deepcopy(checkpoint)
                    _recursive_apply_to_elements(checkpoint, fn, [])
                sha1 = undo.store(checkpoint, gzip)
                undo.make_dirs()
                # Before the metadata file is written: a crash while writing it leaves a temporary file git ignores.
                exclude_replace_tmp_files(self._dot_wgit)
                self._write_metadata(metadata_file, recorded, sha1, mtime)
                self._pygit.add()
            except BaseException as e:  # KeyboardInterrupt too: the store must not keep half an add
                undo.roll_back(e)
                raise
        return ret_state_dict

    def commit(self, message: str) -> None:
        """Commit the staged metadata, and the metadata changes that no add staged.

        Every ``add`` stages all of ``.wgit``; an add killed (SIGKILL, out of memory) after it wrote a metadata file
        and before git wrote its index left that change unstaged: ``status`` called it added, and every commit left it
        out. Such changes (the objects they name are in the store: a killed add keeps its references) are staged
        here, as the next add would, and named on stderr. The store's writers' lock is held meanwhile, so an add
        running in another process is never committed halfway (it may still be rolled back).
        """
        self._sanity_check()
        with self._sha1_store._writing():
            unstaged = [path for path in self._pygit.unstaged() if self._is_metadata_path(path)]
            if unstaged:
                sys.stderr.write(
                    "wgit commit: also staging metadata changes that no wgit add staged (an add that was killed, or "
                    f"a file changed by hand): {printable(', '.join(unstaged))}\n"
                )
                self._pygit.add()
            self._pygit.commit(message)

    @staticmethod
    def _is_metadata_path(rel_path: str) -> bool:
        """Whether ``rel_path`` (git's path, relative to ``.wgit``) can be a metadata file (see ``status``)."""
        parts = rel_path.split("/")
        return parts[0] not in _RESERVED and not REPLACE_TMP_RE.match(parts[-1])

    def status(self) -> Dict[str, RepoStatus]:
        """The status of every tracked file (``{"": CLEAN}`` when nothing is tracked).

        A checkpoint recorded under the repository's directory but reached through a symbolic link leading out of it
        (a folder moved to another disk and linked back) is not looked at: it is listed as ``CHANGES_NOT_ADDED``, and
        a line on stderr names the link and what to do.
        """
        self._sanity_check()
        pygit_status = self._pygit.status()
        files = self._get_metdata_files()
        if not files:
            return {"": RepoStatus.CLEAN}
        result: Dict[str, RepoStatus] = {}
        for metadata_file, is_modified in files.items():
            if is_modified:
                result[metadata_file] = RepoStatus.CHANGES_NOT_ADDED
            elif metadata_file in pygit_status:
                result[metadata_file] = RepoStatus.CHANGES_ADDED_NOT_COMMITED
            else:
                result[metadata_file] = RepoStatus.CLEAN
        return result

    def log(self, file: str) -> None:
        """Print the log header of ``file`` (or of the repository)."""
        self._sanity_check()
        print(f"wgit log of the file: {file}" if file else "wgit log")

    def checkout(self, sha1: str) -> None:
        raise NotImplementedError("wgit checkout is not implemented (upstream's raised NotImplementedError too)")

    def checkout_by_steps(self) -> None:
        raise NotImplementedError

    def size_info(self, path: Optional[str] = None) -> SizeInfo:
        raise NotImplementedError

    def _get_metdata_files(self) -> Dict[str, bool]:
        found: Dict[str, bool] = {}
        for child in sorted(self._dot_wgit.iterdir()):
            if child.name in _RESERVED:
                continue
            # Directly in .wgit too: an add run from deeper than the checkpoint names its metadata "<file>" (upstream's
            # rule); git tracked and committed it, but status never listed it.
            files = sorted(child.rglob("*")) if child.is_dir() else [child]
            # A replace_file temporary file is what a crashed add left, not a metadata file.
            for file in (p for p in files if p.is_file() and not REPLACE_TMP_RE.match(p.name)):
                found[str(file.relative_to(self._dot_wgit))] = self._is_file_modified(file)
        return found

    def _is_file_modified(self, metadata_file: Path) -> bool:
        # open_regular: a named pipe swapped in after the repository was checked would block status forever.
        with open_regular(metadata_file, "a metadata file") as f:
            try:
                metadata = json.load(f)
            except (ValueError, RecursionError):  # not JSON, not UTF-8 or nested too deep: not a file wgit wrote
                return False
        if not isinstance(metadata, dict) or not isinstance(metadata.get(REL_PATH_KEY), str):
            return False  # not a metadata file wgit wrote: nothing to compare
        try:
            st = self._stat_checkpoint(metadata_file, metadata[REL_PATH_KEY])
        except _LinkedOutError as e:
            # The user moved the checkpoint (or its folder) out and linked it back: one such entry made the whole
            # status fail. Listed as moved (not looked at through the link), and said on stderr with what to do.
            key = metadata_file.relative_to(self._dot_wgit).as_posix()
            sys.stderr.write(printable(f"wgit status: {key} is listed as a change not added: {e.reason}") + "\n")
            return True
        if st is None:
            return True  # the tracked checkpoint was deleted or moved: a change not added (git's "deleted")
        return st.st_mtime != metadata.get(LAST_MODIFIED_TS_KEY)

    def _stat_checkpoint(self, metadata_file: Path, recorded: str) -> Optional[os.stat_result]:
        """The ``stat`` of the checkpoint path ``recorded`` in ``metadata_file`` (``None``: it does not exist); see
        :meth:`_checkpoint_location`.

        Raises:
            FairscaleValueError: the system cannot look at it (e.g. a name too long), with the system's reason.
        """
        lexical = self._checkpoint_location(metadata_file, recorded)
        try:
            return lexical.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise FairscaleValueError(
                f"wgit: cannot look at the checkpoint path {_SHORT.repr(recorded)} recorded in {metadata_file}: "
                f"{e.strerror}"
            ) from None

    def _checkpoint_location(self, metadata_file: Path, recorded: str) -> Path:
        """The absolute path of the checkpoint path ``recorded`` in ``metadata_file``, only when it is under the
        directory that holds ``.wgit``.

        A relative path is read against that directory, whatever the current one (``wgit add`` records it so; the
        command line always ran there). A metadata file may come from someone else: stat-ing any path it names would
        tell whether that file exists (``/root/...``); ``wgit add`` records only paths under the repository's
        directory.

        Raises:
            UnsafeRepositoryError: the path is not under the repository's directory, or not a path; the subclass
                ``_LinkedOutError`` when it is, but a symbolic link on its way leads out of it.
        """
        tree = self._wgit_parent.resolve()
        shown = _SHORT.repr(recorded)

        def refuse(why: str) -> UnsafeRepositoryError:
            return UnsafeRepositoryError(
                f"wgit: refusing the metadata file {metadata_file}: it records the checkpoint path {shown}, {why}; "
                f"wgit records, and looks at, checkpoints under {tree} only. Remove that metadata file (or the whole "
                ".wgit directory if you did not create it); if it tracked a checkpoint of yours, add that again"
            )

        if not recorded or "\0" in recorded:
            raise refuse("which is not a path")

        def inside(base: Path) -> Optional[Path]:
            # Lexically first (resolving would lstat outside the tree), then followed within it (a link in the tree
            # may lead out, also through a component outside that the lookup needs and realpath skips).
            lexical = Path(os.path.normpath(base / recorded))
            if tree not in lexical.parents:
                return None
            end, escape = resolve_inside(tree, lexical, aliases)
            return lexical if escape is None and end != tree else None

        aliases = self._tree_aliases(tree)

        here = inside(tree)
        if here is None or not os.path.lexists(here):
            # Older metadata (and upstream's) holds the path relative to where `add` ran: read there, if that names
            # a file in the repository (re-adding the checkpoint records it the new way).
            legacy = inside(Path.cwd())
            if legacy is not None and os.path.lexists(legacy):
                return legacy
        if here is None:
            lexical = Path(os.path.normpath(tree / recorded))
            if tree not in lexical.parents:
                raise refuse("which is outside the repository's directory")
            escape = resolve_inside(tree, lexical, aliases)[1]
            link, target = escape if escape is not None else (lexical, str(tree))  # a link to the directory itself
            raise _LinkedOutError(
                metadata_file,
                f"it records the checkpoint path {shown}, which the symbolic link {link} (to {target}) leads outside "
                f"the repository's directory {tree}; wgit looks at checkpoints under that directory only. Move the "
                f"checkpoint back under it in place of the link, or stop tracking it: remove {metadata_file} and run "
                "wgit commit",
            )
        return here

    def _tree_aliases(self, tree: Path) -> List[Path]:
        """Absolute spellings of the repository's directory ``tree`` (resolved) through links above it, that the user
        gave: the directory passed to ``Repo`` and the shell's logical ``$PWD`` (``/home -> /nfs/home``; macOS's
        ``/var -> /private/var``). ``ln -s "$PWD/ck.pt" latest.pt`` spells its target so. Each is checked to be
        ``tree`` itself; a hostile link spells its own target, never these."""
        candidates = [self._given_parent]
        pwd, cwd = os.environ.get("PWD", ""), Path.cwd()
        if os.path.isabs(pwd):  # the shell's, which may be stale (a program that changed directory): checked below
            logical = Path(pwd)
            if tree == cwd or cwd in tree.parents:
                candidates.append(logical.joinpath(tree.relative_to(cwd)))
            elif tree in cwd.parents:  # run from a folder inside the repository: its logical parents, as `cd ..`
                up = len(cwd.parts) - len(tree.parts)
                if up < len(logical.parts):
                    candidates.append(logical.parents[up - 1])
        aliases: List[Path] = []
        for alias in candidates:
            if alias is None or alias == tree or alias in aliases:
                continue
            try:
                if os.path.samefile(alias, tree):
                    aliases.append(alias)
            except OSError:  # gone, or not a path the system can look at: not an alias
                continue
        return aliases

    def _metadata_path(self, rel_path: Path) -> Path:
        """``.wgit/<rel_path>``, refused if it leaves ``.wgit``, lands on a reserved entry or passes a link."""
        return contained(self._dot_wgit, rel_path.parts, "metadata file", reserved=_RESERVED)

    @staticmethod
    def _write_metadata(metadata_file: Path, recorded: str, sha1: str, mtime: float) -> None:
        """Write the metadata of the checkpoint at ``recorded`` (see :meth:`_recorded_path`), stored as ``sha1``,
        whose ``st_mtime`` was ``mtime`` when loaded."""
        metadata = {
            SHA1_KEY: sha1,
            LAST_MODIFIED_TS_KEY: mtime,
            REL_PATH_KEY: recorded,
        }
        data = json.dumps(metadata, ensure_ascii=False, indent=4).encode("utf-8")
        replace_file(metadata_file, lambda f: f.write(data))

    def _inside_working_tree(self, file_path: Path) -> Path:
        """``file_path``, refused unless it resolves to a file under the directory that holds ``.wgit``.

        Upstream's naming rule (:meth:`_rel_file_path`) keeps the last parts of a path without comparing them with
        the repository's: a checkpoint outside the repository was tracked under the name of another one inside it
        (``/elsewhere/run/ck.pt`` as ``run/ck.pt`` of ``/work/run``), or under a name ``status`` never lists.
        """
        tree = self._wgit_parent.resolve()
        resolved = file_path.resolve()
        if resolved == tree:
            # "add ." was told it is not inside the repository's directory, which it is.
            raise FairscaleValueError(
                f"wgit add: {file_path} is the repository's directory itself, not a checkpoint file: add the checkpoint "
                "files one by one (wgit add <file>)"
            )
        if tree not in resolved.parents:
            raise FairscaleValueError(
                f"wgit add: {file_path} (resolved: {resolved}) is not inside the repository's directory {tree}; "
                "wgit tracks the checkpoints under the directory that holds .wgit: copy or move it there first"
            )
        return file_path

    def _recorded_path(self, file_path: Path) -> str:
        """The path of ``file_path`` (checked by :meth:`_inside_working_tree`) that its metadata records: relative to
        the directory that holds ``.wgit``.

        As given, it was read against the current directory by ``status`` (another one: refused as outside), and a
        path through a link to the repository (``/home`` -> ``/nfs/home``, a shell's ``$PWD``) was refused by every
        later ``status`` and ``add``. The folders are resolved, the file's own name is kept (a link ``latest.pt`` in
        the repository stays tracked as itself); a file reached only through a link from outside is recorded as
        where it resolves to.
        """
        tree = self._wgit_parent.resolve()
        absolute = Path.cwd() / file_path
        folder = Path(os.path.realpath(absolute.parent))
        if absolute.name not in ("", ".", "..") and (folder == tree or tree in folder.parents):
            return str((folder / absolute.name).relative_to(tree))
        return str(Path(os.path.realpath(absolute)).relative_to(tree))

    def _check_metadata_path_free(self, metadata_file: Path) -> None:
        """Refuse, before anything is stored, a metadata file that a tracked file or folder of that name is in the way
        of (a checkpoint ``model`` was tracked, and now ``model/w.pt`` is added, or the reverse)."""
        if metadata_file.is_dir():
            raise FairscaleValueError(
                f"wgit add: its metadata file {metadata_file} is a directory, which holds the metadata of checkpoints "
                "under a folder of that name: a file and a folder of the same name cannot both be tracked"
            )
        for directory in metadata_file.parents:
            if directory == self._dot_wgit:
                break
            if os.path.lexists(directory) and not directory.is_dir():
                raise FairscaleValueError(
                    f"wgit add: its metadata file would go in {directory}, which is the metadata file of a checkpoint "
                    "tracked under that name: a file and a folder of the same name cannot both be tracked"
                )

    def _check_git_would_commit(self, metadata_file: Path) -> None:
        """Refuse, before anything is stored, a metadata file that git would never stage: the add would store the
        checkpoint, and ``status`` would call it clean, yet no commit would hold it."""
        rel = metadata_file.relative_to(self._dot_wgit)
        if ".git" in rel.parts:  # git never tracks an entry of that name, whatever the ignore rules say
            why = "git never tracks a file or folder named .git"
        elif any(GIT_EXCLUDED_TMP_RE.match(part) for part in rel.parts):
            # The first add writes the exclude rule for these names (files and folders), so git's ignore check alone
            # passes the first one.
            why = (
                "a part of it is named like wgit's temporary files ('.<name>.<32 hex digits>.tmp'), which git is told "
                "to ignore"
            )
        elif self._pygit.ignores(rel.as_posix()):
            why = (
                "git ignores that path: a rule in .wgit/.gitignore (its 'sha1_store' entry matches any folder of that "
                "name), in .wgit/.git/info/exclude, or in your global git excludes (core.excludesFile)"
            )
        else:
            return
        raise FairscaleValueError(
            f"wgit add: its metadata file .wgit/{rel.as_posix()} would never be committed: {why}. Rename the "
            "checkpoint (or the folder it is in), or change the ignore rule"
        )

    def _check_not_tracking_another(self, metadata_file: Path, file_path: Path) -> None:
        """Refuse to overwrite the metadata of another checkpoint that the naming rule maps to the same file."""
        if not metadata_file.is_file():
            return
        try:
            with open_regular(metadata_file, "a metadata file") as f:
                tracked = json.load(f).get(REL_PATH_KEY)
        except (ValueError, RecursionError, AttributeError):  # not a metadata file wgit wrote: add writes over it
            return
        if not isinstance(tracked, str):
            return
        # Only a recorded file that is found, and is another file, is another checkpoint.
        st = self._stat_checkpoint(metadata_file, tracked)
        located = self._checkpoint_location(metadata_file, tracked)
        if st is not None and stat.S_ISREG(st.st_mode) and located.resolve() != file_path.resolve():
            raise FairscaleValueError(
                f"wgit add: {file_path} would be tracked in {metadata_file}, which already tracks {tracked}; two "
                "checkpoints whose paths end alike cannot both be tracked from this directory: run wgit from the "
                "repository's directory, or give the checkpoints other names"
            )

    @staticmethod
    def _rel_file_path(filepath: Path) -> Path:
        """The parts of the resolved path from the last part shared in length with the CWD (upstream's rule, which
        never compares the parts: a file in the CWD gives ``<CWD name>/<file>``).

        The root (``/``) is never one of them: from the root directory upstream's rule gave the absolute path of the
        file, and the metadata was written over the checkpoint itself.
        """
        tracking_path = filepath.resolve()
        i = 0
        for i, _ in enumerate(zip(tracking_path.parts, Path.cwd().parts)):
            pass
        return Path(*tracking_path.parts[max(i, 1) :])


class _LinkedOutError(UnsafeRepositoryError):
    """A checkpoint path recorded in ``metadata_file`` is under the repository's directory, but a symbolic link on its
    way leads out of it (e.g. a folder moved to another disk and linked back); ``reason`` says so, and what to do."""

    def __init__(self, metadata_file: Path, reason: str) -> None:
        super().__init__(f"wgit: refusing the metadata file {metadata_file}: {reason}")
        self.reason = reason


def _check_utf8(name: str, what: str) -> None:
    """Refuse a name that is not UTF-8 (Linux allows any bytes): the metadata is UTF-8 JSON, and git's paths too.

    Raises:
        FairscaleValueError: naming it by its ``repr``, before anything is stored.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise FairscaleValueError(
            f"wgit add: {what} {name!r} is not valid UTF-8; wgit records names as UTF-8 (JSON metadata, git): rename "
            "the file (or the folders on its path) first"
        ) from None
