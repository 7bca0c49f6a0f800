# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Whether a forward without grad is the first pass of torch's reentrant checkpoint (not an evaluation).

``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` (HuggingFace's gradient checkpointing) runs its first
pass inside an autograd Function's forward, where grad is off, and recomputes with grad on in backward. Taken for an
evaluation, a unit inside freed everything after that pass: the zero2 slice it should keep (its backward then
gathered over the whole group instead of the zero2 group) and, with ``reshard_after_forward=False``, the parameters
it should keep (one more gather per micro-batch); fairscale's own ``checkpoint_wrapper`` says so through
``is_checkpointing()``, torch's says nothing (a fuzz of the fork's features, session 45).

The caller's frames are looked at, a bounded number of them, only for forwards without grad.
"""

import sys
from types import CodeType
from typing import Optional

import torch.utils.checkpoint as torch_checkpoint

__all__ = ["in_reentrant_checkpoint_first_pass"]

_FORWARD: Optional[CodeType] = getattr(getattr(torch_checkpoint, "CheckpointFunction", None), "forward", None)
_FORWARD = getattr(_FORWARD, "__code__", None)
# Module calls nest three frames deep each (the call, torch's dispatch, the forward): 96 frames reach a unit some
# thirty modules inside the checkpointed function.
_MAX_FRAMES = 96


def in_reentrant_checkpoint_first_pass() -> bool:
    """Whether the current call runs inside torch's reentrant checkpoint's forward (its first pass)."""
    if _FORWARD is None:
        return False
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_code is _FORWARD:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
