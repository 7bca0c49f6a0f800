# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How wgit loads a checkpoint one adds: scanned, then ``torch.load(weights_only=True)`` (see :mod:`.safety`).

torch's weights-only loader runs no code, but it does what the file's pickle says with the calls it allows: it hashes
whatever dict keys the pickle builds (a tuple shared at every level as a key hashed ``2**depth`` tuples: ``wgit add``
of a 500-byte file never returned) and calls the legacy tensor constructors with the sizes the file gives
(``torch.FloatTensor(2**30)`` allocated 4 GB for a 100-byte file). So the pickle is first walked by a scanner
(:mod:`.checkpoint_scan`) that builds nothing but its containers, and lets through only the calls torch.save writes
for dense tensors, each counted against the file's size.
"""

import os
import pickle
import stat
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Dict, Tuple

import torch

from fairscale.internal.errors import FairscaleValueError

from .checkpoint_scan import CheckpointScanner
from .safety import UntrustedContentError, _kind, nesting_problem, printable
from .store_pickle import PICKLE_ERRORS, _HashingReader

__all__ = ["load_checkpoint"]


def load_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, after :func:`scan_checkpoint`; a file either refuses raises
    :class:`UntrustedContentError`, and so does one whose containers nest too deep or hold themselves
    (:func:`nesting_problem`).

    The message keeps upstream's leading ``"incorrect input"`` (its store rejected plain pickles with an assert).
    """
    try:
        with _open_checkpoint(path) as f, warnings.catch_warnings():
            # torch warns about the pickle protocol of files it then refuses (the error says what matters), and about
            # its typed storages, which the scan names.
            warnings.simplefilter("ignore")
            scan_checkpoint(f, os.fstat(f.fileno()).st_size)
            f.seek(0)
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise  # a missing or unreadable file: the system's error names it
    except FairscaleValueError as e:
        if isinstance(e, UntrustedContentError):  # the scan's refusal, named like torch's below
            raise UntrustedContentError(f"incorrect input {path}: {e}. {_WHAT_TO_ADD}") from None
        raise  # not a regular file: _open_checkpoint says so
    except Exception as e:  # noqa: B902  # whatever torch.load raises on a bad file, the file is refused
        raise UntrustedContentError(f"incorrect input {path}: {_torch_refusal(e)}. {_WHAT_TO_ADD}") from None
    # torch's loader builds any nesting without recursing; wgit's walks (and copy.deepcopy, pickle) recurse.
    problem = nesting_problem(obj)
    if problem is not None:
        raise UntrustedContentError(
            f"incorrect input {path}: it {problem}. wgit stores checkpoints of tensors in dicts and lists nested a few "
            "levels deep, none inside itself"
        )
    return obj


_WHAT_TO_ADD = (
    "wgit loads checkpoints with torch.load(weights_only=True) and never runs code from them: add files written by "
    "torch.save of tensors, dicts and lists (e.g. torch.save(model.state_dict(), path))"
)


