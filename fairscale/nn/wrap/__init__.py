# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Wrapping utilities: :func:`enable_wrap`, :func:`wrap`, :func:`auto_wrap` and the auto-wrap policies."""

from .auto_wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

__all__ = ["auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"]
