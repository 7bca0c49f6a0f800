# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo and its gossip machinery: topologies, mixing, gossipers and helpers."""

from .distributed import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from .gossiper import PushPull, PushSum
from .graph_manager import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from .mixing_manager import MixingManager, UniformMixing
from .utils import communicate
from .utils.cuda_metering import CudaEventRecorder

__all__ = [
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "PushPull",
    "PushSum",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GraphManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "MixingManager",
    "UniformMixing",
    "communicate",
    "CudaEventRecorder",
]
