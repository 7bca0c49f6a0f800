# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Maintainer tools (not installed with the package)."""
