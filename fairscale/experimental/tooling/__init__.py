# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Experimental tooling: :mod:`.layer_memory_tracker` (layer-by-layer memory traces)."""

from typing import List

__all__: List[str] = []
