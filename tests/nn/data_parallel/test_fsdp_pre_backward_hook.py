# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pre-backward hooks on outputs: an inner instance's output returned by the root as well, or alone."""

from typing import Tuple

import pytest
import torch
from _models import assert_close_dict, assert_idle, gather_full_grads
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class ReturnsInnerOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.inner(x)
        return self.outer(torch.relu(h)), h  # ``h`` is the inner instance's own output tensor


def _build(reshard: bool) -> Tuple[FSDP, nn.Module]:
    torch.manual_seed(0)
    ref = ReturnsInnerOutput()
    model = ReturnsInnerOutput()
    model.load_state_dict(ref.state_dict())
    model.inner = FSDP(model.inner, reshard_after_forward=reshard)
    return FSDP(model), ref


def _inner_output_returned_by_root_body(rank: int, ws: int) -> None:
    x = torch.randn(3, 4)
    for reshard in (True, False):
        for use in ("both", "inner_only", "outer_only"):
            fsdp, ref = _build(reshard)
            for _ in range(2):  # twice: hooks and flags must be reset after each backward
                fsdp.zero_grad()
                ref.zero_grad()
                out, h = fsdp(x)
                ref_out, ref_h = ref(x)
                pick = {"both": lambda a, b: a.sum() + b.pow(2).sum(), "inner_only": lambda a, b: b.sum()}
                loss_fn = pick.get(use, lambda a, b: a.sum())
                loss_fn(out, h).backward()
                loss_fn(ref_out, ref_h).backward()
                assert_idle(fsdp)
                expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
                assert_close_dict(gather_full_grads(fsdp), expected, f"{use} grad", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [1, 2])
def test_inner_output_returned_by_root(world_size: int) -> None:
    run_distributed(_inner_output_returned_by_root_body, world_size)
