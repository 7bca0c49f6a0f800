# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The net and data of the process-group option tests: ``zero2_process_group`` (``test_fsdp_zero2.py``) and
``replicate_process_group`` (``test_fsdp_hybrid.py``, and through it ``test_fsdp_hybrid_checkpoint.py``).

Both build :class:`Net` from seed 0 on every rank, feed every rank its own batch and compare against references
trained from the same start, so the model, the batches and the starting parameters have to be one definition.
"""

from typing import Any, Callable, Dict

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

BATCH = 2
DIM_IN, DIM, DIM_OUT = 5, 7, 3


class Block(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM + 2)
        self.c = nn.Linear(DIM, DIM + 2)
        self.b = nn.Linear(DIM + 2, DIM)
        if tie:
            self.c.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.relu(self.a(x)) * torch.sigmoid(self.c(x)))


class Net(nn.Module):
    """input linear -> two blocks -> head; odd sizes so that every shard is padded."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM_IN, DIM)
        self.blocks = nn.Sequential(Block(tie), Block(tie))
        self.head = nn.Linear(DIM, DIM_OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(torch.tanh(self.inp(x))))


def batch(step: int, mb: int, rank: int) -> Tensor:
    """Rank ``rank``'s own batch of microbatch ``mb`` of ``step``: every rank (and so every replica) sees other data."""
    return torch.randn(BATCH, DIM_IN, generator=torch.Generator().manual_seed(1000 * step + 10 * mb + rank))


def mb_loss(out: Tensor) -> Tensor:
    return out.float().pow(2).sum()


def initial_params(c: Dict[str, Any]) -> Dict[str, Tensor]:
    """The parameters every run starts from (seed 0, as each test's ``build`` and reference use)."""
    torch.manual_seed(0)
    return {k: v.float() for k, v in Net(tie=c["tie"]).state_dict().items()}


def expect_value_error(make: Callable[[], FSDP], *needles: str, option: str) -> str:
    """Build and run one step; the ValueError may come at construction or at lazy init (the first forward), on every
    rank. ``option`` names the misconfigured argument in the failure message when nothing is raised."""
    try:
        model = make()
        mb_loss(model(torch.randn(2, DIM_IN))).backward()
    except ValueError as e:
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in the error: {msg}"
        return msg
    raise AssertionError(f"a misconfigured {option} was accepted")
