# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The scanner of a checkpoint's pickle, worded for wgit (see :mod:`.checkpoint_load`).

The scanner is :class:`fairscale.internal.pickle_scan.torch_scan.TorchSaveScanner`: the restricted unpickler with
the calls ``torch.save`` writes for dense tensors, parameters and plain containers allowed, each with its arguments
checked and what it makes counted against the file's size. Any other call is refused, although torch's loader may
allow it (a legacy tensor constructor given a size, a device tensor copied from a memoized one, a nested tensor's
view of a buffer): wgit stores dense tensors only. Its refusals here say so in wgit's words.
"""

from typing import ClassVar, List

from fairscale.internal.pickle_scan.torch_scan import TorchSaveScanner

__all__: List[str] = []


class CheckpointScanner(TorchSaveScanner):
    """:class:`~fairscale.internal.pickle_scan.torch_scan.TorchSaveScanner`, its refusals worded for wgit."""

    objects: ClassVar[str] = "wgit's objects"
    nameable: ClassVar[str] = "a numpy array, a plain container or a wgit record"
    buildable: ClassVar[str] = "numpy arrays, dtypes and wgit records"
    reader: ClassVar[str] = "wgit"
    unstorable: ClassVar[str] = "which wgit's store cannot keep (numpy has no array for it)"
    dense_only: ClassVar[str] = "the only ones wgit stores"
    copies: ClassVar[str] = "wgit copies each tensor it stores"
