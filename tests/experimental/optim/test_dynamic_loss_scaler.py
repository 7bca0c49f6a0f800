# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DynamicLossScaler: training through it converges, and its scale schedule is upstream's (expected values were
produced by running upstream fairscale 0.4.13 on the same sequences)."""

from typing import Any

import numpy as np
import pytest
import torch

from fairscale.experimental.optim import DynamicLossScaler


class _LinearRegression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_dls_without_overflow() -> None:
    rng = np.random.RandomState(42)
    x = rng.rand(100, 1)
    y = 1 + 2 * x + 0.1 * rng.randn(100, 1)
    x_t, y_t = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    torch.manual_seed(0)
    model = _LinearRegression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    loss_fn = torch.nn.MSELoss()
    for _ in range(1000):
        optimizer.zero_grad()
        loss = loss_fn(model(x_t), y_t)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.loss_scale == 2.0**15  # 1000 updates: no overflow, and the first growth comes at 2000
    assert abs(model.linear.weight.item() - 2.0) <= 0.05
    assert abs(model.linear.bias.item() - 1.0) <= 0.03


def test_scale_schedule() -> None:
    """init 4, window 3, an overflow at iteration 1: 4 -> 2, grows to 4 and 8; the skipped step leaves p alone."""
    scaler = DynamicLossScaler(init_scale=4, scale_window=3)
    p = torch.nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([p], lr=0.1)
    seen = []
    for it in range(9):
        p.grad = torch.full((2,), float("inf") if it == 1 else 8.0)
        result = scaler.step(optim)
        assert (result is None) if it == 1 else True
        scaler.update()
        seen.append((scaler.loss_scale, scaler._iter, scaler._last_overflow_iter, scaler._last_rescale_iter))
    assert seen == [
        (4, 1, -1, -1), (2.0, 3, 1, 1), (2.0, 4, 1, 1), (4.0, 5, 1, 4), (4.0, 6, 1, 4), (4.0, 7, 1, 4),
        (8.0, 8, 1, 7), (8.0, 9, 1, 7), (8.0, 10, 1, 7),
    ]  # fmt: skip
    torch.testing.assert_close(p.detach(), torch.full((2,), -0.8), atol=1e-6, rtol=0)


def test_tolerance_threshold_and_limits() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler(init_scale=16, tolerance=0.5, threshold=3.0)
    seen = []
    for it in range(6):
        p.grad = torch.full((2,), float("inf") if it % 2 == 0 else 1.0)
        scaler.step(optim)
        scaler.update()
        seen.append((scaler.loss_scale, scaler._overflows_since_rescale, scaler._iter))
    assert seen == [(8.0, 0, 2), (8.0, 0, 3), (8.0, 1, 5), (8.0, 1, 6), (8.0, 2, 8), (8.0, 2, 9)]

    floor = DynamicLossScaler(init_scale=1.0, min_loss_scale=0.6)
    p.grad = torch.full((2,), float("nan"))
    with pytest.raises(FloatingPointError, match=r"Minimum loss scale reached \(0.6\)"):
        floor.step(optim)
    assert floor.loss_scale == 1.0  # restored
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        floor.step(optim, closure=lambda: 0.0)


def test_unscale_and_state_dict() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler(init_scale=4)
    assert torch.equal(scaler.scale(torch.ones(2)), torch.full((2,), 4.0))
    p.grad = torch.full((2,), 8.0)
    scaler.unscale_(optim)
    assert p.grad.tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optim)
    scaler.step(optim)  # unscale_, clip, step (torch's GradScaler order): divided once (upstream: twice, silently)
    assert p.grad.tolist() == [2.0, 2.0]
    assert torch.allclose(p.detach(), torch.full((2,), 0.8))
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(optim)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optim)
    scaler.update()
    p.grad = torch.full((2,), 8.0)
    scaler.step(optim)  # a new iteration: step unscales itself
    assert p.grad.tolist() == [2.0, 2.0]
    for bad in ({"scale_window": 0}, {"init_scale": 0.0}, {"scale_factor": float("nan")}):
        with pytest.raises(ValueError, match="DynamicLossScaler: "):
            DynamicLossScaler(**bad)  # type: ignore[arg-type]
    assert scaler.state_dict()["loss_scale"] == 4
    other = DynamicLossScaler()
    other.load_state_dict({})
    assert other.loss_scale == 2.0**15
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 4


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0, -2.0, None, "1024", True, 10**400])
def test_load_state_dict_refuses_a_loss_scale_that_cannot_work(bad: Any) -> None:
    """Upstream took any value: inf or NaN skipped every later step, silently; 0 failed at the first step."""
    scaler = DynamicLossScaler(init_scale=8.0)
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        scaler.load_state_dict({"loss_scale": bad})
    assert scaler.loss_scale == 8.0
    scaler.load_state_dict({"loss_scale": 4})
    assert scaler.state_dict()["loss_scale"] == 4


def _scale_history(scaler: DynamicLossScaler, iterations: range, overflow_at: set) -> list:
    """Run the iterations (an inf gradient at ``overflow_at``), recording the scale after each update()."""
    p = torch.nn.Parameter(torch.ones(1))
    optim = torch.optim.SGD([p], lr=0.0)
    history = []
    for i in iterations:
        p.grad = torch.full((1,), float("inf") if i in overflow_at else 1.0)
        scaler.step(optim)
        scaler.update()
        history.append(scaler.loss_scale)
    return history


def test_a_resumed_scaler_changes_its_scale_at_the_same_iterations() -> None:
    # Upstream's dict holds the scale only: the counters restarted on resume, and the scale grew scale_window clean
    # iterations after the resume instead of after the last overflow.
    overflows = {3, 11}
    kwargs: Any = dict(init_scale=1024.0, scale_window=8, tolerance=0.25)
    whole = _scale_history(DynamicLossScaler(**kwargs), range(40), overflows)
    first = DynamicLossScaler(**kwargs)
    history = _scale_history(first, range(14), overflows)
    resumed = DynamicLossScaler(**kwargs)
    resumed.load_state_dict(first.state_dict())
    history += _scale_history(resumed, range(14, 40), overflows)
    assert history == whole
    # An upstream dict (the scale only) still loads, and keeps the counters as they are.
    scale_only = DynamicLossScaler(**kwargs)
    scale_only.load_state_dict({"loss_scale": first.loss_scale})
    assert scale_only.loss_scale == first.loss_scale and scale_only.state_dict()["iter"] == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"iter": 5}, "has the counters"),
        ({"iter": 5, "last_overflow_iter": 2, "last_rescale_iter": 2, "overflows_since_rescale": 1.5}, "integer"),
        ({"iter": 5, "last_overflow_iter": True, "last_rescale_iter": 2, "overflows_since_rescale": 0}, "integer"),
        ({"iter": 5, "last_overflow_iter": 9, "last_rescale_iter": 2, "overflows_since_rescale": 0}, "inconsistent"),
        ({"iter": -1, "last_overflow_iter": -1, "last_rescale_iter": -1, "overflows_since_rescale": 0}, "inconsistent"),
    ],
)
def test_load_state_dict_refuses_bad_counters_and_changes_nothing(bad: Any, match: str) -> None:
    scaler = DynamicLossScaler(init_scale=8.0)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict({"loss_scale": 2.0, **bad})
    assert scaler.state_dict() == before  # the scale too: all or nothing


def _step_then_overflow(dtype: torch.dtype, start: float, grad: float, scale: float) -> None:
    """One SGD step (lr 1) through a scaler with loss scale ``scale`` of a parameter at ``start`` with gradient
    ``grad``: it must land at ``start - grad / scale``; then an inf gradient must still be an overflow."""
    p = torch.nn.Parameter(torch.full((2,), start, dtype=dtype))
    optim = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler(init_scale=scale)
    p.grad = torch.full((2,), grad, dtype=dtype)
    scaler.step(optim)
    scaler.update()
    assert scaler.loss_scale == scale
    torch.testing.assert_close(p.detach(), torch.full((2,), start - grad / scale, dtype=dtype))
    p.grad = torch.tensor([float("inf"), 1.0]).to(dtype)
    assert scaler.step(optim) is None and scaler.loss_scale == scale / 2  # an overflow is still one


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex_gradients_step(dtype: torch.dtype) -> None:
    # The norm was taken with dtype=float32, which torch refuses for float64 ("without narrowing") and complex input.
    _step_then_overflow(dtype, start=1.0, grad=4.0, scale=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_finite_gradients_are_not_an_overflow(dtype: torch.dtype) -> None:
    # Their squares exceed float32's range: the norm was inf, the step skipped and the scale halved (a fuzz, session 45).
    _step_then_overflow(dtype, start=0.0, grad=2e19, scale=1.0)


def test_a_load_between_backward_and_step_keeps_the_iterations_scale() -> None:
    # The gradients were multiplied by the iteration's scale (8); the load reset it, and step() divided them by the
    # loaded 4: twice too large (found by a fuzz, session 38). The loaded scale applies from the next iteration.
    p1 = torch.nn.Parameter(torch.zeros(2))
    o1 = torch.optim.SGD([p1], lr=1.0)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(torch.tensor(1.0))  # the gradients below were multiplied by 8
    p1.grad = torch.full((2,), 8.0)
    scaler.load_state_dict({"loss_scale": 4.0})
    scaler.step(o1)
    assert p1.tolist() == [-1.0, -1.0]
    scaler.update()
    assert scaler.scale(torch.tensor(1.0)).item() == 4.0


def test_scale_and_step_refuse_what_they_cannot_take() -> None:
    scaler = DynamicLossScaler(init_scale=4)
    with pytest.raises(TypeError, match="expected the loss"):
        scaler.scale([torch.ones(1)])  # type: ignore[arg-type]
    for method in (scaler.step, scaler.unscale_):
        with pytest.raises(TypeError, match="expected a torch optimizer"):
            method(None)  # type: ignore[arg-type]


def test_a_loss_scale_past_int64_loads_as_the_float_it_is() -> None:
    """2**70 is a finite scale; kept as an int, the next scale() raised a bare OverflowError (a review, session 50)."""
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.load_state_dict({"loss_scale": 2**70})
    assert scaler.loss_scale == float(2**70)
    assert scaler.scale(torch.ones(1)).item() == float(2**70)
