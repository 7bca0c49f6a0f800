# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Neural-network wrappers: FSDP, FlattenParamsWrapper, wrapping and checkpointing utilities."""

from .checkpoint import checkpoint_wrapper
from .data_parallel import FullyShardedDataParallel
from .misc import FlattenParamsWrapper
from .wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

__all__ = [
    "FlattenParamsWrapper",
    "FullyShardedDataParallel",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]
