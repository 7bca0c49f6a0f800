# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Scanning a pickle (a ``torch.save`` file) before loading it: fairscale's defence against files from someone else.

``torch.load(weights_only=True)`` runs no code from a file, but it does what the file's pickle says with the calls it
allows: a tuple shared at every level as a dict key makes it hash ``2**depth`` tuples (a 1 KB file never loads), a
legacy tensor constructor allocates the size the file names. :func:`load_torch_file` first walks the pickle with a
restricted unpickler that builds nothing but plain containers and counts every hashing step, allocation and tensor
view against the file's size (:func:`scan_torch_save`), then loads it weights-only. Refusals raise
:class:`PickleScanError` (a ``ValueError``), :class:`UnreadableFileError` for bytes that are no ``torch.save`` file.

Modules, one concept each: :mod:`.errors` (the refusals), :mod:`.text` (how values are shown), :mod:`.files`
(regular files only), :mod:`.nesting` (how deep containers nest), :mod:`.hashing` (the cost of hashing a key),
:mod:`.reader` (bounded reads), :mod:`.unpickler` (the restricted unpickler), :mod:`.torch_scan` (its scanner of
``torch.save`` pickles) and :mod:`.torch_file` (the scan of a file, zip or legacy, and the load). wgit's store
(:mod:`fairscale.experimental.wgit`) builds its own unpickler on :mod:`.unpickler`.
"""

from .errors import PickleScanError, UnreadableFileError
from .files import FileWindow
from .nesting import MAX_NESTING, nesting_problem
from .text import printable
from .torch_file import load_torch_file, scan_torch_save

__all__ = [
    "FileWindow",
    "MAX_NESTING",
    "PickleScanError",
    "UnreadableFileError",
    "load_torch_file",
    "nesting_problem",
    "printable",
    "scan_torch_save",
]
