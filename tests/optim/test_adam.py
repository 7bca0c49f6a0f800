# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.optim.Adam on CPU (upstream's tests needed CUDA and the optional fused extension).

Every mode is compared with a float64 reference of upstream's kernel arithmetic, the fp32 mode also with
``torch.optim.Adam`` (the same update when eps is negligible), and the fp16 state scale, state dicts and errors
behave as upstream's.
"""

import copy
import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

from fairscale.internal.device import accelerator_available, device_generic_amp_scaler
from fairscale.optim import Adam, GradScaler, Precision

SHAPES = [(3, 4), (5,)]
STEPS = 5


def _grads(step: int, dtype: torch.dtype) -> List[Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _params(dtype: torch.dtype) -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(123)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _reference(
    params: List[Tensor], grads_per_step: List[List[Tensor]], lr: float, betas: Tuple[float, float], eps: float,
    weight_decay: float, bias_correction: bool = True, eps_inside_sqrt: bool = False, round_to: torch.dtype = torch.float64
) -> List[Tensor]:  # fmt: skip
    """Upstream's kernel arithmetic in float64 (``round_to``: the dtype the parameter is stored in after a step)."""
    b1, b2 = betas
    ps = [p.detach().double().cpu().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_per_step, start=1):
        size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        for p, g, m, v in zip(ps, grads, ms, vs):
            g = g.double().cpu()
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
            p.sub_(size * (m / denom + weight_decay * p))
            p.copy_(p.to(round_to).double())
    return ps


def _run(optim: Adam, params: List[torch.nn.Parameter], dtype: torch.dtype, steps: int = STEPS) -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(step, dtype)):
            p.grad = g
        optim.step()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=1e-2, eps=1e-3, weight_decay=0.1),
        dict(lr=1e-2, eps=1e-3, weight_decay=0.1, bias_correction=False),
        dict(lr=1e-2, eps=1e-2, eps_inside_sqrt=True, weight_decay=0.05, betas=(0.8, 0.99)),
    ],
    ids=["decay", "no-bias-correction", "eps-inside-sqrt"],
)
def test_step_full_precision_matches_reference(kwargs: Dict) -> None:
    params = _params(torch.float32)
    want = _reference(params, [_grads(s, torch.float32) for s in range(STEPS)], **{"betas": (0.9, 0.999), **kwargs})
    optim = Adam(params, **kwargs)
    assert optim.precision is Precision.FULL_PRECISION and not optim.mixed_precision
    _run(optim, params, torch.float32)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.double(), w, atol=1e-6, rtol=1e-6)
    state = optim.state[params[0]]
    assert state["step"] == STEPS and isinstance(state["step"], int) and state["exp_avg"].dtype == torch.float32


def test_full_precision_matches_torch_adam() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    optim, ref_optim = Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, optim), (ref, ref_optim)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_step_mixed_precision_inferred() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
    assert optim.precision is Precision.MIXED_PRECISION and optim.mixed_precision
    masters = optim.fp32_param_groups[0]["params"]
    assert len(optim.fp32_param_groups) == 1 and all(m.dtype == torch.float32 for m in masters)
    assert all(m.grad is not None and not m.grad.any() for m in masters)
    want = _reference(params, [_grads(s, torch.float16) for s in range(STEPS)], 1e-2, (0.9, 0.999), 1e-3, 0.1)
    _run(optim, params, torch.float16)
    for p, m, w in zip(params, masters, want):
        torch.testing.assert_close(m.double(), w, atol=1e-6, rtol=1e-6)  # fp32 masters carry the precision
        assert p.dtype == torch.float16 and torch.equal(p, m.half())
    assert optim.state[params[0]]["exp_avg"].dtype == torch.float32


def test_step_memory_efficient() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-2, eps=1e-3, precision=Precision.MEMORY_EFFICIENT_MIXED_PRECISION)
    assert optim.fp32_param_groups == [] and optim.optim_type == torch.float32
    want = _reference(
        params, [_grads(s, torch.float16) for s in range(STEPS)], 1e-2, (0.9, 0.999), 1e-3, 0.0, round_to=torch.float16
    )
    _run(optim, params, torch.float16)
    for p, w in zip(params, want):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.double(), w, atol=2e-3, rtol=0)  # fp16 rounding of every step
    assert optim.state[params[0]]["exp_avg_sq"].dtype == torch.float32


