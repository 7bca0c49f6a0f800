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

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["in_reentrant_checkpoint_first_pass"]

_FORWARD: Optional[CodeType] = getattr(getattr(torch_checkpoint, "CheckpointFunction", None), "forward", None)
_FORWARD = getattr(_FORWARD, "__code__", None)
# Module calls nest three frames deep each (the call, torch's dispatch, the forward): 96 frames reach a unit some
# thirty modules inside the checkpointed function.
_MAX_FRAMES = 96


def in_reentrant_checkpoint_first_pass() -> bool:
    """Whether the current call runs inside the first pass of torch's reentrant checkpoint that a backward will
    recompute: one of its tensor arguments requires grad (the checkpoint runs its forward without grad either way;
    under an evaluation's ``torch.no_grad()`` its arguments need none, and a review found the first version keeping
    full parameters and zero2 slices after such evaluations; with none requiring grad torch records no backward)."""
    if _FORWARD is None:
        return False
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_code is _FORWARD:
            args = frame.f_locals.get("args", ())
            return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        frame = frame.f_back  # type: ignore[assignment]
    return False
