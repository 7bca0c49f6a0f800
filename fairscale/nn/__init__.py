# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Neural-network wrappers: FSDP, FlattenParamsWrapper, wrapping and checkpointing utilities."""

import torch

from .checkpoint import checkpoint_wrapper
from .data_parallel import FullyShardedDataParallel, ShardedDataParallel
from .misc import FlattenParamsWrapper
from .wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

if torch.distributed.is_available():
    # As upstream: the MoE layer needs torch.distributed.
    from .moe.moe_layer import MOELayer
    from .moe.top2gate import Top2Gate

if torch.distributed.is_available():
    # As upstream: the pipes are exported only where torch.distributed exists.
    from .pipe import Pipe, PipeRPCWrapper

__all__ = [
    "FlattenParamsWrapper",
    "FullyShardedDataParallel",
    "ShardedDataParallel",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]
if torch.distributed.is_available():
    __all__ += ["MOELayer", "Top2Gate"]
