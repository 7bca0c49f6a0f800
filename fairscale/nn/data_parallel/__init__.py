# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Data-parallel wrappers: FullyShardedDataParallel and its helpers."""

from ._fsdp.batchnorm_wrap import auto_wrap_bn
from ._fsdp.hybrid import hybrid_groups
from ._fsdp.state_dict import no_pre_load_state_dict_hook
from ._fsdp.zero2 import zero2_groups
from .fully_sharded_data_parallel import FullyShardedDataParallel, TrainingState, get_fsdp_instances
from .sharded_ddp import ShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "ShardedDataParallel",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "hybrid_groups",
    "no_pre_load_state_dict_hook",
    "zero2_groups",
]
