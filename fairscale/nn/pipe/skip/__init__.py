# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Skip connections between layers of a pipelined ``nn.Sequential``: ``@skippable``, ``stash``, ``pop``."""

from .namespace import Namespace
from .skippable import pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
