# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What wgit trusts: the paths it writes and the bytes it loads.

A ``.wgit`` directory may come from someone else (a shared drive, an archive, a copied experiment), and so may the
checkpoints one adds. wgit therefore:

* reads and writes only real files inside the repository's ``.wgit`` directory: a symbolic link anywhere inside
  ``.wgit`` (the directory itself, ``.git``, the SHA1 store, its sub-directories, a metadata file), an entry that is
  not a regular file or a directory (a named pipe, whose reading blocks forever, a device, a socket), a ``..`` or
  an absolute part in a path built from stored data, or an object key that is not a SHA1 is refused with
  :class:`UnsafeRepositoryError` before anything is written. So is a ``.git`` that sends git elsewhere (see
  :mod:`fairscale.experimental.wgit.pygit`). Files are replaced (written beside, then renamed), so a hard link
  planted inside ``.wgit`` cannot carry a write to the file it shares with;
* loads checkpoints with ``torch.load(weights_only=True)`` after scanning their pickle
  (:mod:`~fairscale.experimental.wgit.checkpoint_load`, with :mod:`fairscale.internal.pickle_scan`: no hashing
  bombs, no allocation larger than the file, no compressed zip entries), and its own store objects with an unpickler that accepts numpy arrays, plain containers
  and wgit's own record type only, so a file whose pickle would run code is refused with
  :class:`UntrustedContentError` and the code never runs; a store object whose bytes do not hash to its key,
  or a store ``metadata.json`` of the wrong shape, is refused with :class:`CorruptStoreError`;
* allocates no more for a store object than its bytes can hold (its file's size, or the size the store records):
  the unpickler calls its allowed globals only with the arguments pickle writes (``bytearray(n)`` allocated ``n``
  bytes), sizes arrays before numpy makes them, reads no declared length past that size, and sets the state of
  numpy arrays and dtypes, wgit records and OrderedDicts only (pickle's BUILD on an allowed class changed it for the
  whole process);
* walks each container once, however many times it is shared (a list shared at every level made ``2**depth``
  steps), counts the work of hashing a store object's dict keys and set members before Python does it (a tuple
  shared at every level hashed ``2**depth`` tuples: tuples do not cache their hash), and refuses containers nested more than :data:`MAX_NESTING` deep or inside themselves (they reached the
  recursion limit) with :class:`UntrustedContentError`;
* looks at no checkpoint path a metadata file records outside the directory that holds ``.wgit`` (``wgit status``
  told whether ``/root/...`` exists): such a file is refused with :class:`UnsafeRepositoryError`; nor at one whose
  lookup passes outside it through a symbolic link (:func:`resolve_inside`), whatever the link's target ends at.

It does not defend against another process changing ``.wgit`` while wgit runs (a check-then-write race), nor does it
hide the modification time of the files one adds.
"""

import errno
import os
import stat
import uuid
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, FrozenSet, Iterable, Optional, Sequence, Tuple

from fairscale.internal.errors import FairscaleValueError
from fairscale.internal.pickle_scan import MAX_NESTING as MAX_NESTING  # re-exported: wgit's modules import it here
from fairscale.internal.pickle_scan import nesting_problem as _nesting_problem
from fairscale.internal.pickle_scan import printable as printable  # re-exported, as MAX_NESTING
from fairscale.internal.pickle_scan.files import file_kind

__all__ = ["WgitSafetyError", "UnsafeRepositoryError", "UntrustedContentError", "CorruptStoreError"]


class WgitSafetyError(ValueError):
    """Base of wgit's refusals to write or load something (a ``ValueError``)."""


class UnsafeRepositoryError(WgitSafetyError):
    """A path inside ``.wgit`` is a symbolic link or not a regular file, ``.git`` sends git to another repository,
    or a stored path or key (or a checkpoint path a metadata file records) would lead outside the repository."""


class UntrustedContentError(WgitSafetyError, FairscaleValueError):
    """A checkpoint or store object holds something other than tensors and plain containers (it could run code),
    would make wgit allocate more than its bytes hold, or nests its containers too deep or inside themselves.

    Also an ``AssertionError``: upstream rejected such files (plain pickles) with an assert.
    """


class CorruptStoreError(WgitSafetyError, FairscaleValueError):
    """The SHA1 store's bytes are not what wgit wrote: an object that does not hash to its key, or a ``metadata.json``
    that is not valid JSON or not of the shape wgit writes. Also an ``AssertionError``, like the store's other
    refusals of bad metadata."""


