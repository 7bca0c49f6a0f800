# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Recording the modules' ``training`` flags at a checkpointed forward and replaying them in its recomputation.

A recomputation runs in backward, and a model may be switched to ``eval()`` (a validation pass) or back to
``train()`` between a forward and its backward. Recomputed in the current mode, dropout and batch norm compute
another function than the forward did, so the gradients are wrong and batch-norm statistics are skipped or updated
by an eval-mode call. :func:`checkpoint_wrapper` and ``Pipe`` record the flags with :func:`training_flags_of` at the
forward and run the recomputation inside :func:`replay_training_flags`.
"""

from contextlib import contextmanager
from typing import Generator, Sequence, Tuple

from torch import nn

__all__ = ["TrainingFlags", "replay_training_flags", "training_flags_of"]

TrainingFlags = Tuple[Tuple[nn.Module, bool], ...]


@contextmanager
def replay_training_flags(flags: Sequence[Tuple[nn.Module, bool]]) -> Generator[None, None, None]:
    """Run the block with each module's ``training`` flag as recorded in ``flags``; put back the current ones after.

    Only the flags that differ are touched (each module's own attribute, not ``train()``, which would recurse).
    """
    changed = [(module, module.training, flag) for module, flag in flags if module.training != flag]
    for module, _, flag in changed:
        module.training = flag
    try:
        yield
    finally:
        for module, current, _ in changed:
            module.training = current


def training_flags_of(module: nn.Module) -> TrainingFlags:
    """Every module's ``training`` flag under (and including) ``module``, for :func:`replay_training_flags`."""
    return tuple((m, m.training) for m in module.modules())
