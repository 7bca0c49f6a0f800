# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Miscellaneous wrappers: FlattenParamsWrapper and FlatParameter (and the deprecated checkpoint_wrapper path)."""

from .checkpoint_activations import checkpoint_wrapper
from .flatten_params_wrapper import FlatParameter, FlattenParamsWrapper, _enable_pre_load_state_dict_hook
from .param_bucket import GradBucket, ParamBucket

__all__ = [
    "FlatParameter",
    "FlattenParamsWrapper",
    "GradBucket",
    "ParamBucket",
    "_enable_pre_load_state_dict_hook",
    "checkpoint_wrapper",
]