_REMOVE_HINT = "remove it (or the whole .wgit directory if you did not create it) and retry"


def unsafe(path: Path, why: str) -> UnsafeRepositoryError:
    """The :class:`UnsafeRepositoryError` refusing ``path`` because ``why`` (what it is, and what it would make wgit
    do), with the promise wgit keeps and what to do."""
    return UnsafeRepositoryError(
        f"wgit: refusing to use {path}: {why}. wgit only reads and writes real files inside the repository's .wgit "
        f"directory; {_REMOVE_HINT}"
    )


def _link_error(path: Path, what: str) -> UnsafeRepositoryError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return unsafe(path, f"{what} is a symbolic link{target}, and a link there could make wgit write outside")


_kind = file_kind  # what an entry of a mode is, for the messages


def _special_error(path: Path, what: str, mode: int) -> UnsafeRepositoryError:
    # wgit never creates these; reading a named pipe blocks until someone writes to it (forever, for a planted one).
    return unsafe(path, f"{what} is {_kind(mode)}, not a regular file, and reading it could block forever")


def check_not_link(path: Path, what: str) -> None:
    """Raise :class:`UnsafeRepositoryError` if ``path`` itself is a symbolic link (dangling or not)."""
    if path.is_symlink():
        raise _link_error(path, what)


def check_tree(root: Path, what: str) -> None:
    """Raise :class:`UnsafeRepositoryError` if anything inside ``root`` (or ``root`` itself) is a symbolic link, a
    named pipe or a device.

    wgit never creates such entries, so one found there was planted (a pipe blocks whoever reads it). Sockets pass:
    git's file-system monitor keeps one in ``.git`` on some systems, and opening a socket fails at once, never blocks
    (:func:`open_regular` refuses it as any other non-regular file). The walk reads directory entries only (no
    ``stat`` per file where the file system reports entry types) and does not follow links. A directory it cannot
    list is refused: one that can be entered but not listed (mode 0300, which tar keeps) hid a planted link from the
    walk, and git then wrote through it, outside the repository (found by a security review, session 42).
    """
    check_not_link(root, what)
    if not root.is_dir():
        return
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as error:
            raise unsafe(
                directory, f"{what} holds a directory wgit cannot list ({error.strerror}), which could hide a link"
            ) from error
        for entry in entries:
            path = Path(entry.path)
            inside = f"{path.relative_to(root)} inside {what}"
            if entry.is_symlink():
                raise _link_error(path, inside)
            if entry.is_dir(follow_symlinks=False):
                pending.append(path)
            elif not entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode
                if not stat.S_ISSOCK(mode):
                    raise _special_error(path, inside, mode)
            elif (
                path.relative_to(root).parts[:2] == (".git", "logs") and entry.stat(follow_symlinks=False).st_nlink > 1
            ):
                # git appends to its reflogs in place (wgit's own files are replaced): a hard link carried that write
                # to a file outside the repository (a security fuzz, session 46).
                raise unsafe(path, f"{inside} is a hard link, through which git's log writes would reach another file")


