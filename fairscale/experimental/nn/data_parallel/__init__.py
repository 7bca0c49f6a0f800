# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Experimental data parallelism: SlowMo (slow momentum over LocalSGD or stochastic gradient push)."""

from .gossip import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
