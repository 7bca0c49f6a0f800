# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Deprecated location of :func:`checkpoint_wrapper`; import it from :mod:`fairscale.nn.checkpoint` instead.

Kept so that ``from fairscale.nn.misc.checkpoint_activations import checkpoint_wrapper`` (the path of
older fairscale releases) keeps working; the object is the same as ``fairscale.nn.checkpoint.checkpoint_wrapper``.
"""

from fairscale.nn.checkpoint.checkpoint_activations import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
