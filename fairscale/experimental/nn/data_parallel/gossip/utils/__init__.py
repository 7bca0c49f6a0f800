# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers of the gossip package: flattening, per-dtype communication, groups, logging and timing."""

from . import helpers
from .helpers import *  # noqa: F401,F403  # the public names are listed once, in helpers.__all__

__all__ = list(helpers.__all__)
