# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Objects holding an explicit process group (MOELayer, the experimental SyncBatchNorm, ShardedGradScaler) refuse
pickling with a ``TypeError`` that names them and says what to save instead (before: torch's "cannot pickle
'ProcessGroup' object", from deep inside ``torch.save(model)``). With the default group they pickle, and deep copies
share an explicit group (both as before)."""

import copy
import functools
import io
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.experimental.nn import SyncBatchNorm
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn import MOELayer, Top2Gate
from fairscale.optim.grad_scaler import ShardedGradScaler


def _moe(group: Optional[Any]) -> Any:
    return nn.Sequential(nn.Linear(4, 4), MOELayer(Top2Gate(4, 2), nn.ModuleList([nn.Linear(4, 4)]), group=group))


def _sync_bn(group: Optional[Any]) -> Any:
    return nn.Sequential(nn.Conv2d(2, 4, 1), SyncBatchNorm(4, process_group=group))


def _scaler(group: Optional[Any]) -> Any:
    return ShardedGradScaler(process_group=group)


_MAKERS = {"MOELayer": _moe, "SyncBatchNorm": _sync_bn, "ShardedGradScaler": _scaler}


def _case(name: str, make: Callable[[Optional[Any]], Any]) -> None:
    group = dist.new_group([0, 1])
    held = make(group)
    with pytest.raises(TypeError, match=f"{name} cannot be pickled.*state_dict"):
        torch.save(held, io.BytesIO())
    copied = copy.deepcopy(held)  # still works, sharing the group
    assert type(copied) is type(held)
    buffer = io.BytesIO()
    torch.save(make(None), buffer)  # the default group is looked up again where it is loaded
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is type(held)  # our own object, written just above


def _body(rank: int, world_size: int) -> None:
    run_cases((name, functools.partial(_case, name, make)) for name, make in _MAKERS.items())


def test_objects_holding_an_explicit_group_refuse_pickling_by_name() -> None:
    run_distributed(_body, 2, timeout=120.0)
