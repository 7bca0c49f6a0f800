# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""LayerwiseGradientScaler: scaled training gives the unscaled gradients back, overflows skip the step and adapt
the scales as upstream does (the sequences were produced by running upstream fairscale 0.4.13)."""

from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.optim.layerwise_gradient_scaler import GradientHelper, LayerInfo, LayerwiseGradientScaler

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

SCALES = {"fc1": 1024.0, "fc2": 512.0, "fc3": 1024.0}


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 6)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(6, 5)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(5, 1)
        self.sigmoid = nn.Sigmoid()
        self.identity = nn.Identity()  # last module at scale 1: the scheme is exact

    def forward(self, x: Tensor) -> Tensor:
        return self.identity(self.sigmoid(self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))))


def _blobs() -> Tuple[Tensor, Tensor]:
    """40 points around two centres, labelled by centre."""
    gen = torch.Generator().manual_seed(7)
    y = torch.arange(40) % 2
    centres = torch.tensor([[-2.0, 1.0], [3.0, -1.0]])
    x = centres[y] + 0.8 * torch.randn(40, 2, generator=gen)
    return x, y.float().unsqueeze(1)


def _train(scales: Dict[str, float], epochs: int = 2, lr: float = 1e-3, **kwargs: float) -> Tuple[List, List]:
    torch.manual_seed(0)
    model = FeedForward()
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = LayerwiseGradientScaler(model, scales, **kwargs)  # type: ignore[arg-type]
    x, y = _blobs()
    raw, grads = [], []
    for _ in range(epochs):
        optim.zero_grad()
        scaler.scale()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        raw.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        scaler.unscale()
        assert all(not hooks[0] and not hooks[1] for _, hooks in scaler.get_backward_hooks())
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        scaler.step(optim)
    return raw, grads


def test_linear_model() -> None:
    raw, scaled = _train(SCALES)
    _, plain = _train({})
    for epoch in range(2):
        for a, b in zip(scaled[epoch], plain[epoch]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Before unscale() the gradients really carried the layer scales (fc1, fc2, fc3: weight and bias each).
    for i, scale in [(0, 1024.0), (1, 1024.0), (2, 512.0), (3, 512.0), (4, 1024.0), (5, 1024.0)]:
        torch.testing.assert_close(raw[0][i], plain[0][i] * scale, rtol=1e-5, atol=1e-6)


def test_overflow_skips_and_adapts_scales() -> None:
    torch.manual_seed(0)
    model = FeedForward()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LayerwiseGradientScaler(model, {"fc1": 1024, "fc2": 512, "fc3": 8}, growth_interval=2)
    x, y = _blobs()
    seen = []
    for epoch in range(5):
        optim.zero_grad()
        scaler.scale()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        if epoch == 1:
            with torch.no_grad():
                model.fc2.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.unscale()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optim)
        stepped = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        info = scaler.get_layer_info()
        seen.append(([i.scaling_factor for i in info], [i.growth_tracker for i in info], stepped))
    assert seen == [
        ([1024, 1.0, 512, 1.0, 8, 1.0, 1.0], [1, 1, 1, 1, 1, 1, 1], True),
        ([2048.0, 1.0, 256.0, 1.0, 16.0, 1.0, 1.0], [0, 2, 0, 2, 0, 2, 2], False),  # fc2 backs off, the rest grow
        ([2048.0, 1.0, 256.0, 1.0, 16.0, 1.0, 1.0], [1, 3, 1, 3, 1, 3, 3], True),
        ([4096.0, 1.0, 512.0, 1.0, 32.0, 1.0, 1.0], [0, 4, 0, 4, 0, 4, 4], True),
        ([4096.0, 1.0, 512.0, 1.0, 32.0, 1.0, 1.0], [1, 5, 1, 5, 1, 5, 5], True),
    ]


def test_last_layer_scale_is_not_compensated() -> None:
    """Upstream behaviour: with the last module at scale s, every gradient comes out divided by s."""
    _, skewed = _train({"fc1": 4.0, "identity": 2.0}, epochs=1)
    _, plain = _train({}, epochs=1)
    for a, b in zip(skewed[0], plain[0]):
        torch.testing.assert_close(a, b / 2, rtol=1e-5, atol=1e-8)


def test_helpers_and_errors() -> None:
    model = FeedForward()
    disabled = LayerwiseGradientScaler(model, {})
    disabled.scale()
    assert disabled.get_layer_info() == [] and all(not h[0] for _, h in disabled.get_backward_hooks())
    info = LayerInfo("fc1", model.fc1, 8.0, True)
    assert (info.layer_name, info.scaling_factor, info.found_inf_or_nan, info.growth_tracker) == ("fc1", 8.0, False, 0)
    helper = GradientHelper("fc1", 4.0, 0.5)
    out = helper.scale_gradients(model.fc1, (torch.ones(2), None), (torch.ones(2),))
    assert torch.equal(out[0], torch.full((2,), 2.0)) and out[1] is None  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="growth factor"):
        LayerwiseGradientScaler(model, SCALES, growth_factor=1.0)
    with pytest.raises(AssertionError, match="backoff factor"):
        LayerwiseGradientScaler(model, SCALES, backoff_factor=1.0)
    with pytest.raises(ValueError, match="fc9"):
        LayerwiseGradientScaler(model, {"fc9": 2.0})


def test_flattened_parameters_are_refused() -> None:
    """Flattening joins the layers' parameters into one: unscale() found no gradient to divide per layer and left
    them scaled (x1024), silently. Both orders of building the scaler and wrapping the model raise instead."""
    from fairscale.nn.misc import FlattenParamsWrapper

    model = FeedForward()
    scaler = LayerwiseGradientScaler(model, SCALES)
    FlattenParamsWrapper(model)
    with pytest.raises(RuntimeError, match="layer 'fc1' holds the parameters \\[\\], not the \\['weight', 'bias'\\]"):
        scaler.scale()
    wrapped = FlattenParamsWrapper(FeedForward())
    scales = {name: 1024.0 for name, _ in wrapped.named_modules() if name.endswith("fc1")}
    with pytest.raises(ValueError, match="flattened parameters .*flatten_parameters=False"):
        LayerwiseGradientScaler(wrapped, scales)