def test_step_pure_fp16() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-2, precision=Precision.PURE_FP16)
    assert optim._optim_scale == 2.0**16 and optim.optim_type == torch.float16
    grads = [[g * 0.01 for g in _grads(s, torch.float32)] for s in range(STEPS)]
    want = _reference(params, grads, 1e-2, (0.9, 0.999), 1e-8, 0.0, round_to=torch.float16)
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g.half()
        optim.step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.double(), w, atol=2e-3, rtol=0)
    state = optim.state[params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float16
    # The moments are stored scaled by the optimizer-state scale.
    m = torch.zeros(SHAPES[0], dtype=torch.float64)
    for step in range(STEPS):
        m = 0.9 * m + 0.1 * grads[step][0].half().double()
    torch.testing.assert_close(state["exp_avg"].double() / 2.0**16, m, atol=1e-4, rtol=1e-2)


def test_pure_fp16_state_overflow_halves_scale_and_resets_state() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-3, precision=Precision.PURE_FP16)
    for p in params:
        p.grad = torch.full_like(p, 100.0)  # v = 0.001 * 1e4 * 2**16 overflows fp16
    optim.step()
    assert optim._optim_scale == 2.0**15 and optim._steps_since_optim_scale_change == 0
    for p in params:
        assert not optim.state[p]["exp_avg"].any() and not optim.state[p]["exp_avg_sq"].any()


def test_update_optim_scale() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-3, precision=Precision.PURE_FP16)
    optim._optim_scale_update_freq = 1
    optim._optim_scale = 2.0**15
    _run(optim, params, torch.float16, steps=1)
    assert optim._optim_scale == 2.0**16
    _run(optim, params, torch.float16, steps=1)
    assert optim._optim_scale == 2.0**16  # never above 2**16


def test_pure_fp16_resume_keeps_the_scale_schedule() -> None:
    # Only optim_scale was saved: the resumed run counted its clean updates from 0 and doubled the scale later than
    # the uninterrupted one, so their moments overflowed at different steps (0.0039 apart after a few steps).
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-3, precision=Precision.PURE_FP16)
    optim._optim_scale_update_freq = 3
    optim._optim_scale = 2.0**10
    _run(optim, params, torch.float16, steps=2)
    saved = optim.state_dict()
    assert saved["optim_scale_steps"] == 2
    resumed = Adam([p.detach().clone().requires_grad_() for p in params], lr=1e-3, precision=Precision.PURE_FP16)
    resumed._optim_scale_update_freq = 3
    resumed.load_state_dict(saved)
    assert resumed._steps_since_optim_scale_change == 2 and resumed._optim_scale == 2.0**10
    legacy = {k: v for k, v in saved.items() if k != "optim_scale_steps"}  # upstream's format: counted from 0
    resumed.load_state_dict(legacy)
    assert resumed._steps_since_optim_scale_change == 0
    with pytest.raises(ValueError, match="optim_scale_steps must be an integer >= 0"):
        resumed.load_state_dict({**saved, "optim_scale_steps": -1})


def test_exploding_optimizer_state() -> None:
    params = _params(torch.float16)
    optim = Adam(params, lr=1e-3, precision=Precision.PURE_FP16)
    optim._optim_scale = 1.0
    for p in params:
        p.grad = torch.full_like(p, 6e4)
    with pytest.raises(RuntimeError, match="Optimizer state scale < 1"):
        optim.step()


@pytest.mark.skipif(
    not device_generic_amp_scaler(),
    reason=f"torch {torch.__version__} has no CPU grad scaler (device-generic torch.amp.GradScaler: torch >= 2.3)",
)
def test_step_with_grad_scaler() -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4).half()
    optim = Adam(model.parameters(), lr=1e-2, precision=Precision.PURE_FP16)
    scaler = GradScaler(init_scale=2.0**8)
    x = torch.randn(16, 8).half()
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        loss = model(x).float().pow(2).mean()
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
    assert losses[-1] < losses[0] and scaler.get_scale() == 2.0**8


