# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Activation checkpointing: :func:`checkpoint_wrapper` and the flags that tell which pass is running."""

from .checkpoint_activations import checkpoint_wrapper, is_checkpointing, is_recomputing

__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]
