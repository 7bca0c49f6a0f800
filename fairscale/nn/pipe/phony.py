# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Phony tensors: tiny tensors that carry no data, only autograd ordering edges."""

from typing import Dict, Tuple

import torch
from torch import Tensor

from .stream import default_stream, use_stream

__all__ = ["get_phony"]

_phonies: Dict[Tuple[torch.device, bool], Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """Return the cached phony of ``(device, requires_grad)``: shape ``(1,)``, made once on the default stream.

    The size is 1 rather than 0 because some transports reject empty tensors. Callers that return a phony from
    an autograd function must return a detached alias (``phony.detach()``) so the cached tensor is never given a
    ``grad_fn``.
    """
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with use_stream(default_stream(device)):
            phony = torch.empty(1, device=device, requires_grad=requires_grad)
        _phonies[key] = phony
    return phony
