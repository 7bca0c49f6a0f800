# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Autocast's state for one device type, on every supported torch (2.4 took a device type; older torch has separate
CPU and CUDA functions and no autocast elsewhere).

Code that checks dtypes needs it: under autocast an op may return another dtype than its input by design (CUDA's
autocast runs ``layer_norm``, ``softmax`` and reductions in fp32; CPU's keeps them in the low precision), so a dtype
change is a user bug only outside autocast.
"""

from typing import Any, List, Optional, Tuple

import torch

__all__: List[str] = ["AutocastState", "autocast_state"]

#: ``(enabled, dtype)`` of autocast for one device type.
AutocastState = Tuple[bool, Optional[torch.dtype]]


def autocast_state(device_type: str) -> AutocastState:
    """Whether autocast is on for ``device_type``, and its dtype."""
    is_enabled: Any = torch.is_autocast_enabled
    get_dtype: Any = getattr(torch, "get_autocast_dtype", None)
    if get_dtype is not None:
        return bool(is_enabled(device_type)), get_dtype(device_type)
    if device_type == "cpu":  # pragma: no cover - torch < 2.4
        return bool(torch.is_autocast_cpu_enabled()), torch.get_autocast_cpu_dtype()
    if device_type == "cuda":  # pragma: no cover - torch < 2.4
        return bool(is_enabled()), torch.get_autocast_gpu_dtype()
    return False, None  # pragma: no cover - torch < 2.4
