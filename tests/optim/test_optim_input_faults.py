# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Optimizer helpers under input that used to be accepted and then fail late or give silently wrong values.

* ``GradScaler.update(new_scale=...)`` with 0, a negative, NaN or inf value (0 wrote NaN into the weights).
* ``LayerwiseGradientScaler`` with ``backoff_factor <= 0`` or ``min_scale <= 0`` (the scales collapsed).
* ``AdaScale.set_num_gradients_to_accumulate(1)`` with one worker (the statistics divided by 0).
* ``fairscale.optim.Adam`` param groups with their own invalid hyper-parameters (a bare ``IndexError`` in
  ``step()`` after the step counters moved).
* ``OSS.clip_grad_norm`` with a ``filter_params_fn`` that returns an iterator (``StopIteration``).
* ``OSS(broadcast_fp16=True)`` with complex parameters (their imaginary parts were erased).
* A dropped ``AdaScale`` (kept alive by its gradient hooks, it went on measuring every backward).
"""

import gc
import math
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.internal.device import device_generic_amp_scaler
from fairscale.internal.errors import FairscaleValueError
from fairscale.optim import OSS, Adam, AdaScale
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler
from fairscale.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

# Short: some of the failures these tests guard against were hangs.
TIMEOUT = 60.0

# torch < 2.3 has no device-generic torch.amp.GradScaler: its scalers, and fairscale's, are CUDA-only and disabled on
# the CPU, where update() returns at once, as torch's disabled scaler does.
needs_cpu_scalers = pytest.mark.skipif(
    not device_generic_amp_scaler(),
    reason=f"torch {torch.__version__} has no CPU grad scaler (device-generic torch.amp.GradScaler: torch >= 2.3)",
)


# ---------------------------------------------------------------------------------------------------------------
# GradScaler.update(new_scale=...)


def _scaled_step(scaler: GradScaler, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(optimizer)


@needs_cpu_scalers
@pytest.mark.parametrize("scaler_cls", [GradScaler, ShardedGradScaler])
@pytest.mark.parametrize(
    "bad",
    [0.0, -1.0, math.nan, math.inf, 1e39, torch.tensor(0.0), torch.tensor([math.nan])],
    ids=["zero", "negative", "nan", "inf", "beyond_fp32", "tensor_zero", "tensor_nan"],
)
def test_scaler_update_refuses_a_bad_new_scale(scaler_cls: Any, bad: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls(device="cpu", init_scale=1024.0)
    _scaled_step(scaler, model, optimizer)
    with pytest.raises(ValueError, match=f"{scaler_cls.__name__}.update: new_scale must be a positive finite"):
        scaler.update(new_scale=bad)
    # Nothing changed: the scale is the old one, and the step's inf/nan check is still there to update from.
    assert scaler.get_scale() == 1024.0
    scaler.update()
    assert scaler.get_scale() == 1024.0
    _scaled_step(scaler, model, optimizer)
    scaler.update()
    assert bool(model.weight.isfinite().all())


@needs_cpu_scalers
@pytest.mark.parametrize("good", [512.0, 512, torch.tensor(512.0), torch.tensor([512.0])])
def test_scaler_update_takes_a_good_new_scale(good: Any) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(device="cpu", init_scale=1024.0)
    _scaled_step(scaler, model, optimizer)
    scaler.update(new_scale=good)
    assert scaler.get_scale() == 512.0


# ---------------------------------------------------------------------------------------------------------------
# LayerwiseGradientScaler


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"backoff_factor": 0.0}, "backoff factor"),
        ({"backoff_factor": -1.0}, "backoff factor"),
        ({"backoff_factor": math.nan}, "backoff factor"),
        ({"min_scale": 0.0}, "min scale"),
        ({"min_scale": -1.0}, "min scale"),
    ],
)
def test_layerwise_scaler_refuses_nonpositive_backoff_and_min_scale(kwargs: Dict[str, float], what: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Identity())
    with pytest.raises(FairscaleValueError, match=f"The {what} must be"):
        LayerwiseGradientScaler(model, {"0": 1024.0}, **kwargs)
    # Scaling disabled (empty dict): every method is a pass-through, the factors are not used.
    LayerwiseGradientScaler(model, {}, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# AdaScale.set_num_gradients_to_accumulate


def _gains_beside_a_fresh_copy(model: nn.Linear, optim: AdaScale) -> Tuple[float, float]:
    """Run one step of two backward passes through ``model`` (stepping ``optim``, which accumulates 2 gradients
    on one worker) and, on the same inputs, through a copy of ``model`` under a fresh AdaScale: both gains."""
    torch.manual_seed(1)
    reference_model = nn.Linear(4, 4)
    reference_model.load_state_dict(model.state_dict())
    reference = AdaScale(
        torch.optim.SGD(reference_model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2
    )
    for _ in range(2):
        x = torch.randn(8, 4)
        model(x).pow(2).sum().backward()
        reference_model(x).pow(2).sum().backward()
    optim.step()
    reference.step()
    return optim.gain(), reference.gain()


def test_adascale_setter_refuses_a_single_worker_without_accumulation() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError) as at_construction:
        AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=1)
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    smoothing = optim.smoothing
    with pytest.raises(RuntimeError) as in_setter:
        optim.set_num_gradients_to_accumulate(1)
    assert str(in_setter.value) == str(at_construction.value)
    for bad in (0, -1, 2.5):
        with pytest.raises(FairscaleValueError, match="num_gradients_to_accumulate must be"):
            optim.set_num_gradients_to_accumulate(bad)
    # Nothing changed: the 2-gradient window still works, with the same statistics as a fresh AdaScale.
    assert optim._num_grads_to_accum == 2 and optim.smoothing == smoothing
    gain, reference_gain = _gains_beside_a_fresh_copy(model, optim)
    assert math.isfinite(gain) and gain == reference_gain


# ---------------------------------------------------------------------------------------------------------------
# fairscale.optim.Adam param groups


_BAD_HYPER = [{"betas": (0.9,)}, {"betas": (0.9, 1.5)}, {"lr": -1.0}, {"eps": -1.0}, {"weight_decay": -0.1}]


def _message_for_defaults(bad: Dict[str, Any]) -> str:
    with pytest.raises(ValueError) as refused:
        Adam([nn.Parameter(torch.ones(4))], **bad)
    return str(refused.value)


@pytest.mark.parametrize("bad", _BAD_HYPER, ids=lambda bad: "-".join(f"{k}={v}" for k, v in bad.items()))
def test_adam_checks_each_param_group_as_the_defaults(bad: Dict[str, Any]) -> None:
    expected = _message_for_defaults(bad)
    p = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError) as in_constructor:
        Adam([{"params": [p], **bad}], lr=1e-3)
    assert str(in_constructor.value) == expected

    optim = Adam([p], lr=1e-3)
    q = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError) as in_add:
        optim.add_param_group({"params": [q], **bad})
    assert str(in_add.value) == expected
    assert len(optim.param_groups) == 1  # nothing added


@pytest.mark.parametrize("bad", _BAD_HYPER, ids=lambda bad: "-".join(f"{k}={v}" for k, v in bad.items()))
def test_adam_step_changes_nothing_with_an_edited_bad_group(bad: Dict[str, Any]) -> None:
    p = nn.Parameter(torch.ones(4))
    q = nn.Parameter(torch.ones(4))
    optim = Adam([{"params": [p]}, {"params": [q]}], lr=1e-3)
    reference_p = nn.Parameter(torch.ones(4))
    reference = Adam([reference_p], lr=1e-3)
    optim.param_groups[1].update(bad)  # edited after it was checked
    p.grad, q.grad, reference_p.grad = torch.ones(4), torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match=_message_for_defaults(bad).split(":")[0]):
        optim.step()
    # No group stepped and no state was created: the first group's step counter did not move.
    assert len(optim.state) == 0
    assert torch.equal(p.detach(), torch.ones(4)) and torch.equal(q.detach(), torch.ones(4))
    optim.param_groups[1].update({k: reference.defaults[k] for k in bad})
    optim.step()
    reference.step()
    assert optim.state[p]["step"] == 1
    assert torch.equal(p.detach(), reference_p.detach())


# ---------------------------------------------------------------------------------------------------------------
# OSS.clip_grad_norm with an iterator filter


def _matrices_as_list(params: List[torch.Tensor]) -> List[torch.Tensor]:
    return [p for p in params if p.dim() > 1]


def _matrices_as_filter(params: List[torch.Tensor]) -> Iterator[torch.Tensor]:
    return filter(_is_matrix, params)


def _matrices_as_generator(params: List[torch.Tensor]) -> Iterator[torch.Tensor]:
    return (p for p in params if p.dim() > 1)


def _is_matrix(p: torch.Tensor) -> bool:
    return p.dim() > 1


def _clip_filter_body(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optim = OSS(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    out: Dict[str, Any] = {}
    for name, fn in (
        ("list", _matrices_as_list),
        ("filter", _matrices_as_filter),
        ("generator", _matrices_as_generator),
    ):
        # Fresh gradients for each: clip_grad_norm clips them in place.
        optim.zero_grad()
        model(x).sum().backward()
        norm = optim.clip_grad_norm(0.5, filter_params_fn=fn)
        out[name] = (norm.item(), [p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_oss_clip_grad_norm_with_an_iterator_filter(world_size: int) -> None:
    for result in run_distributed(_clip_filter_body, world_size, timeout=TIMEOUT):
        want_norm, want_grads = result["list"]
        assert want_norm > 0.5  # clipping did something
        for name in ("filter", "generator"):
            norm, grads = result[name]
            assert norm == want_norm, name
            assert all(torch.equal(g, w) for g, w in zip(grads, want_grads)), name


# ---------------------------------------------------------------------------------------------------------------
# OSS(broadcast_fp16=True) with complex parameters


def _complex_body(rank: int, world_size: int, fp16: bool) -> List[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, dtype=torch.cfloat)) for _ in range(2)]
    optim = OSS(params, lr=0.1, broadcast_fp16=fp16)
    for p in params:
        p.grad = torch.full_like(p, 1 + 1j)
    optim.step()
    return [p.detach().clone() for p in params]


def test_oss_broadcast_fp16_keeps_complex_parameters() -> None:
    reference = run_distributed(_complex_body, 2, False, timeout=TIMEOUT)
    result = run_distributed(_complex_body, 2, True, timeout=TIMEOUT)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(result[rank], reference[rank])), rank
        assert all(bool(p.imag.abs().max() > 0) for p in result[rank])


# ---------------------------------------------------------------------------------------------------------------
# A dropped AdaScale


def test_dropped_adascale_is_freed_and_its_hooks_removed() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    ref = weakref.ref(optim)
    model(torch.randn(2, 4)).sum().backward()  # a window is open
    del optim
    gc.collect()
    assert ref() is None
    assert not model.weight._backward_hooks and not model.bias._backward_hooks
    # A new AdaScale over the same model is not disturbed by the old one's open window: same gain as a fresh model's.
    model.zero_grad()
    new = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    gain, reference_gain = _gains_beside_a_fresh_copy(model, new)
    assert gain == reference_gain


def _dropped_adascale_body(rank: int, world_size: int) -> List[List[str]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ddp = DDP(model)
    kinds = []
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
    with count_collectives() as counted:
        ddp(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    kinds.append([r.kind for r in counted.records])
    ref = weakref.ref(optim)
    del optim
    gc.collect()
    kinds.append(["alive"] if ref() is not None else [])
    with count_collectives() as counted:
        ddp(torch.randn(2, 4)).sum().backward()
    kinds.append([r.kind for r in counted.records])
    return kinds


def test_dropped_adascale_does_no_more_collectives() -> None:
    for kinds in run_distributed(_dropped_adascale_body, 2, timeout=TIMEOUT):
        # With it: the statistics' all-reduce; dropped: freed, and a backward runs no AdaScale collective.
        assert kinds == [["all_reduce"], [], []]
