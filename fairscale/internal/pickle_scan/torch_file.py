# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Loading a ``torch.save`` file that may come from someone else: scanned, then ``torch.load(weights_only=True)``.

torch's weights-only loader runs no code, but it does what the file's pickle says with the calls it allows: it hashes
whatever dict keys the pickle builds (a tuple shared at every level as a key hashed ``2**depth`` tuples: a load of a
500-byte file never returned) and calls the legacy tensor constructors with the sizes the file gives
(``torch.FloatTensor(2**30)`` allocated 4 GB for a 100-byte file). So the pickle is first walked by a scanner
(:mod:`.torch_scan`) that builds nothing but its containers, and lets through only the calls torch.save writes
for dense tensors, each counted against the file's size (:func:`scan_torch_save`); :func:`load_torch_file` scans, then
loads.
"""

import io
import os
import struct
import tarfile
import warnings
import zipfile
from typing import Any, BinaryIO, Dict, Optional, Tuple, Type, Union

import torch

from .errors import PickleScanError, UnreadableFileError
from .files import open_regular_file
from .nesting import nesting_problem
from .reader import PICKLE_ERRORS, HashingReader
from .text import printable
from .torch_scan import TorchSaveScanner

__all__ = ["load_torch_file", "scan_torch_save"]


def load_torch_file(
    source: Union[str, "os.PathLike[str]", BinaryIO], what: Optional[str] = None, map_location: Any = "cpu"
) -> Any:
    """``torch.load(source, map_location=map_location, weights_only=True)``, after :func:`scan_torch_save` of all of
    it; a loaded object whose containers nest too deep or hold themselves (:func:`~.nesting.nesting_problem`) is
    refused too.

    Args:
        source: a path (of a regular file: a named pipe, a device or a socket is refused before it is read) or a
            binary file object holding the file from its start (``io.BytesIO`` too).
        what (Optional[str]): the file as the messages name it (the path, by default; ``"a file"`` for an object).
        map_location (Any): ``torch.load``'s (``None``: each tensor on the device it was saved from).

    Raises:
        UnreadableFileError: the bytes are no readable ``torch.save`` file (truncated, corrupt, another format).
        PickleScanError: the scan refuses the file (the message names ``what``, ``reason`` says why alone).
        OSError: a path that cannot be opened or read.
        Exception: whatever ``torch.load`` raises on a file the scan passed (torch refuses a name it does not allow).
    """
    if not isinstance(source, (str, os.PathLike)):
        return _scanned_load(source, what if what is not None else "a file", map_location)
    shown = what if what is not None else printable(os.fspath(source))
    try:
        f = open_regular_file(source)
    except PickleScanError as e:
        raise type(e)(e.reason, shown) from None
    with f:
        return _scanned_load(f, shown, map_location)


def _scanned_load(f: BinaryIO, what: str, map_location: Any) -> Any:
    with warnings.catch_warnings():
        # torch warns about the pickle protocol of files it then refuses (the error says what matters), and about its
        # typed storages, which the scan names.
        warnings.simplefilter("ignore")
        f.seek(0, io.SEEK_END)
        try:
            scan_torch_save(f, f.tell())
        except PickleScanError as e:
            raise type(e)(e.reason, what) from None
        f.seek(0)
        obj = torch.load(f, map_location=map_location, weights_only=True)
    # torch's loader builds any nesting without recursing; walks of the result (copy.deepcopy, pickle) recurse.
    problem = nesting_problem(obj)
    if problem is not None:
        raise PickleScanError(f"it {problem}", what)
    return obj


def scan_torch_save(f: BinaryIO, size: int, scanner: Type[TorchSaveScanner] = TorchSaveScanner) -> None:
    """Walk the pickle(s) torch's loader would run on ``f`` (``size`` bytes) without building their tensors
    (``scanner``: :class:`~.torch_scan.TorchSaveScanner`, or a subclass of it that words its refusals otherwise).

    A zip checkpoint (what ``torch.save`` writes; torch takes a file for one when it starts with a zip entry) has one
    pickle, ``<archive>/data.pkl``, and stores its entries uncompressed; a legacy one
    (``_use_new_zipfile_serialization=False``) is five pickles in a row: a magic number, the protocol, the system's
    sizes, the objects, and the list of storage keys, followed by the storages' bytes.

    Raises:
        PickleScanError: the pickle's dict keys and set members take more hashing than its bytes can hold, a
            call would allocate or copy more than the file holds, it calls what torch.save never writes for dense
            tensors, or a zip entry is compressed or ambiguous. Its ``reason`` (and message) follows "it".
        UnreadableFileError: the bytes are not such a checkpoint (truncated, corrupt, another format).
    """
    if size == 0:  # said plainly (it read as a pickle that "declares 1 bytes of data, more than the 0 bytes left")
        raise UnreadableFileError("it is empty (0 bytes): not a torch.save checkpoint")
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
                        # torch's reader checks no CRC, and torch.save writes 0 when told not to compute one
                        # (torch.serialization.set_crc32_options(False)): zipfile's check refused such files (a review,
                        # session 50). The scan reads what torch would read, no more.
                        if hasattr(pickled, "_expected_crc"):
                            pickled._expected_crc = None
                        scanner(HashingReader(pickled, entry.file_size), size, storage_keys).load()
                    _check_storage_records(archive, entry.filename[: -len("data.pkl")], storage_keys)
                return
            f.seek(0)
            _refuse_tar_header(f.read(512))
            f.seek(0)
            reader = HashingReader(f, size)
            for _ in range(4):
                scanner(reader, size, storage_keys).load()
            keys = scanner(reader, size, storage_keys).load()
    except PickleScanError:
        raise
    except (*PICKLE_ERRORS, zipfile.BadZipFile) as e:
        raise UnreadableFileError(f"not a readable torch.save checkpoint ({str(e)[:160] or type(e).__name__})")
    # torch looks each key up among the storages it loaded (keys other than strings, a tuple tower, hashed forever)
    # and fills those only: a storage left out kept the uninitialized memory torch allocated for it (a review).
    if not isinstance(keys, list) or not all(type(k) is str for k in keys) or sorted(keys) != sorted(storage_keys):
        raise PickleScanError(
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
    raise PickleScanError("it starts with a tar header (torch's loader would parse it); torch.save writes none")


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
        raise UnreadableFileError("it is a zip file too short to hold its directory")
    f.seek(size - _EOCD.size)
    signature, _, _, _, _, dir_size, dir_offset, comment = _EOCD.unpack(f.read(_EOCD.size))
    end = size - _EOCD.size  # where the directory must end: at the (zip64) end record
    if signature != b"PK\x05\x06" or comment:  # no end record: cut short; a comment: planted
        raise (PickleScanError if comment and signature == b"PK\x05\x06" else UnreadableFileError)(
            "its zip end record is not at its end, or carries a comment; torch.save writes none"
        )
    if size >= _EOCD.size + _ZIP64_LOCATOR.size:
        f.seek(end - _ZIP64_LOCATOR.size)
        locator, _, record_at, _ = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
        if locator == b"PK\x06\x07":
            if record_at + _ZIP64_EOCD.size != end - _ZIP64_LOCATOR.size:
                raise PickleScanError("its zip64 end record is not where its locator says")
            f.seek(record_at)
            fields = _ZIP64_EOCD.unpack(f.read(_ZIP64_EOCD.size))
            if fields[0] != b"PK\x06\x06":
                raise PickleScanError("its zip64 end record is damaged")
            dir_size, dir_offset, end = fields[-2], fields[-1], record_at
    if dir_offset + dir_size != end:
        raise PickleScanError(
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
        raise PickleScanError(f"its zip entry {shown!r} carries extra fields torch.save never writes")
    if entry.filename.endswith("/") or entry.external_attr & 0x10 or entry.flag_bits & 0x1:
        raise PickleScanError(f"its zip entry {shown!r} is a directory or encrypted; torch.save writes files")


def _check_storage_records(archive: zipfile.ZipFile, prefix: str, storages: Dict[str, Tuple[int, int]]) -> None:
    """Each storage the pickle names is the record ``<archive>/data/<key>`` of the size it declares (torch reads that
    record into a storage of that size)."""
    sizes = {e.filename: e.file_size for e in archive.infolist()}
    for key, (_, nbytes) in storages.items():
        found = sizes.get(f"{prefix}data/{key}")
        if found != nbytes:
            got = "no such record" if found is None else f"a record of {found} bytes"
            raise PickleScanError(f"its storage {printable(key[:40])!r} declares {nbytes} bytes, with {got}")


def _data_pkl_entry(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The entry torch's reader takes for the pickle: ``data.pkl`` in the first entry's folder, found whatever its
    case; refused when another reader could take another entry (names equal but for case, data before the first
    entry, compressed entries: torch inflates them whole)."""
    entries = archive.infolist()
    for e in entries:
        _check_entry(e)
    lowered = [e.filename.lower() for e in entries]
    if not entries or len(set(lowered)) != len(lowered):
        raise PickleScanError("it is a zip file with no entries, or two entries of one name (ignoring case)")
    if min(e.header_offset for e in entries) != 0:
        raise PickleScanError("it is a zip file with data before its first entry; torch.save writes none")
    packed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise PickleScanError(
            f"its entry {printable(packed.filename)!r} is compressed; torch.save stores its entries uncompressed"
        )
    wanted = entries[0].filename.split("/", 1)[0].lower() + "/data.pkl"
    matches = [e for e, name in zip(entries, lowered) if name == wanted]
    if len(matches) != 1 or sum(name.endswith("data.pkl") for name in lowered) != 1:
        raise PickleScanError("it is a zip file without the one <archive>/data.pkl that torch.save writes")
    return matches[0]
