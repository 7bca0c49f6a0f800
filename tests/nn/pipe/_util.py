# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers shared by the pipe tests."""

import pytest

from fairscale.internal.device import accelerator_available

NEEDS_CUDA = pytest.mark.skipif(not accelerator_available(), reason="cuda required")


def cuda_devices():
    """``["cpu"]`` plus ``"cuda"`` when a GPU exists: the device parameter of tests that run on both."""
    return ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
