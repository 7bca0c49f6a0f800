# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Experimental optimizer utilities."""

from typing import List

from .dynamic_loss_scaler import DynamicLossScaler as DynamicLossScaler

__all__: List[str] = []
