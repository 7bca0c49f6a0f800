# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale: PyTorch extensions for large-scale training (maintained distribution)."""

from .version import __version__, __version_tuple__  # noqa: F401

__all__ = ["__version__"]

# Importing the subpackages keeps ``import fairscale; fairscale.nn`` working as upstream does.
from . import nn  # noqa: E402,F401
