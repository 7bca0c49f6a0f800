# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A GPipe-style pipeline over ``torch.distributed.rpc``: :class:`DistributedPipeline` runs a
:class:`PipelineModulesGraph` of ``RemoteModule`` s micro-batch by micro-batch; :class:`DistributedLoss` evaluates a
loss where the output lives."""

from .graph import PipelineModulesGraph
from .loss import DistributedLoss
from .pipeline import DistributedPipeline

__all__ = ["PipelineModulesGraph", "DistributedLoss", "DistributedPipeline"]
