# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.version."""

import logging
from typing import Tuple

import pytest
import torch

import fairscale.internal
from fairscale.internal.version import torch_version


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("1.8.1", (1, 8, 1)),
        ("2.1.2+cu121", (2, 1, 2)),
        ("10.20.30", (10, 20, 30)),
        ("garbage", ()),
        ("2.1", ()),
        ("", ()),
        ("1x2y3", (1, 2, 3)),  # upstream's separator is any one character
        ("2.1+cpu", ()),
    ],
)
def test_torch_version(version: str, expected: Tuple[int, ...], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert torch_version(version) == expected
    assert "pre-release" not in caplog.text


@pytest.mark.parametrize(
    "version", ["1.10.0a0+gitabc", "2.4.0.dev20240101", "2.4.0rc1", "3.0.0b2+cpu", "2.4.0post1", "1.2.3.4"]
)
def test_pre_release_warns_once(version: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert len(torch_version(version)) == 3
        torch_version(version)
    assert caplog.text.count("pre-release") == 1


def test_default_and_export() -> None:
    assert fairscale.internal.torch_version is torch_version
    assert fairscale.internal.__all__ == ["torch_version"]
    assert torch_version() == torch_version(torch.__version__) >= (2, 1, 0)
