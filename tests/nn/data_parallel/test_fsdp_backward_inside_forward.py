# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A backward run inside an FSDP instance's own forward (Lightning's manual optimization under its root FSDP
wrapper: the training step runs inside the wrapper's forward) raises an error that says so, instead of an internal
"unexpected state FORWARD"."""

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class _StepInsideForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.lin(x).sum()
        loss.backward()  # manual optimization inside the wrapped forward
        return loss.detach()


def _body(rank: int, world_size: int) -> None:
    model = FSDP(_StepInsideForward())
    with pytest.raises(RuntimeError, match="arrived while this FullyShardedDataParallel instance's forward was still"):
        model(torch.randn(2, 3))


def test_backward_inside_the_forward_is_refused_clearly() -> None:
    run_distributed(_body, 1, timeout=60)
