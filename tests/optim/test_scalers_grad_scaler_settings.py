# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""GradScaler / ShardedGradScaler settings that used to be accepted and then failed late or silently.

* torch's setters (``set_backoff_factor``, ``set_growth_factor``, ``set_growth_interval``) stored any value: a
  backoff factor of 0 zeroed the scale at the next overflow and wrote NaN into the weights, and the scaler's own
  state dict no longer loaded.
* ``update(new_scale=tensor([False]))`` (or a complex tensor) set the scale to 0: the next step wrote NaN.
* A float ``growth_interval`` (``2e3``, or ``4.0`` in a state dict) passed the "integer" check, and every ``update()``
  then raised inside torch, after the optimizer had already stepped.
* A loaded ``_growth_tracker`` at or beyond the interval was accepted, and the scale never grew again.

The references are ``torch.amp.GradScaler("cpu")`` runs of the same steps.
"""

import math
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use
from torch import nn

from fairscale.internal.device import device_generic_amp_scaler
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler

# torch < 2.3 has no device-generic torch.amp.GradScaler: the scalers are CUDA-only and disabled on the CPU.
pytestmark = pytest.mark.skipif(
    not device_generic_amp_scaler(),
    reason=f"torch {torch.__version__} has no CPU grad scaler (device-generic torch.amp.GradScaler: torch >= 2.3)",
)

SCALERS = [GradScaler, ShardedGradScaler]


def _run(scaler: Any, steps: int, inf_steps: Tuple[int, ...] = ()) -> Tuple[List[float], torch.Tensor]:
    """``steps`` iterations of a 2-parameter SGD model; the gradient of ``inf_steps`` holds an inf."""
    p = nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([p], lr=0.01)
    scales = []
    for step in range(steps):
        optim.zero_grad()
        scaler.scale((p * 3.0).sum()).backward()
        if step in inf_steps:
            with torch.no_grad():
                p.grad[0] = math.inf  # type: ignore[index]
        scaler.step(optim)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales, p.detach().clone()


# ------------------------------------------------------------------------------------------------------------------
# torch's setters


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize(
    "setter,value,error,message",
    [
        ("set_backoff_factor", 0.0, ValueError, "backoff_factor must be in \\(0, 1\\)"),
        ("set_backoff_factor", 1.0, ValueError, "backoff_factor must be in \\(0, 1\\)"),
        ("set_backoff_factor", "0.5", TypeError, "backoff_factor must be a finite real number"),
        ("set_growth_factor", 0.5, ValueError, "growth_factor must be at least 1"),
        ("set_growth_factor", math.nan, TypeError, "growth_factor must be a finite real number"),
        ("set_growth_interval", 2.0, TypeError, "growth_interval must be an integer"),
        ("set_growth_interval", 2e3, TypeError, "growth_interval must be an integer"),
        ("set_growth_interval", "2000", TypeError, "growth_interval must be a finite real number"),
    ],
)
def test_setters_refuse_what_the_constructor_refuses(
    scaler_class: Any, setter: str, value: Any, error: type, message: str
) -> None:
    scaler = scaler_class(device="cpu", init_scale=8.0, growth_interval=3)
    _run(scaler, 2)
    before = scaler.state_dict()
    with pytest.raises(error, match=f"{scaler_class.__name__}.{setter}: {message}"):
        getattr(scaler, setter)(value)
    assert scaler.state_dict() == before  # nothing changed
    with pytest.raises(error, match=f"{scaler_class.__name__}: {message}"):  # the constructor's words
        scaler_class(device="cpu", **{setter[len("set_") :]: value})
    # What it writes still loads back, and it goes on training.
    scaler_class(device="cpu").load_state_dict(scaler.state_dict())
    _run(scaler, 2)
    # A disabled scaler never uses them, as torch's.
    getattr(scaler_class(device="cpu", enabled=False), setter)(value)


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_setters_refuse_a_zero_backoff_and_keep_torchs_behaviour_otherwise(scaler_class: Any) -> None:
    # Before: set_backoff_factor(0.0) was accepted; the overflow at step 2 zeroed the scale and every later step
    # wrote NaN into the weights.
    ours, theirs = scaler_class(device="cpu", init_scale=16.0), torch.amp.GradScaler("cpu", init_scale=16.0)
    with pytest.raises(ValueError):
        ours.set_backoff_factor(0.0)
    for scaler in (ours, theirs):
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_factor(4.0)
        scaler.set_growth_interval(np.int64(2))  # numpy and 0-dim integer tensors are integers to torch too
    (got_scales, got_weights), (want_scales, want_weights) = _run(ours, 6, (2,)), _run(theirs, 6, (2,))
    assert got_scales == want_scales == [16.0, 64.0, 16.0, 16.0, 64.0, 64.0]
    assert torch.equal(got_weights, want_weights) and bool(got_weights.isfinite().all())
    assert ours.state_dict() == theirs.state_dict()


def test_lowering_the_interval_below_the_count_grows_at_the_next_clean_step() -> None:
    # torch grows only when the count of clean steps equals the interval: lowered below the count, the scale
    # stopped growing until the next overflow (and the state dict was one load_state_dict refuses).
    scaler = GradScaler(device="cpu", init_scale=8.0, growth_interval=100)
    _run(scaler, 5)
    assert scaler.state_dict()["_growth_tracker"] == 5
    scaler.set_growth_interval(3)
    assert scaler.state_dict()["_growth_tracker"] == 2
    scales, _ = _run(scaler, 4)
    assert scales == [16.0, 16.0, 16.0, 32.0]
    GradScaler(device="cpu").load_state_dict(scaler.state_dict())
    # Raising it keeps the count (torch's behaviour).
    _run(scaler, 1)
    scaler.set_growth_interval(50)
    assert scaler.state_dict()["_growth_tracker"] == 1
    fresh = GradScaler(device="cpu")  # before the first scale() the count lives in a plain attribute
    fresh.set_growth_interval(1)
    assert fresh.state_dict()["_growth_tracker"] == 0


# ------------------------------------------------------------------------------------------------------------------
# update(new_scale=...)


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize(
    "bad", [torch.tensor([False]), torch.tensor([True]), torch.tensor([0j]), torch.tensor(2 + 0j)], ids=str
)
def test_update_refuses_a_bool_or_complex_new_scale(scaler_class: Any, bad: torch.Tensor) -> None:
    scaler = scaler_class(device="cpu", init_scale=16.0)
    p = nn.Parameter(torch.ones(3))
    optim = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(optim)
    with pytest.raises(TypeError, match=f"{scaler_class.__name__}.update: new_scale must be a real number or a real"):
        scaler.update(new_scale=bad)
    assert scaler.get_scale() == 16.0  # before: tensor([False]) set it to 0 and the next step wrote NaN
    scaler.update(new_scale=torch.tensor([4], dtype=torch.int32))  # an integer tensor is a real number
    assert scaler.get_scale() == 4.0
    optim.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.step(optim)
    scaler.update()
    assert bool(p.isfinite().all())


# ------------------------------------------------------------------------------------------------------------------
# growth_interval and _growth_tracker


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_float_growth_interval_is_refused_and_integers_load_as_in_torch(scaler_class: Any) -> None:
    # Before: a float was accepted, the optimizer stepped, then update() raised inside torch ("must be int, not
    # float") and the next iteration failed with "step() has already been called".
    scaler = scaler_class(device="cpu", init_scale=8.0, growth_interval=3)
    _run(scaler, 1)
    before = scaler.state_dict()
    for interval in (2e3, 4.0, torch.tensor(4.0)):
        with pytest.raises(TypeError, match=f"{scaler_class.__name__}: growth_interval must be an integer"):
            scaler_class(device="cpu", growth_interval=interval)
        with pytest.raises(TypeError, match="load_state_dict: growth_interval must be an integer"):
            scaler.load_state_dict({**before, "growth_interval": interval})
        assert scaler.state_dict() == before
    # What torch takes as an integer loads and trains as in torch: one clean step short of a growth.
    for interval in (4, np.int64(4), torch.tensor(4)):
        state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": interval}
        state["_growth_tracker"] = 3
        ours, theirs = scaler_class(device="cpu"), torch.amp.GradScaler("cpu")
        ours.load_state_dict(state)
        theirs.load_state_dict(state)
        (got_scales, got_weights), (want_scales, want_weights) = _run(ours, 6), _run(theirs, 6)
        assert got_scales == want_scales == [16.0, 16.0, 16.0, 16.0, 32.0, 32.0]
        assert torch.equal(got_weights, want_weights)


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("tracker", [2, 3, 50])
def test_a_growth_tracker_at_or_beyond_the_interval_is_loaded_and_clamped(scaler_class: Any, tracker: int) -> None:
    # Before: accepted as it was, and the scale never grew again (torch grows when the count equals the interval);
    # refusing it refused torch's own state dicts (its set_growth_interval can leave such a count).
    scaler = scaler_class(device="cpu", init_scale=8.0, growth_interval=5)
    _run(scaler, 1)
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
    scaler.load_state_dict({**state, "_growth_tracker": tracker})
    assert scaler.state_dict()["_growth_tracker"] == 1
    assert _run(scaler, 1)[0] == [16.0]  # the next clean step grows the scale
    # A non-positive interval (never grow) takes any count, as before.
    scaler.load_state_dict({**state, "growth_interval": 0, "_growth_tracker": tracker})
    assert scaler.state_dict()["_growth_tracker"] == tracker
    scaler.load_state_dict({**state, "_growth_tracker": 1})
    assert _run(scaler, 2)[0] == [16.0, 16.0]
