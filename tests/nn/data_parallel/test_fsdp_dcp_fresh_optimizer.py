# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``fsdp_dcp.save`` of an optimizer that has no state yet (before its first step, or plain SGD, which never has):
the save writes its param_groups only and changes nothing. It used to create the state with a hidden step at
learning rate 0, which wrote the parameters in place (a save between a forward and its backward made that backward
fail) and set Adam's step counter to 1 (every later update had another bias correction). Such a checkpoint loads: the
model goes back and the optimizer to no state, and training on from it equals training from the start."""

import functools
import os
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp

STEPS = 3


def _model() -> Tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)


def _batch(step: int, rank: int) -> Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: FSDP, optim: Any, rank: int, save_mid_step: Optional[str] = None) -> None:
    for step in range(STEPS):
        loss = model(_batch(step, rank)).square().sum()
        if save_mid_step is not None and step == 0:
            fsdp_dcp.save(model, optim, checkpoint_id=save_mid_step)
        loss.backward()
        optim.step()
        optim.zero_grad()


def _result(model: FSDP, optim: Any) -> Tuple[Dict[str, Tensor], Any]:
    return {k: v.clone() for k, v in model.state_dict().items()}, optim.state_dict()["state"]


def _assert_same(a: Tuple[Dict[str, Tensor], Any], b: Tuple[Dict[str, Tensor], Any], what: str) -> None:
    for key in a[0]:
        assert torch.equal(a[0][key], b[0][key]), f"{what}: {key} differs"
    assert a[1].keys() == b[1].keys(), what
    for i in a[1]:
        for key, value in a[1][i].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[1][i][key])), f"{what}: state {i} {key}"


def _uninterrupted(rank: int) -> Tuple[Dict[str, Tensor], Any]:
    model, optim = _model()
    _train(model, optim, rank)
    return _result(model, optim)


def _case_save_before_training(root: str, rank: int) -> None:
    model, optim = _model()
    fsdp_dcp.save(model, optim, checkpoint_id=os.path.join(root, "before"))
    assert not optim.state, "the save created optimizer state"
    _train(model, optim, rank)
    _assert_same(_result(model, optim), _uninterrupted(rank), "saved before the first step")


def _case_save_between_forward_and_backward(root: str, rank: int) -> None:
    model, optim = _model()
    _train(model, optim, rank, save_mid_step=os.path.join(root, "mid"))
    _assert_same(_result(model, optim), _uninterrupted(rank), "saved between the first forward and its backward")


def _case_stateless_checkpoint_loads(root: str, rank: int) -> None:
    path = os.path.join(root, "fresh")
    model, optim = _model()
    fsdp_dcp.save(model, optim, checkpoint_id=path)
    _train(model, optim, rank)  # now it has state, and other weights
    fsdp_dcp.load(model, optim, checkpoint_id=path)
    assert not optim.state, "loading a checkpoint saved before the first step left optimizer state"
    _train(model, optim, rank)
    _assert_same(
        _result(model, optim), _uninterrupted(rank), "trained on from a checkpoint saved before the first step"
    )
    other, other_optim = _model()
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    assert not other_optim.state, "a fresh optimizer got state from a checkpoint that has none"
    _train(other, other_optim, rank)
    _assert_same(_result(other, other_optim), _uninterrupted(rank), "a fresh model loaded from it")


def _case_load_between_forward_and_backward(root: str, rank: int) -> None:
    """Refused before the load creates a fresh optimizer's state (a step that wrote the parameters in place and made
    the pending backward fail)."""
    path = os.path.join(root, "trained")
    model, optim = _model()
    _train(model, optim, rank)
    fsdp_dcp.save(model, optim, checkpoint_id=path)
    fresh, fresh_optim = _model()
    loss = fresh(_batch(0, rank)).square().sum()
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        fsdp_dcp.load(fresh, fresh_optim, checkpoint_id=path)
    assert not fresh_optim.state
    loss.backward()  # still possible


def _body(rank: int, world_size: int, root: str) -> None:
    cases = (
        _case_save_before_training,
        _case_save_between_forward_and_backward,
        _case_stateless_checkpoint_loads,
        _case_load_between_forward_and_backward,
    )
    run_cases((case.__name__[len("_case_") :], functools.partial(case, root, rank)) for case in cases)


def test_saving_an_optimizer_without_state(tmp_path: Any) -> None:
    run_distributed(_body, 2, str(tmp_path))
