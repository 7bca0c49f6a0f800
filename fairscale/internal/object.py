# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Serialise Python objects to byte tensors and back (for sending them through tensor collectives)."""

import pickle
from typing import Any

import torch
from torch import Tensor

__all__ = ["pyobject_to_tensor", "tensor_to_pyobject"]


def pyobject_to_tensor(obj: Any, fixed_buffer_size: int = 0) -> Tensor:
    """Pickle ``obj`` into a 1-D ``uint8`` tensor.

    Args:
        obj (Any): a picklable object.
        fixed_buffer_size (int): if positive, zero-pad the tensor to exactly this many bytes so
            that every rank can use the same buffer size in a collective.

    Returns:
        Tensor: the pickled bytes (on CPU).

    Raises:
        ValueError: if the pickle is longer than a positive ``fixed_buffer_size``.
    """
    payload = pickle.dumps(obj)
    if fixed_buffer_size > 0 and len(payload) > fixed_buffer_size:
        raise ValueError(
            f"pyobject_to_tensor: the pickled object needs {len(payload)} bytes but fixed_buffer_size is "
            f"{fixed_buffer_size}; raise fixed_buffer_size"
        )
    size = max(len(payload), fixed_buffer_size)
    result = torch.zeros(size, dtype=torch.uint8)
    result[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return result


def tensor_to_pyobject(tensor: Tensor) -> Any:
    """Unpickle an object from a ``uint8`` tensor made by :func:`pyobject_to_tensor` (padding is ignored).

    Warning:
        This runs ``pickle.loads``, as upstream and as torch's ``broadcast_object_list`` do: unpickling can run any
        code the bytes name. Use it only for tensors from your own job's ranks (a collective's result), never for
        bytes read from a file or received from outside the job.

    Raises:
        ValueError: if ``tensor`` is not a ``uint8`` tensor.
    """
    if tensor.dtype != torch.uint8:
        raise ValueError(f"tensor_to_pyobject: expected a torch.uint8 tensor, got {tensor.dtype}")
    # pickle stops at its STOP opcode, so trailing zero padding is harmless.
    return pickle.loads(tensor.detach().cpu().numpy().tobytes())
