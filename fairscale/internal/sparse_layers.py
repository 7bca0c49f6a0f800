# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Layers that make sparse gradients, which the flat and bucketed gradient paths of the wrappers cannot carry.

FullyShardedDataParallel, ShardedDataParallel, SlowMo and FlattenParamsWrapper refuse them at wrapping, each naming
the layer; this is the one walk they share.
"""

from typing import Optional, Set, Tuple

from torch import nn

__all__ = ["sparse_gradient_layer"]


def sparse_gradient_layer(
    module: nn.Module, trainable_only: bool = True, among: Optional[Set[int]] = None
) -> Optional[Tuple[str, str]]:
    """``(path, class name)`` of the first ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` in ``module``.

    Args:
        trainable_only: skip one whose weight does not require grad (it makes no gradient at all).
        among: only one whose weight's ``id()`` is in this set (the parameters a wrapper takes over).

    Returns:
        ``None`` when there is none; the path is ``""`` for ``module`` itself.
    """
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            if (not trainable_only or m.weight.requires_grad) and (among is None or id(m.weight) in among):
                return name, type(m).__name__
    return None