def _open_checkpoint(path: Path) -> BinaryIO:
    """``path`` opened for binary reading, refused with ``FairscaleValueError`` unless it is a regular file.

    A checkpoint is the user's own file, so a link to one is followed (unlike entries inside ``.wgit``); but a named
    pipe, a device or a socket is refused: ``torch.load`` on a named pipe blocked ``wgit add`` forever. It is opened
    without waiting for a pipe's writer and checked on the open file, so an entry swapped in meanwhile is refused too.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FairscaleValueError(
                f"incorrect input {path}: it is {_kind(mode)}, not a regular file; wgit adds checkpoint files "
                "written by torch.save"
            )
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def _torch_refusal(error: BaseException) -> str:
    text = str(error)
    marker = "GLOBAL "
    if marker in text:
        name = text.split(marker, 1)[1].split()[0]
        return f"it holds {name}, which is not a tensor or a plain container"
    if "Unsupported operand" in text:  # torch's weights-only loader knows the opcodes protocol 2 writes, mostly
        return (
            "it uses a pickle opcode torch's weights-only loader does not read (a pickle_protocol other than "
            "torch.save's default 2, or an int too large for it); save with the default protocol, tensors and plain "
            "values"
        )
    if isinstance(error, pickle.UnpicklingError):
        return "not a torch.save checkpoint of tensors and plain containers (a plain pickle, or other objects)"
    first = text.strip().splitlines()[0][:160] if text.strip() else type(error).__name__
    return f"not a readable torch.save checkpoint ({first})"


def scan_checkpoint(f: BinaryIO, size: int) -> None:
    """Walk the pickle(s) torch's loader would run on ``f`` (``size`` bytes) without building their tensors
    (:class:`~.checkpoint_scan.CheckpointScanner`).

    A zip checkpoint (what ``torch.save`` writes; torch takes a file for one when it starts with a zip entry) has one
    pickle, ``<archive>/data.pkl``, and stores its entries uncompressed; a legacy one
    (``_use_new_zipfile_serialization=False``) is five pickles in a row: a magic number, the protocol, the system's
    sizes, the objects, and the list of storage keys, followed by the storages' bytes.

    Raises:
        UntrustedContentError: the pickle's dict keys and set members take more hashing than its bytes can hold, a
            call would allocate or copy more than the file holds, it calls what torch.save never writes for dense
            tensors, a zip entry is compressed or ambiguous, or the bytes are not such a checkpoint.
    """
    storage_keys: Dict[str, Tuple[int, int]] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's typed storage classes warn when the scan reads their dtype
            f.seek(0)
            if f.read(4) == b"PK\x03\x04":  # torch.serialization's test: not zipfile's, which finds a zip anywhere
                _check_zip_directory(f, size)
                f.seek(0)
                with zipfile.ZipFile(f) as archive:
                    entry = _data_pkl_entry(archive)
                    with archive.open(entry) as pickled:
                        CheckpointScanner(_HashingReader(pickled, entry.file_size), size, storage_keys).load()
                    _check_storage_records(archive, entry.filename[: -len("data.pkl")], storage_keys)
                return
            f.seek(0)
            _refuse_tar_header(f.read(512))
            f.seek(0)
            reader = _HashingReader(f, size)
            for _ in range(4):
                CheckpointScanner(reader, size, storage_keys).load()
            keys = CheckpointScanner(reader, size, storage_keys).load()
    except UntrustedContentError:
        raise
    except (*PICKLE_ERRORS, zipfile.BadZipFile) as e:
        raise UntrustedContentError(f"not a readable torch.save checkpoint ({str(e)[:160] or type(e).__name__})")
    # torch looks each key up among the storages it loaded (keys other than strings, a tuple tower, hashed forever)
    # and fills those only: a storage left out kept the uninitialized memory torch allocated for it (a review).
    if not isinstance(keys, list) or not all(type(k) is str for k in keys) or sorted(keys) != sorted(storage_keys):
        raise UntrustedContentError(
            "its list of storage keys is not the list of the storages its objects use, as torch.save writes it"
        )


def _refuse_tar_header(block: bytes) -> None:
    """torch's loader first tries a file that is not a zip as a tar archive (checkpoints of torch < 0.4): Python's
    tarfile then parsed a header the file planted, quadratic in its extended header's size in some releases (a 400
    KB file kept ``wgit add`` busy for minutes; a review, session 48). torch.save writes no tar header."""
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")  # this block only: nothing after it is read
    except tarfile.HeaderError:
        return
    raise UntrustedContentError("it starts with a tar header (torch's loader would parse it); torch.save writes none")


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: signature, disks and counts, size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, counts, directory size and offset


def _check_zip_directory(f: BinaryIO, size: int) -> None:
    """Refuse a zip whose central directory Python's zipfile and torch's reader (miniz) could find apart.

    zipfile looks for the directory just before the end record and shifts every entry by the difference from the
    offset recorded; miniz reads it at the recorded offset. A file with a second directory hidden in the end record's
    comment showed zipfile a harmless data.pkl and torch another one (a review, session 48). torch.save writes no
    comment, and the directory right where the (zip64) end record says.
    """
    if size < _EOCD.size:
        raise UntrustedContentError("it is a zip file too short to hold its directory")
    f.seek(size - _EOCD.size)
    signature, _, _, _, _, dir_size, dir_offset, comment = _EOCD.unpack(f.read(_EOCD.size))
    end = size - _EOCD.size  # where the directory must end: at the (zip64) end record
    if signature != b"PK\x05\x06" or comment:
        raise UntrustedContentError(
            "its zip end record is not at its end, or carries a comment; torch.save writes none"
        )
    if size >= _EOCD.size + _ZIP64_LOCATOR.size:
        f.seek(end - _ZIP64_LOCATOR.size)
        locator, _, record_at, _ = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
        if locator == b"PK\x06\x07":
            if record_at + _ZIP64_EOCD.size != end - _ZIP64_LOCATOR.size:
                raise UntrustedContentError("its zip64 end record is not where its locator says")
            f.seek(record_at)
            fields = _ZIP64_EOCD.unpack(f.read(_ZIP64_EOCD.size))
            if fields[0] != b"PK\x06\x06":
                raise UntrustedContentError("its zip64 end record is damaged")
            dir_size, dir_offset, end = fields[-2], fields[-1], record_at
    if dir_offset + dir_size != end:
        raise UntrustedContentError(
            "its zip directory is not where its end record says (two readers would read different entries)"
        )


def _check_entry(entry: zipfile.ZipInfo) -> None:
    """Refuse an entry that torch's reader (miniz) takes otherwise than zipfile: one zipfile renames from an extra
    field (the Unicode path, from Python 3.12: miniz reads the raw name, so the two read different data.pkl entries),
    one marked a directory (miniz extracts nothing into the buffer it allocated: torch unpickled uninitialized
    memory), an encrypted one (a review, session 48). torch.save writes plain files with no extra field but zip64's."""
    extra, ids = entry.extra, []
    while len(extra) >= 4:
        kind, length = struct.unpack("<HH", extra[:4])
        ids.append(kind)
        extra = extra[4 + length :]
    shown = printable(entry.filename[:80])
    if any(kind != 0x0001 for kind in ids) or extra:
        raise UntrustedContentError(f"its zip entry {shown!r} carries extra fields torch.save never writes")
    if entry.filename.endswith("/") or entry.external_attr & 0x10 or entry.flag_bits & 0x1:
        raise UntrustedContentError(f"its zip entry {shown!r} is a directory or encrypted; torch.save writes files")


