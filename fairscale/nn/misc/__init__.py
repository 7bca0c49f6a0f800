# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Miscellaneous wrappers: FlattenParamsWrapper and FlatParameter."""

from .flatten_params_wrapper import FlatParameter, FlattenParamsWrapper, _enable_pre_load_state_dict_hook

__all__ = ["FlatParameter", "FlattenParamsWrapper", "_enable_pre_load_state_dict_hook"]