@pytest.mark.parametrize(
    "dtype,precision",
    [
        (torch.float32, None),
        (torch.float16, Precision.PURE_FP16),
        (torch.float16, Precision.MEMORY_EFFICIENT_MIXED_PRECISION),
    ],
    ids=["full", "pure_fp16", "memory_efficient"],
)
def test_state_dict(dtype: torch.dtype, precision: Precision) -> None:
    params = _params(dtype)
    optim = Adam(params, lr=1e-2, precision=precision)
    _run(optim, params, dtype)
    saved = copy.deepcopy(optim.state_dict())
    assert saved["optim_scale"] == optim._optim_scale and saved["state"][0]["step"] == STEPS

    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    clone_optim = Adam(clones, lr=0.5, precision=precision)
    clone_optim.load_state_dict(saved)
    assert clone_optim.param_groups[0]["lr"] == 1e-2 and clone_optim._optim_scale == optim._optim_scale
    for p, c in zip(params, clones):
        for key in ("exp_avg", "exp_avg_sq"):
            assert clone_optim.state[c][key].dtype == optim.optim_type
            assert torch.equal(clone_optim.state[c][key], optim.state[p][key])
    for step in range(STEPS, 2 * STEPS):
        for ps, o in ((params, optim), (clones, clone_optim)):
            for p, g in zip(ps, _grads(step, dtype)):
                p.grad = g
            o.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)
    with pytest.raises(KeyError, match="optim_scale"):
        clone_optim.load_state_dict(torch.optim.Adam(clones).state_dict())