def open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` opened for binary reading, refused with :class:`UnsafeRepositoryError` unless it is a regular file.

    Checked before opening (``lstat``: nothing is opened for a link, a named pipe or a device) and again on the open
    file: it is opened without following a final link and without waiting for a pipe's writer, then ``fstat``-ed, so
    an entry swapped in between is refused too, and never blocks.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsafeRepositoryError: ``path`` is a symbolic link or not a regular file.
    """
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _link_error(path, what)
    if not stat.S_ISREG(mode):
        raise _special_error(path, what, mode)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link swapped in after the lstat
            raise _link_error(path, what) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _special_error(path, what, mode)
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def contained(root: Path, parts: Iterable[str], what: str, reserved: FrozenSet[str] = frozenset()) -> Path:
    """``root`` joined with ``parts``, refusing any part that leaves ``root`` and any link on the way.

    Args:
        root (Path): a directory the caller trusts (already checked not to be a link).
        parts (Iterable[str]): relative path components, e.g. from stored data; none may be empty, ``.``, ``..``,
            absolute or contain a separator.
        what (str): what the path is, for the messages.
        reserved (FrozenSet[str]): first components that are refused (e.g. ``.git`` for a metadata file).

    Raises:
        UnsafeRepositoryError: a bad part, a reserved first part, or an existing component that is a link.
    """
    path = root
    parts = list(parts)
    if not parts:
        raise UnsafeRepositoryError(f"wgit: {what}: an empty path inside {root}")
    for i, part in enumerate(parts):
        if part in ("", ".", "..") or os.sep in part or (os.altsep and os.altsep in part) or "\0" in part:
            raise UnsafeRepositoryError(
                f"wgit: refusing {what} {'/'.join(parts)!r}: the part {part!r} would lead outside {root}"
            )
        if i == 0 and part in reserved:
            raise UnsafeRepositoryError(
                f"wgit: refusing {what} {'/'.join(parts)!r}: it would land in {root / part}, which wgit keeps for "
                "itself (run wgit from a directory with another name)"
            )
        path = path / part
        if path.is_symlink():
            raise _link_error(path, what)
    return path


# The kernel's limit on symbolic links followed in one lookup (Linux: 40); past it the lookup fails with ELOOP.
_MAX_LINK_HOPS = 40


def resolve_inside(root: Path, path: Path, aliases: Sequence[Path] = ()) -> Tuple[Path, Optional[Tuple[Path, str]]]:
    """Follow ``path`` (absolute, lexically under the resolved directory ``root``) as the kernel's lookup would, without
    looking at anything outside ``root``.

    ``os.path.realpath`` reads a ``..`` after a missing component lexically while the kernel needs that component: a
    link ``a -> ../PROBE/../tree/b`` resolved inside, yet a ``stat`` through it told whether ``PROBE`` exists (a
    security fuzz, session 46). Here every step that leaves ``root`` stops the walk, but two that come straight back
    without looking outside: an absolute link target spelled with ``root`` or one of ``aliases`` (other absolute
    spellings of ``root`` that the caller checked), and ``..`` out of ``root`` followed by ``root``'s own name.

    Returns:
        ``(end, None)``: the lookup stays inside ``root``; ``end`` is where it ends, with the components after one
        that does not exist (or is no directory, or past too many links) joined unresolved, as the kernel's lookup
        fails there. ``(path, (link, target))``: following the symbolic link ``link`` (whose target, as written, is
        ``target``) would leave ``root``.
    """
    pending = list(path.relative_to(root).parts)
    current, hops, link = root, 0, None
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if current == root:
                if pending and pending[0] == root.name:  # out and straight back in (`../repo/ck.pt`)
                    del pending[0]
                    continue
                return path, (link if link is not None else (path, ".."))
            current = current.parent
            continue
        step = current / part
        try:
            mode = os.lstat(step).st_mode
        except OSError:  # missing, or not a directory on the way: the lookup stops here
            return step.joinpath(*pending), None
        if stat.S_ISLNK(mode):
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return step.joinpath(*pending), None
            target = os.readlink(step)
            link = (step, target)
            target_parts = Path(target).parts
            if os.path.isabs(target):
                # Only a target spelled under ``root`` (or an alias of it) is followed: any other starts outside it.
                spelled = [a for a in (root, *aliases) if target_parts[: len(a.parts)] == a.parts]
                if not spelled:
                    return path, link
                current, target_parts = root, target_parts[len(spelled[0].parts) :]
            pending[:0] = target_parts
            continue
        if pending and not stat.S_ISDIR(mode):
            return step.joinpath(*pending), None
        current = step
    return current, None


def replace_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write a new file at ``path`` through ``write(f)``: into a fresh file beside it, then renamed over it.

    The rename replaces the directory entry, so whatever ``path`` was before (a hard link to a file elsewhere, a
    half-written file) is not written into; a failed write leaves the old file as it was.
    """
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as f:  # "x": never an existing file
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def nesting_problem(obj: Any) -> Optional[str]:
    """What is wrong with how ``obj``'s containers nest (``None``: nothing), worded to follow "it" and for wgit
    (:func:`fairscale.internal.pickle_scan.nesting_problem`): deeper than :data:`MAX_NESTING`, or a container inside
    itself."""
    return _nesting_problem(obj, "wgit")


def check_sha1(sha1: Any) -> Optional[str]:
    """``None`` if ``sha1`` is 40 lowercase hex digits, else what is wrong with it (for the caller's message)."""
    if not isinstance(sha1, str):
        return f"not a SHA1 (a {type(sha1).__name__})"
    if len(sha1) != 40 or any(c not in "0123456789abcdef" for c in sha1):
        return f"{sha1!r} is not a SHA1 (40 lowercase hex digits)"
    return None
