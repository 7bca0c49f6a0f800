# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Keep torch's fused inference paths away from weights that FSDP shards.

``nn.TransformerEncoderLayer`` has an inference fast path (``eval()``, no autograd): instead of calling its
sub-modules it hands their weights (``self_attn.in_proj_weight``, ``linear1.weight``, ...) to one fused kernel.
When one of those sub-modules is an FSDP instance of its own, the layer's forward never calls that instance, so its
parameters are never gathered: the kernel got this rank's shard and failed ("2d weights expected", or "setStorage
... out of bounds" for a flattened one). torch skips the fast path when any module inside the layer has forward
hooks (its own test, which also protects ``fully_shard``'s modules, whose hooks do the gathering): the first FSDP
instance inside each such layer gets a hook that does nothing, and the layer runs its sub-modules one by one.
"""

from typing import Any, Set

from torch import nn

__all__ = ["keep_encoder_layers_off_their_fast_path"]


def keep_encoder_layers_off_their_fast_path(root: nn.Module, fsdp_modules: Set[int]) -> None:
    """Give one FSDP instance inside each ``nn.TransformerEncoderLayer`` under ``root`` a no-op forward pre-hook.

    Args:
        root: the root FSDP instance (its lazy init walks the tree once).
        fsdp_modules: ``id()`` of every FSDP instance of the tree.
    """
    for layer in root.modules():
        if not isinstance(layer, nn.TransformerEncoderLayer):
            continue
        inner = [m for m in layer.modules() if m is not layer and id(m) in fsdp_modules]
        if not inner or any(_has_marker(m) for m in inner):
            continue
        inner[0].register_forward_pre_hook(_no_fast_path_for_the_layer_above)


def _has_marker(module: nn.Module) -> bool:
    return any(hook is _no_fast_path_for_the_layer_above for hook in module._forward_pre_hooks.values())


def _no_fast_path_for_the_layer_above(module: nn.Module, args: Any) -> None:
    """Does nothing: its presence turns off the fast path of the encoder layer that contains ``module``."""
    return None
