# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""LayerwiseGradientScaler: call orders and settings that used to give silently wrong gradients or scales.

* A ``scale()`` / ``unscale()`` pair per micro-batch divided the micro-batches already unscaled again (fc1's
  gradient came out 70% off); now ``scale()`` scales the held gradients back first, so the pairs accumulate right,
  and upstream's loop (``scale()``, then ``zero_grad()``, ..., ``unscale()``, the optimizer's own ``step()``) runs.
* ``growth_interval`` 0, -1, 2.5 or ``"2"`` never grew the scales; ``min_scale=inf`` pinned them at inf; a
  ``max_scale`` below ``min_scale`` was accepted.

The reference is the same model trained without the scaler.
"""

import math
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn

from fairscale.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

SCALES = {"fc1": 64.0, "fc2": 8.0}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 3)
        self.fc2 = nn.Linear(3, 1)
        self.identity = nn.Identity()  # the last module at scale 1: the scheme is exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.identity(self.fc2(torch.relu(self.fc1(x))))


def _micro_batches() -> List[torch.Tensor]:
    return [torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _reference_grads(batches: List[torch.Tensor]) -> List[torch.Tensor]:
    model = _model()
    for x in batches:
        model(x).sum().backward()
    return _grads(model)


def _assert_close(got: List[torch.Tensor], want: List[torch.Tensor]) -> None:
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_scale_unscale_pair_per_micro_batch_accumulates_right() -> None:
    # Before: the next unscale() divided the first micro-batch's (already unscaled) gradients again.
    batches = _micro_batches()
    model = _model()
    scaler = LayerwiseGradientScaler(model, SCALES)
    for x in batches:
        scaler.scale()
        model(x).sum().backward()
        scaler.unscale()
    _assert_close(_grads(model), _reference_grads(batches))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_upstreams_loop_and_one_pair_around_accumulation(set_to_none: bool) -> None:
    batches = _micro_batches()
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LayerwiseGradientScaler(model, SCALES)
    reference = _model()
    reference.load_state_dict(model.state_dict())
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    # Upstream's loop: scale() before zero_grad() (the scale() after a previous unscale() was refused for a while).
    for x in batches:
        scaler.scale()
        optim.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()
        scaler.unscale()
        optim.step()  # the optimizer's own step (gradient clipping goes between)
        ref_optim.zero_grad(set_to_none=set_to_none)
        reference(x).sum().backward()
        ref_optim.step()
    _assert_close(list(model.parameters()), list(reference.parameters()))
    # scale() once before the micro-batches, unscale() once after the last.
    optim.zero_grad(set_to_none=set_to_none)
    ref_optim.zero_grad(set_to_none=set_to_none)
    scaler.scale()
    for x in batches:
        model(x).sum().backward()
        reference(x).sum().backward()
    scaler.unscale()
    _assert_close(_grads(model), _grads(reference))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1"),
        ({"growth_interval": -1}, ValueError, "growth_interval must be >= 1"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
        ({"growth_interval": math.inf}, TypeError, "growth_interval must be an int"),
        ({"growth_interval": "2"}, TypeError, "growth_interval must be an int"),
        ({"growth_interval": True}, TypeError, "growth_interval must be an int"),
        ({"min_scale": math.inf}, ValueError, "min_scale must be finite"),
        ({"min_scale": "1"}, TypeError, "min_scale must be a number"),
        ({"max_scale": math.nan}, ValueError, "max_scale must be finite"),
        ({"max_scale": 1.0, "min_scale": 2.0}, ValueError, "min_scale \\(2.0\\) must not exceed max_scale \\(1.0\\)"),
    ],
)
def test_settings_that_stall_or_pin_the_scales_are_refused(kwargs: Dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=f"LayerwiseGradientScaler: {message}"):
        LayerwiseGradientScaler(_model(), SCALES, **kwargs)
    LayerwiseGradientScaler(_model(), {}, **kwargs)  # scaling disabled: the settings are never used (as upstream)
