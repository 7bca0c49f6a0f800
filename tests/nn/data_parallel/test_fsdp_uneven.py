# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Uneven sharding: parameters whose numel does not divide by the world size, smaller than it, and batches with
fewer rows than ranks."""

import itertools
import math
from typing import Any, List

import pytest
import torch
from _models import CPU_HALF_MATMUL, MIXED, NestedWrappedModule, assert_idle, full_params, train_and_compare
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


def _layout(rank: int, ws: int) -> List[Any]:
    """Shard numel and padding of a 42-element and a 5-element flat parameter, and of each non-flat tensor."""
    torch.manual_seed(0)
    out = []
    for in_f, out_f in ((5, 7), (4, 1)):  # 35 + 7 = 42 elements; 4 + 1 = 5 elements
        flat = FSDP(nn.Linear(in_f, out_f))
        p = flat.params[0]
        out.append((p._orig_size, p.numel(), flat.numel_padded_per_param, p._is_sharded))
        plain = FSDP(nn.Linear(in_f, out_f), flatten_parameters=False)
        out.append([(q._orig_size, q.numel()) for q in plain.params] + [plain.numel_padded_per_param])
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_chunk_and_pad_layout(world_size: int) -> None:
    results = run_distributed(_layout, world_size)
    for rank, ((size42, n42, pad42, sharded), plain42, (size5, n5, pad5, _), plain5) in enumerate(results):
        assert sharded and size42 == torch.Size([42]) and size5 == torch.Size([5])
        for numel, shard_numel, padding in ((42, n42, pad42), (5, n5, pad5)):
            chunk = math.ceil(numel / world_size)
            real = max(0, min(chunk, numel - rank * chunk))  # torch.chunk: the tail ranks get less or nothing
            assert shard_numel == chunk and padding == [chunk - real], (rank, numel, shard_numel, padding)
        # Non-flat: every tensor is chunked and padded on its own.
        for plain, shapes in ((plain42, [(7, 5), (7,)]), (plain5, [(1, 4), (1,)])):
            paddings = plain[-1]
            for (orig, shard_numel), shape, padding in zip(plain[:-1], shapes, paddings):
                numel = math.prod(shape)
                chunk = math.ceil(numel / world_size)
                assert orig == torch.Size(shape) and shard_numel == chunk
                assert padding == chunk - max(0, min(chunk, numel - rank * chunk))
    # Spec examples: 42 over 4 ranks -> 11 each, the last padded by 2; 5 over 4 -> paddings 0, 0, 1, 2.
    if world_size == 4:
        assert [r[0][2] for r in results] == [[0], [0], [0], [2]]
        assert [r[2][2] for r in results] == [[0], [0], [1], [2]]


class Tiny(nn.Module):
    """Parameters smaller than the world: a 1x1 linear (2 elements) and a 3-element bias."""

    NESTED = ("b",)
    LEAF = ("a", "b")
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 1, generator=gen),)

    @staticmethod
    def per_sample_loss(out: torch.Tensor) -> torch.Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _uneven_parity_body(rank: int, ws: int) -> None:
    cases = []
    # Padding at every world size is covered by the parity matrix; here: empty and odd local batches, and
    # parameters smaller than the world (Tiny).
    combos = [(Tiny, "fp32", mode) for mode in ("nested", "leaf")] + [
        (NestedWrappedModule, mp, "nested") for mp in (("fp32", "fp16") if CPU_HALF_MATMUL else ("fp32",))
    ]  # torch 2.1 has no fp16 matmul on the CPU, and there a rank with rows fails where the others do not
    for (model_cls, mp, mode), flatten, global_n in itertools.product(combos, (True, False), (1, 2 * ws + 1)):
        # global_n=1: one rank has the only row, the others run on empty batches.
        kwargs = dict(flatten_parameters=flatten, **MIXED[mp])
        name = f"{model_cls.__name__},{mp},flatten={flatten},{mode},rows={global_n}"
        cases.append(
            (
                name,
                lambda c=model_cls, k=kwargs, m=mode, n=global_n: train_and_compare(rank, ws, c, k, m, global_n=n),
            )
        )
    run_cases(cases)


@pytest.mark.parametrize("world_size", [3, 4])
def test_uneven_parity(world_size: int) -> None:
    run_distributed(_uneven_parity_body, world_size, timeout=180)


def _ranks_holding_only_padding_round_trip_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    fsdp = FSDP(nn.Linear(1, 1))  # 2 elements over 4 ranks: ranks 2 and 3 hold only padding
    before = full_params(fsdp)
    with fsdp.summon_full_params():
        with torch.no_grad():
            for p in fsdp.parameters():
                p.add_(1.0)
    after = full_params(fsdp)
    for name in before:
        torch.testing.assert_close(after[name], before[name] + 1)
    shard = fsdp.params[0].data
    if rank >= 2:
        assert torch.count_nonzero(shard) == 0, "padding must stay zero"
    assert_idle(fsdp)


def test_ranks_holding_only_padding_round_trip() -> None:
    """Ranks whose shard is all padding still round-trip through summon and keep zeros in the padding."""

    run_distributed(_ranks_holding_only_padding_round_trip_body, 4)
