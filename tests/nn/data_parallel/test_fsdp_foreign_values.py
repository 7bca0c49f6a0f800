# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A flattened name holding a tensor the wrapper did not put there (``flatten_parameters=True``).

``torch.func.functional_call(model, weights, x)`` swaps the given tensors in for the call; an assignment after
wrapping (``model.module.fc.weight = t``) does the same for good. The forward replaced them by its own views: the
given values were silently not used, functional_call wrote FSDP's view back into the caller's dict, and reading it
after the next step read freed memory (a crash; found by a fuzz of FSDP with torch utilities, session 42). The
forward refuses them now, before anything is gathered or written, and ``del`` gives the name back. Two gloo ranks,
the same data on both: training around the refusals matches a single-process model.
"""

import functools
from typing import Dict

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.misc import FlattenParamsWrapper

WORLD = 2
TIMEOUT = 120.0
REFUSED = r"0\.weight \(Linear\.weight\) holds a tensor the wrapper did not put there .*\(del module\.weight"


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    model(_batch(step)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _assert_trained_like_reference(model: FSDP, steps: int) -> None:
    reference = _net()
    optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        _step(reference, optim, step)
    with model.summon_full_params():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), msg=lambda m: f"{name}: {m}")


def _case_functional_call(nested: bool) -> None:
    net = _net()
    if nested:
        net[2] = FSDP(net[2])
    model = FSDP(net)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    weights: Dict[str, torch.Tensor] = {k: v.clone() for k, v in _net().state_dict().items()}
    before = {k: v.clone() for k, v in weights.items()}
    # Nested: torch's swap reaches the inner FSDP wrapper first, whose attribute guard refuses the assignment.
    refused = (AttributeError, r"FullyShardedDataParallel: cannot assign Tensor to 'weight'") if nested else None
    with pytest.raises(refused[0] if refused else ValueError, match=refused[1] if refused else REFUSED):
        torch.func.functional_call(model, weights, (_batch(1),))
    _step(model, optim, 1)  # the refused call left the model as it was
    # The caller's dict holds its own tensors (it got FSDP's view, freed by this step: reading it crashed).
    for key, value in weights.items():
        assert type(value) is torch.Tensor and torch.equal(value, before[key]), key
    _assert_trained_like_reference(model, 2)


def _case_assignment_after_wrapping() -> None:
    model = FSDP(_net())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    model.module[0].weight = torch.zeros(6, 4)
    with pytest.raises(ValueError, match=REFUSED):
        model(_batch(1))
    del model.module[0].weight  # gives the name back: the next forward installs the wrapper's view
    _step(model, optim, 1)
    _assert_trained_like_reference(model, 2)


def _case_plain_wrapper() -> None:
    """FlattenParamsWrapper alone: the values passed were ignored, silently (the module's forward read the views)."""
    wrapper = FlattenParamsWrapper(_net())
    weights = {k: torch.zeros_like(v) for k, v in _net().state_dict().items()}
    with pytest.raises(ValueError, match=REFUSED):
        torch.func.functional_call(wrapper, weights, (_batch(0),))
    torch.testing.assert_close(wrapper(_batch(0)), _net()(_batch(0)))
    # A tied weight's further name (found by a review, session 43): it holds its first name's view.
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    tied_wrapper = FlattenParamsWrapper(tied)
    tied_wrapper(_batch(0))
    with pytest.raises(ValueError, match=r"2\.weight \(Linear\.weight\) holds a tensor the wrapper did not put"):
        torch.func.functional_call(tied_wrapper, {"2.weight": torch.zeros(4, 4)}, (_batch(0),))
    tied_wrapper(_batch(0)).sum().backward()  # and the wrapper still trains


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("functional_call", functools.partial(_case_functional_call, False)),
            ("functional_call, nested", functools.partial(_case_functional_call, True)),
            ("assignment after wrapping", _case_assignment_after_wrapping),
            ("plain wrapper", _case_plain_wrapper),
        ]
    )


def test_foreign_values_are_refused() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
