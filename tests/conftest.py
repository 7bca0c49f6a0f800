# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Suite-wide pytest settings: a default per-test timeout, so that no hang can stall a CI run."""

from typing import List

import pytest

# Generous on purpose: it only has to turn a hang outside the multi-process engine (which has its own
# per-world timeout) into a failure. A test's own @pytest.mark.timeout or --timeout wins.
DEFAULT_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) is not None or config.getini("timeout"):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT_S))
