# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The refusals of the scan: a file whose pickle would make a loader do more than its bytes hold, or run what
``torch.save`` never writes (:class:`PickleScanError`), and one that is no readable pickle or ``torch.save`` file at
all (:class:`UnreadableFileError`)."""

from typing import Optional

from fairscale.internal.errors import FairscaleValueError

__all__ = ["PickleScanError", "UnreadableFileError"]


class PickleScanError(FairscaleValueError):
    """A file (or a pickle) the scan refuses: loading it would hash, allocate or copy more than its bytes can hold,
    or call what ``torch.save`` never writes for tensors and plain containers.

    Also an ``AssertionError`` (see :mod:`fairscale.internal.errors`).

    Attributes:
        reason (str): what is wrong, worded to follow the file's name (``"it calls os.system, ..."``).
        what (Optional[str]): the file as the caller named it, or ``None`` (the message is then the reason alone).
    """

    def __init__(self, reason: str, what: Optional[str] = None) -> None:
        super().__init__(reason if what is None else self.worded(what, reason))
        self.reason = reason
        self.what = what

    @staticmethod
    def worded(what: str, reason: str) -> str:
        return (
            f"refusing {what}: {reason}. fairscale scans a file before it loads it with torch.load(weights_only=True) "
            "and never runs code from it: save tensors and plain containers (dicts, lists, numbers, strings)"
        )


class UnreadableFileError(PickleScanError):
    """The bytes are no readable pickle or ``torch.save`` file: truncated, corrupt, or of another format."""

    @staticmethod
    def worded(what: str, reason: str) -> str:
        return f"{what} is truncated or corrupt, or not a torch.save file ({reason})"
