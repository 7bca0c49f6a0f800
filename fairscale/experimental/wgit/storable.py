# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which tensors wgit's SHA1 store can keep: those numpy has an array for.

The store keeps tensors as pickled numpy arrays (upstream fairscale's format, which wgit keeps), so a bfloat16,
float8, complex32, quantized, sparse, meta or nested tensor cannot be stored. :func:`check_storable` walks a whole
object first, so that an add fails before it stores anything instead of halfway; :func:`check_checkpoint_type` refuses
a checkpoint whose top level wgit cannot track.
"""

import functools
from pathlib import Path
from typing import Any, List, Optional, Set

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleTypeError

__all__ = ["check_checkpoint_type", "check_storable"]


@functools.lru_cache(maxsize=None)
def _numpy_has(dtype: torch.dtype) -> bool:
    """Whether ``Tensor.numpy()`` converts tensors of ``dtype`` (asked of torch: its list changes between versions)."""
    try:
        torch.empty(0, dtype=dtype).numpy()
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _tensor_problem(tensor: Tensor) -> Optional[str]:
    """Why ``tensor`` cannot become a numpy array (``None``: it can, once a conj/neg view is resolved)."""
    if tensor.is_nested:
        return (
            "it is a nested tensor, which numpy has no array for: save its tensors (.unbind()) or a padded tensor "
            "(.to_padded_tensor(0.0)) instead"
        )
    if tensor.is_meta:
        return "it is on the meta device and holds no data: save the tensor once its data is materialized"
    if tensor.layout != torch.strided:
        return f"numpy has no {tensor.layout} array: convert it with .to_dense() before torch.save"
    if tensor.is_quantized:
        return (
            f"numpy has no quantized dtype ({tensor.dtype}): save .dequantize() (or .int_repr() and the quantization "
            "parameters) instead"
        )
    if not _numpy_has(tensor.dtype):
        convert = ".to(torch.complex64)" if tensor.dtype.is_complex else ".float()"
        return f"numpy has no {tensor.dtype} dtype: convert it before torch.save, e.g. with {convert}"
    return None


def _storable_problem(obj: Any, path: List[str], done: Set[int]) -> Optional[str]:
    """The first tensor in ``obj`` that :func:`_to_np` cannot convert, with its dotted path and why."""
    if isinstance(obj, Tensor):
        why = _tensor_problem(obj)
        if why is None:
            return None
        where = f"the tensor {'.'.join(path)!r}" if path else "the tensor"
        return f"{where} ({obj.dtype}, {obj.layout}) cannot be stored: {why}"
    # The containers _convert walks, each once (a structure shared at every level costs its size, not 2**depth).
    if not isinstance(obj, (dict, list)) and type(obj) is not tuple:
        return None
    if id(obj) in done:
        return None
    done.add(id(obj))
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        problem = _storable_problem(value, path + [str(key)], done)
        if problem is not None:
            return problem
    return None


def check_storable(obj: Any, source: str = "") -> None:
    """Refuse ``obj`` if a tensor in it has no numpy equivalent, before anything of it is stored.

    The store keeps tensors as pickled numpy arrays (upstream fairscale's format, which wgit keeps): a bfloat16,
    float8, complex32, quantized, sparse, meta or nested tensor has no such array. Checked on the whole object first,
    so that an add fails before it stores any tensor instead of halfway. A conjugate or negative view of a supported
    dtype is fine (it is resolved when stored).

    Args:
        obj (Any): a tensor, or dicts, lists and tuples holding tensors (walked as the store converts them).
        source (str): where ``obj`` comes from (a file name), for the message.

    Raises:
        FairscaleTypeError: naming the first such tensor by its dotted path, its dtype and layout, and what to do.
    """
    problem = _storable_problem(obj, [], set())
    if problem is not None:
        origin = f" in {source}" if source else ""
        raise FairscaleTypeError(
            f"incorrect input{origin}: {problem}. wgit's SHA1 store keeps tensors as numpy arrays (upstream "
            "fairscale's format); nothing was stored"
        )


def check_checkpoint_type(checkpoint: Any, file_path: Path, per_tensor: bool) -> None:
    """Refuse, before anything is stored, a checkpoint that wgit cannot track.

    What a fairscale user adds is what ``torch.save`` wrote: a state dict (or a dict holding several) in the common
    case, sometimes a single tensor. Upstream's SHA1 store takes a tensor or a dict at its top level, so that is what
    wgit tracks: per tensor, a dict (its tensors, in dicts and lists at any depth below, are stored one by one); as
    a whole (``per_tensor=False``), a dict or a tensor. A top-level list is refused in both modes: its tensors would be
    stored and the list then refused (upstream's behaviour), and storing it in another shape would change the format.

    Raises:
        FairscaleTypeError: saying what to do instead; ``--no_per_tensor`` is suggested only for a tensor.
    """
    kind = type(checkpoint).__name__
    if isinstance(checkpoint, dict) or (not per_tensor and isinstance(checkpoint, Tensor)):
        return
    if isinstance(checkpoint, Tensor):
        raise FairscaleTypeError(
            f"{file_path} holds a single tensor, which cannot be added per tensor (a dict is): add it as a whole "
            "with per_tensor=False (wgit add --no_per_tensor)"
        )
    raise FairscaleTypeError(
        f"{file_path} holds a {kind!r} object: wgit tracks checkpoints that are a dict (a state dict, e.g. "
        "torch.save(model.state_dict(), path)) or a single tensor; save it as a dict (e.g. {'tensors': your_list}) "
        "and add that"
    )
