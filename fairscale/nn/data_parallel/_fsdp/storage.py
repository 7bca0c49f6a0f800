# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Freeing and re-growing a tensor's storage in place: how FSDP's full buffers are released between uses while the
views autograd saved of them stay valid objects."""

from typing import NamedTuple, Union

import torch
from torch import Tensor

# Storage sizes are read with nbytes() (C++), not size(): UntypedStorage.size() is a Python wrapper around it, and
# these run several times per unit and step.


def free_storage_(data: Tensor) -> None:
    """Release a tensor's storage without changing its metadata (views stay valid objects)."""
    storage = data.untyped_storage()
    if storage.nbytes() > 0:
        # The tensor must be the sole owner of the storage's start, or other views would silently lose their data.
        if data.storage_offset() != 0:
            raise ValueError("free_storage_ needs a tensor that starts its storage (other views would lose their data)")
        storage.resize_(0)


def alloc_storage_(data: Tensor, size: Union[int, torch.Size]) -> None:
    """Re-grow a storage freed by :func:`free_storage_` to hold ``size`` elements of the tensor's dtype.

    Args:
        data (Tensor): the tensor whose storage was freed.
        size (Union[int, torch.Size]): a shape (as upstream passes it) or a number of elements.
    """
    numel = size if isinstance(size, int) else torch.Size(size).numel()
    storage = data.untyped_storage()
    nbytes = numel * data.element_size()
    if storage.nbytes() != nbytes:
        if storage.nbytes() != 0:
            raise ValueError(
                f"alloc_storage_ on a storage that is neither freed nor the right size ({storage.nbytes()} bytes, "
                f"{nbytes} wanted): free it with free_storage_ first"
            )
        storage.resize_(nbytes)


class FreedBuffer(NamedTuple):
    """A full buffer whose storage is freed, as pickled: its size, dtype and device."""

    numel: int
    dtype: torch.dtype
    device: torch.device

    def make(self) -> Tensor:
        buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        free_storage_(buffer)
        return buffer


def is_storage_allocated(tensor: Tensor) -> bool:
    """Whether a tensor's storage currently holds memory."""
    return tensor.untyped_storage().nbytes() > 0