def test_param_groups_and_signature() -> None:
    a, b = _params(torch.float32)
    optim = Adam([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    assert optim.precision is Precision.FULL_PRECISION and [g["lr"] for g in optim.param_groups] == [0.1, 0.5]
    assert optim.defaults == dict(
        lr=0.1, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0
    )
    assert optim.supports_memory_efficient_fp16 and not optim._step_supports_amp_scaling and optim.eps_mode == 1
    a.grad = torch.ones_like(a)  # b has no gradient: its group is skipped
    optim.step()
    assert b not in optim.state and optim.state[a]["step"] == 1


def test_errors() -> None:
    fp32 = _params(torch.float32)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        Adam(fp32, amsgrad=True)
    with pytest.raises(ValueError, match="beta"):
        Adam(fp32, betas=(1.0, 0.999))
    with pytest.raises(ValueError, match=r"Invalid betas: \(0.9,\); pass two decay rates"):
        Adam(fp32, betas=(0.9,))  # accepted before, then an IndexError in step()
    with pytest.raises(ValueError, match="weight_decay"):
        Adam(fp32, weight_decay=-0.1)
    with pytest.raises(ValueError, match="empty"):
        Adam([])
    for precision in (Precision.MIXED_PRECISION, Precision.MEMORY_EFFICIENT_MIXED_PRECISION, Precision.PURE_FP16):
        with pytest.raises(AssertionError, match="fp16"):
            Adam(fp32, precision=precision)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    optim = Adam(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optim.step()
    assert Precision.FULL_PRECISION.value == 1 and Precision.PURE_FP16.value == 4


def _stepped(shapes: List[Tuple[int, ...]], steps: int = 2) -> Tuple[Adam, List[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    optim = Adam(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optim.step()
    return optim, params


def _adam_snapshot(optim: Adam) -> Tuple[Any, ...]:
    state = {
        id(p): {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in s.items()} for p, s in optim.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    return state, groups, optim._optim_scale


def _same_adam_snapshot(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> bool:
    if a[1:] != b[1:] or a[0].keys() != b[0].keys():
        return False
    return all(
        (torch.equal(v, b[0][p][k]) if isinstance(v, Tensor) else v == b[0][p][k])
        for p in a[0]
        for k, v in a[0][p].items()
    )


def _with(state: Dict, idx: int, key: str, value: object) -> Dict:
    bad = copy.deepcopy(state)
    if value is _MISSING:
        del bad["state"][idx][key]
    else:
        bad["state"][idx][key] = value
    return bad


_MISSING = object()


def test_load_state_dict_of_another_model_raises_and_changes_nothing() -> None:
    """State shaped for other parameters (smaller: the fused kernel would write out of bounds; larger: the moments
    would be misaligned) and crafted states are refused with the parameter and both shapes named, before anything
    changes; the optimizer then still loads a good dict and steps."""
    target, target_params = _stepped([(3, 4), (5,)])
    good = copy.deepcopy(target.state_dict())
    smaller, _ = _stepped([(2, 4), (5,)])
    larger, _ = _stepped([(3, 4), (6,)])
    crafted = [
        ("smaller model", smaller.state_dict(), r"parameter 0 has shape \(2, 4\).*\(3, 4\)"),
        ("larger model", larger.state_dict(), r"parameter 1 has shape \(6,\).*\(5,\)"),
        ("same numel, other shape", _with(good, 0, "exp_avg", torch.zeros(12)), r"'exp_avg' of parameter 0"),
        ("factored-looking moment", _with(good, 0, "exp_avg_sq", torch.zeros(1, 4)), r"\(1, 4\).*\(3, 4\)"),
        ("integer moment", _with(good, 1, "exp_avg", torch.zeros(5, dtype=torch.long)), "floating-point"),
        ("missing moment", _with(good, 1, "exp_avg_sq", _MISSING), "exp_avg_sq"),
        ("negative step", _with(good, 1, "step", -3), "'step' of parameter 1"),
        ("state not a dict", {**copy.deepcopy(good), "state": {0: torch.zeros(3, 4)}}, "not a dict"),
        ("bad optim_scale", {**copy.deepcopy(good), "optim_scale": float("nan")}, "optim_scale"),
        (
            "group size",
            {**copy.deepcopy(good), "param_groups": [{**good["param_groups"][0], "params": [0]}]},
            "group 0",
        ),
    ]
    before = _adam_snapshot(target)
    for name, bad, match in crafted:
        with pytest.raises(ValueError, match=match) as info:
            target.load_state_dict(bad)
        assert isinstance(info.value, AssertionError), name
        assert _same_adam_snapshot(before, _adam_snapshot(target)), f"{name}: a failed load changed the optimizer"
    target.load_state_dict(good)
    assert _same_adam_snapshot(before, _adam_snapshot(target))
    for p in target_params:
        p.grad = torch.ones_like(p)
    target.step()
    assert target.state[target_params[0]]["step"] == 3


def test_loaded_moments_get_the_parameters_layout() -> None:
    """Moments of the right shape but another memory layout (transposed, stride 0) are loaded laid out like the
    parameter: the kernels walk parameter and state memory in step."""
    optim, params = _stepped([(3, 4), (5,)])
    state = copy.deepcopy(optim.state_dict())
    transposed = torch.arange(12.0).reshape(4, 3).t()
    expanded = torch.full((1,), 0.5).expand(5)
    state["state"][0]["exp_avg"] = transposed
    state["state"][1]["exp_avg_sq"] = expanded
    optim.load_state_dict(state)
    for p, key, want in ((params[0], "exp_avg", transposed), (params[1], "exp_avg_sq", expanded)):
        assert optim.state[p][key].stride() == p.stride() and torch.equal(optim.state[p][key], want)


@pytest.mark.skipif(not accelerator_available(), reason="needs CUDA")  # FAIRSCALE_CPU_ONLY keeps the suite off it
@pytest.mark.parametrize(
    "dtype,precision,atol",
    [
        (torch.float32, Precision.FULL_PRECISION, 1e-6),
        (torch.float16, Precision.MIXED_PRECISION, 2e-3),
        (torch.float16, Precision.MEMORY_EFFICIENT_MIXED_PRECISION, 2e-3),
    ],
    ids=["full", "mixed", "memory_efficient"],
)
def test_modes_on_cuda(dtype: torch.dtype, precision: Precision, atol: float) -> None:
    """The same arithmetic on CUDA, where the full-precision path runs torch's fused kernel."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(dtype)]
    optim = Adam(params, lr=1e-2, eps=1e-3, weight_decay=0.1, precision=precision)
    round_to = torch.float16 if precision is Precision.MEMORY_EFFICIENT_MIXED_PRECISION else torch.float64
    grads = [_grads(s, dtype) for s in range(STEPS)]
    want = _reference(params, grads, 1e-2, (0.9, 0.999), 1e-3, 0.1, round_to=round_to)
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g.cuda()
        optim.step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.double().cpu(), w.cpu(), atol=atol, rtol=0)
