# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The tensors of a module's inputs and outputs as the layer memory tracker sees them: which ones there are, how many
bytes they count, which ones are new (share no memory with the inputs), and which one carries the backward hook."""

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

__all__ = ["collect_tensors", "tensor_bytes", "new_tensors", "first_output_tensor"]


def _dtype_bytes(dtype: torch.dtype) -> int:
    # Upstream's rule, kept because the trace values depend on it: 2 for fp16, 4 for everything else.
    return 2 if dtype == torch.float16 else 4


def collect_tensors(value: Any) -> List[torch.Tensor]:
    """Tensors in ``value`` (a tensor, or nested lists/tuples of them); anything else contributes nothing."""
    found: List[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


# The index tensors of the compressed sparse layouts, after their values.
_COMPRESSED_INDICES: Dict[torch.layout, Tuple[str, str]] = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _stored_parts(t: torch.Tensor) -> List[torch.Tensor]:
    """The strided tensors holding ``t``'s memory: ``t`` itself, or a sparse tensor's values then its indices.

    A sparse tensor has no storage of its own (``untyped_storage()`` raises), and its ``numel()`` is that of the dense
    shape: what it holds is its values and indices.
    """
    if t.layout == torch.sparse_coo:
        return [t._values(), t._indices()]
    names = _COMPRESSED_INDICES.get(t.layout)
    if names is not None:
        return [t.values()] + [getattr(t, name)() for name in names]
    return [t]


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` by upstream's dtype rule; a sparse tensor counts its values and indices."""
    with torch.no_grad():  # a sparse tensor's parts are differentiable views: build no graph for them
        return sum(p.numel() * _dtype_bytes(p.dtype) for t in tensors for p in _stored_parts(t))


def _storage_key(t: torch.Tensor) -> Hashable:
    """What identifies the memory of ``t``: its storage, or a sparse tensor's values' storage (a sparse tensor built
    on an input's values holds no new memory). Tensors without a storage to read (wrapper subclasses, other layouts)
    are identified by the object itself."""
    with torch.no_grad():
        held = _stored_parts(t)[0]
    try:
        storage = held.untyped_storage()
        if held.device.type == "meta":
            # Every meta storage has address 0: all activations looked like one, and each read 0 bytes. The storage
            # object's own identity tells them apart (a view shares its base's).
            return ("meta", int(storage._cdata))
        return int(storage.data_ptr())
    except (NotImplementedError, RuntimeError, TypeError):
        return ("tensor", id(t))


def new_tensors(produced: Any, consumed: Any) -> List[torch.Tensor]:
    """Tensors of ``produced`` that do not share storage with any tensor of ``consumed`` (in-place ops do)."""
    seen = {_storage_key(t) for t in collect_tensors(consumed)}
    return [t for t in collect_tensors(produced) if _storage_key(t) not in seen]


def first_output_tensor(output: Any) -> Optional[torch.Tensor]:
    """The tensor of a module's output whose autograd node gets the module's backward hook, or ``None``.

    torch's legacy module backward hook takes ``output``, ``output[0]``, ``output[0][0]``... (a dict: its first tensor
    value) until it reaches a tensor, and raises deep inside torch when that walk meets ``None``, a number or an empty
    tuple. This walk takes the same tensor whenever torch's would find one, goes on past such entries (the first
    tensor depth first, so ``(None, t)`` gives ``t``), and gives ``None`` where the output holds no tensor.
    """
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            return item
        if isinstance(item, dict):
            for value in item.values():
                if isinstance(value, torch.Tensor):
                    return value
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return None
