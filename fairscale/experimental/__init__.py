# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Experimental features of fairscale.

Like upstream, this package imports none of its subpackages: import what you use, e.g.
``from fairscale.experimental.nn import OffloadModel``.
"""

from typing import List

__all__: List[str] = []
