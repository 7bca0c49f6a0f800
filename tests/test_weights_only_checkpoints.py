# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale's checkpoints load with ``torch.load``'s default since torch 2.6, ``weights_only=True``.

That loader refuses any object but tensors, containers and plain numbers: a checkpoint with another type in it
(a numpy array, an enum, a dataclass) fails to load in user code that passes no argument. Checked here for what the
FSDP, OSS, Adam and grad-scaler checkpoints hold, each saved and loaded back whole. AdaScale's statistics are numpy
arrays, as upstream's, so its checkpoint needs ``weights_only=False`` (docs/optim.rst); the test pins that too, so
that a change of either is seen.
"""

import io
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.optim import OSS, Adam, AdaScale
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler

TIMEOUT = 120.0


def _round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _loads_whole(obj: Dict[str, Any]) -> None:
    _assert_same(_round_trip(obj), obj)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optim.step()


def _fsdp_case() -> None:
    model = _model()
    model[0] = FSDP(model[0], mixed_precision=True, compute_dtype=torch.bfloat16)
    model = FSDP(model, mixed_precision=True, compute_dtype=torch.bfloat16)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optim)
    _loads_whole(model.state_dict())
    _loads_whole(model.local_state_dict())
    _loads_whole(model.local_metadata_dict())
    full = model.gather_full_optim_state_dict(optim)
    if dist.get_rank() == 0:
        _loads_whole(full)
        _loads_whole(model.get_shard_from_optim_state_dict(full))
    _loads_whole(optim.state_dict())


def _oss_case() -> None:
    model = _model()
    optim = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    _step(model, optim)
    _loads_whole(optim.state_dict(all_ranks=True))


def _scalers_case() -> None:
    for scaler in (GradScaler(device="cpu"), ShardedGradScaler(device="cpu")):
        _loads_whole(scaler.state_dict())


def _body(rank: int, world_size: int) -> None:
    run_cases([("fsdp", _fsdp_case), ("oss", _oss_case), ("scalers", _scalers_case)])


def test_fsdp_oss_and_scaler_checkpoints_load_weights_only() -> None:
    run_distributed(_body, 2, timeout=TIMEOUT)


def test_adam_checkpoint_loads_weights_only() -> None:
    model = _model()
    optim = Adam(model.parameters(), lr=0.1)
    _step(model, optim)
    _loads_whole(optim.state_dict())


def test_adascale_checkpoint_needs_weights_only_false() -> None:
    model = _model()
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    for _ in range(2):
        model(torch.randn(2, 4)).pow(2).mean().backward()
    optim.step()
    state = optim.state_dict()
    with pytest.raises(Exception, match="weights_only"):
        _round_trip(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert sorted(loaded["state"]["adascale"]) == sorted(state["state"]["adascale"])
