# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Mixture of experts: :class:`MOELayer` and its :class:`Top2Gate`."""

from typing import List

from .moe_layer import MOELayer
from .top2gate import Top2Gate

# Upstream exports nothing through ``import *``.
__all__: List[str] = []
