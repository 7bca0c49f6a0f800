# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How wgit loads a checkpoint one adds: scanned, then ``torch.load(weights_only=True)`` (see :mod:`.safety`).

torch's weights-only loader runs no code, but it does what the file's pickle says with the calls it allows: it hashes
whatever dict keys the pickle builds (a tuple shared at every level as a key hashed ``2**depth`` tuples: ``wgit add``
of a 500-byte file never returned) and calls the legacy tensor constructors with the sizes the file gives
(``torch.FloatTensor(2**30)`` allocated 4 GB for a 100-byte file). So the pickle is first walked by a scanner
(:mod:`.checkpoint_scan`, on :mod:`fairscale.internal.pickle_scan`) that builds nothing but its containers, and lets
through only the calls torch.save writes for dense tensors, each counted against the file's size.
"""

import os
import pickle
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fairscale.internal.errors import FairscaleValueError
from fairscale.internal.pickle_scan import PickleScanError, scan_torch_save
from fairscale.internal.pickle_scan.files import open_regular_file

from .checkpoint_scan import CheckpointScanner
from .safety import UntrustedContentError, nesting_problem

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
    pipe, a device or a socket is refused: ``torch.load`` on a named pipe blocked ``wgit add`` forever
    (:func:`fairscale.internal.pickle_scan.files.open_regular_file`).
    """
    try:
        return open_regular_file(path)
    except PickleScanError as e:
        raise FairscaleValueError(
            f"incorrect input {path}: {e.reason}; wgit adds checkpoint files written by torch.save"
        ) from None


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
    (:func:`fairscale.internal.pickle_scan.scan_torch_save` with :class:`~.checkpoint_scan.CheckpointScanner`).

    Raises:
        UntrustedContentError: the pickle's dict keys and set members take more hashing than its bytes can hold, a
            call would allocate or copy more than the file holds, it calls what torch.save never writes for dense
            tensors, a zip entry is compressed or ambiguous, or the bytes are not such a checkpoint.
    """
    try:
        scan_torch_save(f, size, CheckpointScanner)
    except PickleScanError as e:
        raise UntrustedContentError(str(e)) from None
