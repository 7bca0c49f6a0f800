# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A wrapped module called several times in one forward, and several root forwards before one backward."""

import itertools
from typing import Any, Dict

import torch
from _models import MIXED, assert_close_dict, assert_idle, gather_full_grads, train_and_compare
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class SharedBlockTwice(nn.Module):
    """``block`` is applied twice per forward (weight reuse, as in recurrent or ALBERT-style models)."""

    NESTED = ("block",)
    LEAF = ("inp", "block", "out")
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.block(self.block(self.inp(x))))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 4, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _module_called_twice_per_forward_body(rank: int, ws: int) -> None:
    cases = []
    for reshard, mp, flatten, mode in itertools.product(
        (True, False), ("fp32", "fp16"), (True, False), ("one", "nested", "leaf")
    ):
        kwargs: Dict[str, Any] = dict(reshard_after_forward=reshard, flatten_parameters=flatten, **MIXED[mp])
        cases.append(
            (
                f"reshard={reshard},{mp},flatten={flatten},{mode}",
                lambda k=kwargs, m=mode: train_and_compare(rank, ws, SharedBlockTwice, k, m),
            )
        )
    run_cases(cases)


def test_module_called_twice_per_forward() -> None:
    run_distributed(_module_called_twice_per_forward_body, 2)


def _several_root_forwards_before_one_backward_body(rank: int, ws: int) -> None:
    for reshard in (True, False):
        torch.manual_seed(0)
        model, ref = SharedBlockTwice(), SharedBlockTwice()
        ref.load_state_dict(model.state_dict())
        model.block = FSDP(model.block, reshard_after_forward=reshard, bucket_cap_mb=0)
        fsdp = FSDP(model, bucket_cap_mb=0)
        xs = [torch.randn(2, 4) for _ in range(3)]
        with count_collectives() as counter:
            loss = sum(fsdp(x).sum() for x in xs)
            assert_idle(fsdp, after_forward=True)
            loss.backward()
        assert_idle(fsdp)
        # Gradients are reduced once per parameter, however many forwards fed the backward.
        assert counter.count("reduce_scatter") == 2, counter.summary()
        sum(ref(x).sum() for x in xs).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert_close_dict(gather_full_grads(fsdp), expected, f"reshard={reshard} grad", rtol=1e-5, atol=1e-6)


def test_several_root_forwards_before_one_backward() -> None:
    run_distributed(_several_root_forwards_before_one_backward_body, 2)
