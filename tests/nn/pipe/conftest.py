# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Every pipe test starts from the same seed; Pipe's (upstream) deprecation warning is not shown."""

import pytest
import torch


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    # Pipe warns on every construction, as upstream does; these tests construct hundreds.
    for item in items:
        if "pipe" in item.nodeid.split("::")[0].split("/"):
            item.add_marker(
                pytest.mark.filterwarnings("ignore:fairscale.nn.Pipe has been upstreamed:DeprecationWarning")
            )
