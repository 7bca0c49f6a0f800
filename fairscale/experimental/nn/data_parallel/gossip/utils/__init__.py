# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers of the gossip package: flattening, per-dtype communication, groups, logging and timing."""

from .helpers import (
    MultiProcessAdapter,
    communicate,
    create_process_group,
    flatten_tensors,
    group_by_dtype,
    make_logger,
    unflatten_tensors,
)

__all__ = [
    "MultiProcessAdapter",
    "communicate",
    "create_process_group",
    "flatten_tensors",
    "group_by_dtype",
    "make_logger",
    "unflatten_tensors",
]
