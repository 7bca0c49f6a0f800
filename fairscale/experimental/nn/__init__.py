# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Experimental layers: :class:`OffloadModel`, :class:`SyncBatchNorm` and MEVO (``MEVO``, ``BaselineSoftmaxNllLoss``)."""

from typing import List

from .mevo import BaselineSoftmaxNllLoss
from .mevo import MemoryEfficientVocabOutput as MEVO
from .offload import OffloadModel
from .sync_batchnorm import SyncBatchNorm

__all__: List[str] = []
