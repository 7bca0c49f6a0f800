# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Buffers registered on an FSDP instance itself after wrapping (``fsdp.register_buffer("ema_count", t)``).

``state_dict()`` writes them under the instance's prefix (``ema_count``, ``2.inner_count``), as torch writes any
module's buffers, but loading renamed them under the wrapped module and the root loaded through that module only:
the keys came back unexpected (and a nested instance's also missing), so a model did not load its own state dict
(found by a fuzz of FSDP with torch utilities, session 42). Two gloo ranks: full and local dicts, the root and a
nested instance, a plain parent module, and the errors of a strict load (the model left as it was).
"""

import functools
from typing import Dict

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 2
TIMEOUT = 120.0


def _model(flatten: bool) -> FSDP:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    net[2] = FSDP(net[2], flatten_parameters=flatten)
    model = FSDP(net, flatten_parameters=flatten)
    model.register_buffer("ema_count", torch.tensor(3.0))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)  # not saved, not expected back
    model.module[2].register_buffer("inner_count", torch.tensor([5.0, 6.0]))
    return model


def _doubled(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v * 2 for k, v in sd.items()}


def _assert_state(model: FSDP, expected: Dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=lambda m: f"{key}: {m}")


def _case_full_round_trip(flatten: bool, strict: bool) -> None:
    model = _model(flatten)
    model(torch.randn(5, 4)).sum().backward()
    saved = model.state_dict()
    assert "ema_count" in saved and "2.inner_count" in saved and "scratch" not in saved, sorted(saved)
    result = model.load_state_dict(_doubled(saved), strict=strict)
    assert not result.missing_keys and not result.unexpected_keys, result
    _assert_state(model, _doubled(saved))
    assert model.ema_count.item() == 6.0 and model.module[2].inner_count.tolist() == [10.0, 12.0]


def _case_local_round_trip() -> None:
    model = _model(True)
    saved = model.local_state_dict()
    assert "ema_count" in saved and "2.inner_count" in saved, sorted(saved)
    model.load_local_state_dict(_doubled(saved))
    assert model.ema_count.item() == 6.0 and model.module[2].inner_count.tolist() == [10.0, 12.0]


def _case_plain_parent_loads() -> None:
    """A plain module holding the FSDP root (a task wrapper) loads through torch's recursion and the instances'
    load hooks: the root's own buffer is a nested key there."""
    parent = nn.ModuleDict({"model": _model(True)})
    saved = parent.state_dict()
    assert "model.ema_count" in saved and "model.2.inner_count" in saved, sorted(saved)
    result = parent.load_state_dict(_doubled(saved))
    assert not result.missing_keys and not result.unexpected_keys, result
    assert parent["model"].ema_count.item() == 6.0


def _case_strict_errors_leave_the_model() -> None:
    model = _model(True)
    saved = model.state_dict()
    before = {k: v.clone() for k, v in saved.items()}
    for bad, pattern in (
        (
            {k: v for k, v in _doubled(saved).items() if k != "ema_count"},
            r"Missing key\(s\) in state_dict: 'ema_count'",
        ),
        ({**_doubled(saved), "ema_count": torch.ones(3)}, r"size mismatch for ema_count"),
        ({k: v for k, v in _doubled(saved).items() if k != "2.inner_count"}, r"Missing key.*2\.inner_count"),
    ):
        with pytest.raises(RuntimeError, match=pattern):
            model.load_state_dict(bad)
        _assert_state(model, before)
    result = model.load_state_dict({k: v for k, v in _doubled(saved).items() if k != "ema_count"}, strict=False)
    assert result.missing_keys == ["ema_count"] and not result.unexpected_keys, result
    assert model.ema_count.item() == 3.0 and model.module[2].inner_count.tolist() == [10.0, 12.0]


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("full round trip", functools.partial(_case_full_round_trip, True, True)),
            ("full round trip, not strict", functools.partial(_case_full_round_trip, True, False)),
            ("full round trip, not flattened", functools.partial(_case_full_round_trip, False, True)),
            ("local round trip", _case_local_round_trip),
            ("a plain parent loads", _case_plain_parent_loads),
            ("strict errors leave the model", _case_strict_errors_leave_the_model),
        ]
    )


def test_buffers_registered_on_instances_load_back() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
