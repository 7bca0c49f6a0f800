# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Exit codes of the wgit command line."""

from enum import Enum

__all__ = ["ExitCode"]


class ExitCode(Enum):
    CLEAN = 0
    FILE_EXISTS_ERROR = 1
    FILE_DOES_NOT_EXIST_ERROR = 2
