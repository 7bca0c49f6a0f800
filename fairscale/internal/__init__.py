# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Internal helpers of fairscale: not a public API, except where re-exported elsewhere.

Two layers here are the only places in the package allowed to touch devices and collectives:
:mod:`fairscale.internal.device` (``torch.cuda``, streams, events) and
:mod:`fairscale.internal.collectives` (``torch.distributed`` collectives).
"""

from .version import torch_version

__all__ = ["torch_version"]
