# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel when the ranks disagree: the same clear error on every rank, within seconds (issue 26).

Upstream hung (or gloo aborted the process) when one rank wrapped another model, or froze a layer alone: the ranks
then broadcast or reduce tensors of other sizes, or one rank waits for a reduction that never comes. The module is
compared at construction; the parameters to reduce before the first reduction of every backward. Real gloo worlds;
each body returns the error message it caught, so the test sees every rank's.
"""

from typing import List, Optional

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

# Short: the failures these tests guard against were hangs.
TIMEOUT = 60.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(100 * step + rank))


def _construction_body(rank: int, world_size: int, case: str) -> str:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    if case == "buffer" and rank == 1:
        model.register_buffer("running", torch.zeros(3))  # not in OSS: only the wrapper sees it
    if case == "frozen" and rank == 1:
        model[1].weight.requires_grad_(False)  # after OSS was built, before the wrapper
    try:
        ShardedDataParallel(model, oss)
    except RanksDisagreeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,where",
    [
        ("buffer", "(13 entries vs 14; the first extra entry is ('buffer running'"),
        (
            "frozen",
            "('parameter 1.weight', (3, 3), 'torch.float32', True) vs "
            "('parameter 1.weight', (3, 3), 'torch.float32', False)",
        ),
    ],
    ids=["extra buffer", "frozen after OSS"],
)
def test_construction_with_another_module_on_one_rank(case: str, where: str) -> None:
    messages = run_distributed(_construction_body, 2, case, timeout=TIMEOUT)
    assert messages[0] == messages[1], "the same error on every rank"
    assert messages[0].startswith("ShardedDataParallel: the module's parameters"), messages[0]
    assert "global rank 1" in messages[0] and "Wrap the same model on every rank" in messages[0]
    assert where in messages[0], messages[0]


# The arguments of the optimizer (the others are ShardedDataParallel's).
_OSS_ARGUMENTS = ("broadcast_fp16", "force_broadcast_object")


def _arguments_body(rank: int, world_size: int, argument: str) -> str:
    values = {
        "broadcast_buffers": (True, False),
        "sync_models_at_startup": (True, False),
        "reduce_buffer_size": (0, 2**20),
        "auto_refresh_trainable": (True, False),
        "reduce_fp16": (False, True),
        "broadcast_fp16": (False, True),
        "force_broadcast_object": (False, True),
    }[argument]
    model = _mlp()
    mine = {argument: values[rank]}
    if argument == "reduce_fp16":  # only without reduce buckets (with them it is switched off, on every rank)
        mine["reduce_buffer_size"] = 0
    try:
        oss = OSS(model.parameters(), lr=0.1, **(mine if argument in _OSS_ARGUMENTS else {}))
        sdp = ShardedDataParallel(model, oss, **(mine if argument not in _OSS_ARGUMENTS else {}))
        sdp(_batch(0, rank)).sum().backward()
        oss.step()
    except RanksDisagreeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "argument",
    [
        "broadcast_buffers",
        "sync_models_at_startup",
        "reduce_buffer_size",
        "auto_refresh_trainable",
        "reduce_fp16",
        "broadcast_fp16",
        "force_broadcast_object",
    ],
)
def test_another_argument_on_one_rank(argument: str) -> None:
    """Arguments that decide which collectives run (before: a gloo abort at the first broadcast or reduction, or a
    rank waiting for a buffer broadcast the other never sends) are compared in the construction check."""
    messages = run_distributed(_arguments_body, 2, argument, timeout=TIMEOUT)
    assert messages[0] == messages[1], "the same error on every rank"
    owner = "OSS" if argument in _OSS_ARGUMENTS else "ShardedDataParallel"
    assert messages[0].startswith(owner), messages[0]
    assert f"('argument {argument}" in messages[0], messages[0]


def _freeze_body(rank: int, world_size: int, buffer: int, auto_refresh: bool, both: bool) -> Optional[str]:
    """One rank (or, with ``both``, every rank) freezes a layer after a first training step."""
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer, auto_refresh_trainable=auto_refresh)
    sdp(_batch(0, rank)).sum().backward()
    oss.step()
    if both or rank == 1:
        model[1].weight.requires_grad_(False)
        if not auto_refresh:
            sdp.refresh_trainable()
    sdp.zero_grad()
    try:
        sdp(_batch(1, rank)).sum().backward()
    except RanksDisagreeError as e:
        return str(e)
    oss.step()
    gathered: List[List[torch.Tensor]] = [[] for _ in range(world_size)]
    dist.all_gather_object(gathered, [p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(gathered[0], gathered[1])), "the ranks stay identical"
    return None


@pytest.mark.parametrize("buffer", [0, 2**20], ids=["unbucketed", "bucketed"])
@pytest.mark.parametrize("auto_refresh", [True, False], ids=["auto refresh", "refresh_trainable() on rank 1"])
def test_one_rank_freezing_a_layer(buffer: int, auto_refresh: bool) -> None:
    messages = run_distributed(_freeze_body, 2, buffer, auto_refresh, False, timeout=TIMEOUT)
    assert messages[0] == messages[1] and messages[0] is not None, "the same error on every rank"
    assert messages[0].startswith("ShardedDataParallel: the parameters to reduce"), messages[0]
    assert "('1.weight', True, True) vs ('1.weight', False, False)" in messages[0], messages[0]
    assert "Freeze or unfreeze parameters on every rank alike" in messages[0]


def test_one_rank_freezing_a_layer_without_refresh() -> None:
    """auto_refresh_trainable=False and no refresh_trainable(): the flags still differ (unbucketed, the frozen
    parameter's reduction would never come from rank 1)."""

    messages = run_distributed(_freeze_without_refresh_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "('1.weight', True, True) vs ('1.weight', False, True)" in messages[0], messages[0]


def _freeze_without_refresh_body(rank: int, world_size: int) -> Optional[str]:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=0, auto_refresh_trainable=False)
    sdp(_batch(0, rank)).sum().backward()
    if rank == 1:
        model[1].weight.requires_grad_(False)
    sdp.zero_grad()
    try:
        sdp(_batch(1, rank)).sum().backward()
    except RanksDisagreeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("auto_refresh", [True, False], ids=["auto refresh", "refresh_trainable()"])
def test_every_rank_freezing_the_same_layer_trains_on(auto_refresh: bool) -> None:
    assert run_distributed(_freeze_body, 2, 2**20, auto_refresh, True, timeout=TIMEOUT) == [None, None]
