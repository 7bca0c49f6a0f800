# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers for activation checkpointing: keeping batch-norm running statistics correct.

A checkpointed module runs its forward twice per training step: once under ``torch.no_grad()``
(the checkpointing pass) and once more during backward (the recomputation, with grad enabled). A
batch-norm layer in training mode would update its running statistics in both passes, i.e. twice
per step. :func:`patch_batchnorm` makes such layers skip the update whenever grad is disabled, so the
statistics move exactly once per step, in the pass that also computes gradients.
"""

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

__all__ = ["patch_batchnorm"]


class _RunningStatsGuard:
    """The pair of hooks patched onto one batch-norm layer, with its own record of whether the
    pre-forward hook turned ``track_running_stats`` off.

    Each patch owns its record, so patching a layer twice (e.g. nested checkpoint wrappers) cannot
    make one hook restore a value that another hook had already changed. Hooks are methods of a
    module-level class (not closures) so that a patched model can still be pickled.
    """

    def __init__(self, only_while: Optional[Callable[[], bool]] = None) -> None:
        self.suspended = False
        # checkpoint_wrapper's patch: only while this returns True (its no-grad first pass). A no-grad forward of
        # the user's own in training mode (torch.optim.swa_utils.update_bn recomputing the statistics) updates
        # them, as the module does unwrapped; with every no-grad forward skipped, update_bn left them reset.
        self.only_while = only_while

    def suspend(self, module: _BatchNorm, _inputs: Tuple[Any, ...]) -> None:
        # Only a layer that would actually update its statistics is touched: in eval mode the
        # flag changes nothing, and a layer whose flag is already off (by the user or by another
        # patch) must be left as it is.
        # Without a condition: whenever grad is disabled. With one (checkpoint_wrapper's), whenever it holds: its
        # no-grad first pass, and a second recomputation of one call (a retained graph's second backward).
        only_while = getattr(self, "only_while", None)  # absent in hooks pickled by older versions
        skip = not torch.is_grad_enabled() if only_while is None else only_while()
        if skip and module.training and module.track_running_stats:
            module.track_running_stats = False
            self.suspended = True

    def restore(self, module: _BatchNorm, _inputs: Tuple[Any, ...], _output: Any) -> None:
        if self.suspended:
            module.track_running_stats = True
            self.suspended = False


def _is_patched_kind(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and not hasattr(module, "disable_patch_batchnorm")


@contextlib.contextmanager
def own_forward_without_stats(module: nn.Module, only_while: Optional[Callable[[], bool]] = None) -> Iterator[None]:
    """Around a direct call of ``module.forward`` (no hooks run): what the patch's hooks do for a batch-norm layer.

    A checkpoint-wrapped batch-norm layer is itself the module whose forward the checkpoint runs, by calling it
    directly in both passes: its hooks ran once, around the whole wrapped call with grad enabled, and the no-grad
    pass updated the statistics a second time. Nothing is done for other modules (their batch-norm layers are
    called through ``__call__``, so their hooks run).
    """
    if not _is_patched_kind(module):
        yield
        return
    bn, guard = cast(_BatchNorm, module), _RunningStatsGuard(only_while)
    guard.suspend(bn, ())
    try:
        yield
    finally:
        guard.restore(bn, (), None)


def _patch_one(
    bn: _BatchNorm, only_while: Optional[Callable[[], bool]] = None
) -> Tuple[RemovableHandle, RemovableHandle]:
    guard = _RunningStatsGuard(only_while)
    pre = bn.register_forward_pre_hook(guard.suspend)
    # always_call: restore the flag even when the layer's forward raises, otherwise one failed
    # forward would silently stop the layer from ever tracking statistics again.
    post = bn.register_forward_hook(guard.restore, always_call=True)
    return pre, post


def patch_batchnorm(module: nn.Module) -> List[RemovableHandle]:
    """Make every batch-norm layer in ``module`` skip its running-stat update when grad is disabled.

    While a patched layer runs in training mode with grad disabled, ``track_running_stats`` is
    temporarily set to ``False``: the layer still normalises with the batch statistics (so its
    output is unchanged) but leaves ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` alone. :func:`~fairscale.nn.checkpoint.checkpoint_wrapper` applies
    this so the no-grad checkpointing pass does not update the statistics a second time.

    Args:
        module (nn.Module): the module to patch; every ``torch.nn.modules.batchnorm._BatchNorm``
            among ``module.modules()`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ...) is patched,
            including ``module`` itself, except layers that have a ``disable_patch_batchnorm``
            attribute (its value does not matter, as upstream).

    Returns:
        List[RemovableHandle]: the hook handles, two per patched layer; call ``remove()`` on each
        to undo the patch.
    """
    return patch_batchnorm_while(module, None)


def patch_batchnorm_while(module: nn.Module, only_while: Optional[Callable[[], bool]]) -> List[RemovableHandle]:
    """:func:`patch_batchnorm`, skipping the update only while ``only_while()`` is True as well (``None``: always).

    :func:`~fairscale.nn.checkpoint.checkpoint_wrapper` passes ``is_checkpointing``: its own no-grad pass skips the
    update, the user's no-grad forwards in training mode do not (the module behaves as unwrapped there).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"patch_batchnorm expects an nn.Module, got {type(module).__name__}")
    handles: List[RemovableHandle] = []
    for child in module.modules():
        # A layer with a ``disable_patch_batchnorm`` attribute (any value, as upstream) manages its running
        # statistics itself under checkpointing, e.g. fairscale.experimental.nn.SyncBatchNorm.
        if _is_patched_kind(child):
            handles.extend(_patch_one(cast(_BatchNorm, child), only_while))
    return handles