def _check_storage_records(archive: zipfile.ZipFile, prefix: str, storages: Dict[str, Tuple[int, int]]) -> None:
    """Each storage the pickle names is the record ``<archive>/data/<key>`` of the size it declares (torch reads that
    record into a storage of that size)."""
    sizes = {e.filename: e.file_size for e in archive.infolist()}
    for key, (_, nbytes) in storages.items():
        found = sizes.get(f"{prefix}data/{key}")
        if found != nbytes:
            got = "no such record" if found is None else f"a record of {found} bytes"
            raise UntrustedContentError(f"its storage {printable(key[:40])!r} declares {nbytes} bytes, with {got}")


def _data_pkl_entry(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The entry torch's reader takes for the pickle: ``data.pkl`` in the first entry's folder, found whatever its
    case; refused when another reader could take another entry (names equal but for case, data before the first
    entry, compressed entries: torch inflates them whole)."""
    entries = archive.infolist()
    for e in entries:
        _check_entry(e)
    lowered = [e.filename.lower() for e in entries]
    if not entries or len(set(lowered)) != len(lowered):
        raise UntrustedContentError("it is a zip file with no entries, or two entries of one name (ignoring case)")
    if min(e.header_offset for e in entries) != 0:
        raise UntrustedContentError("it is a zip file with data before its first entry; torch.save writes none")
    packed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise UntrustedContentError(
            f"its entry {printable(packed.filename)!r} is compressed; torch.save stores its entries uncompressed"
        )
    wanted = entries[0].filename.split("/", 1)[0].lower() + "/data.pkl"
    matches = [e for e, name in zip(entries, lowered) if name == wanted]
    if len(matches) != 1 or sum(name.endswith("data.pkl") for name in lowered) != 1:
        raise UntrustedContentError("it is a zip file without the one <archive>/data.pkl that torch.save writes")
    return matches[0]
