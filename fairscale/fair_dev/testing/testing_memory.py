# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Memory inspection helpers for tests: which tensors are alive, how much GPU memory a process holds.

``dump_all_tensors`` and ``get_smi_memory`` are also importable from ``fairscale.fair_dev.testing.testing``
(where upstream had them).
"""

import gc
import os
import subprocess
import warnings
import weakref
from typing import Any, Dict, List, Sequence

import torch
from torch import nn

__all__ = ["find_tensor_by_shape", "dump_all_tensors", "get_smi_memory", "alive_without_cycle_collector"]


def _live_tensors() -> List[torch.Tensor]:
    tensors = []
    with warnings.catch_warnings():
        # Merely inspecting some objects (deprecated module attributes) emits warnings.
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    tensors.append(obj)
            except Exception:  # some objects raise on inspection (e.g. half-destroyed proxies); skip them
                continue
    return tensors


def find_tensor_by_shape(target_shape: Sequence[int], only_param: bool = True) -> bool:
    """Whether a live tensor with exactly this shape exists (prints the ones found).

    Handy to check that a buffer was freed: ``assert not find_tensor_by_shape((1024, 1024))``.

    Args:
        target_shape: the shape to look for.
        only_param: look at ``nn.Parameter`` objects only.

    Returns:
        True if at least one matching tensor is alive.
    """
    wanted = tuple(target_shape)
    found = False
    for tensor in _live_tensors():
        if tuple(tensor.shape) != wanted or (only_param and not isinstance(tensor, nn.Parameter)):
            continue
        print(f"found tensor of shape {wanted}: {type(tensor).__name__} {tensor.dtype} on {tensor.device}")
        found = True
    return found


def dump_all_tensors(rank: int) -> None:
    """Print every tensor the garbage collector can see (type, shape, dtype, device, bytes).

    Args:
        rank: printed as a prefix, to tell ranks apart.
    """
    print(f"rank {rank}: live tensors")
    for tensor in _live_tensors():
        size = tensor.numel() * tensor.element_size()
        print(f"  {type(tensor).__name__} {tuple(tensor.shape)} {tensor.dtype} {tensor.device} {size} bytes")


def get_smi_memory() -> float:
    """GPU memory (MiB) that ``nvidia-smi`` reports for this process; 0.0 without ``nvidia-smi``."""
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0.0
    for line in output.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()):
            return float(parts[1])
    return 0.0


def alive_without_cycle_collector(objects: Dict[str, Any]) -> List[str]:
    """Drop ``objects`` (the caller's only references, by name) with the cycle collector off; return the names of
    those still alive, i.e. kept by a reference cycle (or a leak) instead of freed by reference counting.

    Garbage from before (torch's own import-time or save/load cycles) is collected first, so that it is not what keeps
    anything alive. The dict is emptied.
    """
    refs = {name: weakref.ref(obj) for name, obj in objects.items()}
    gc.collect()
    gc.disable()
    try:
        objects.clear()
        return [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
