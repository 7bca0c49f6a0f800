# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tensor (Megatron-style) model parallelism: process groups, parallel layers, cross entropy, RNG.

Exports upstream's names; ``ParallelEmbedding``, ``checkpoint``, ``CudaRNGStatesTracker`` and the
other mappings are reached through the submodules, as upstream.
"""

from typing import List

from .cross_entropy import vocab_parallel_cross_entropy
from .initialize import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_pipeline_parallel_group,
    get_pipeline_parallel_ranks,
    initialize_model_parallel,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import copy_to_model_parallel_region, gather_from_model_parallel_region
from .random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

# Upstream exports nothing through ``import *``.
__all__: List[str] = []
