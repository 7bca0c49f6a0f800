# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale with an AMP grad scaler's overflow steps and with frozen parameters (deliberate differences from 0.4.13).

* A window with an inf/NaN gradient (the step a grad scaler skips) was folded into the smoothed statistics:
  ``gain()`` was NaN from then on and every later step wrote NaN into the weights. Now such a window leaves the
  statistics as they were, on every rank alike; the tests compare with a run in which that window never happened.
* A frozen parameter (``requires_grad=False``) in the param groups made the constructor raise torch's "cannot
  register a hook on a tensor that doesn't require gradient", and ``add_param_group`` raise it after the wrapped
  optimizer had taken the group. Now frozen parameters are accepted and left out of the statistics (the tests compare
  with an optimizer that does not hold them); one unfrozen later is hooked when AdaScale first sees its gradient, and
  that window is left out of the statistics, with a warning.
"""

import copy
import functools
import io
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.device import device_generic_amp_scaler
from fairscale.optim import OSS, AdaScale
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler

TIMEOUT = 90.0
# torch < 2.3 has no device-generic torch.amp.GradScaler: its scalers, and fairscale's, are CUDA-only and disabled
# on the CPU there (scale 1.0, no step skipped), so the scaler cases cannot run on a CPU there.
CPU_SCALERS = device_generic_amp_scaler()
NO_CPU_SCALERS = f"torch {torch.__version__} has no CPU grad scaler (device-generic torch.amp.GradScaler: torch >= 2.3)"


def _torch_scaler() -> Any:
    return torch.amp.GradScaler("cpu", init_scale=16.0)


def _fairscale_scaler() -> Any:
    return GradScaler(init_scale=16.0, device="cpu")


def _micro_batch(window: int, micro: int, rank: int = 0) -> Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * window + 10 * rank + micro))


def _statistics(optim: AdaScale) -> Dict[str, List[float]]:
    return {key: np.asarray(value).tolist() for key, value in sorted(optim.state["adascale"].items())}


def _assert_same_weights(model: nn.Module, reference: nn.Module) -> None:
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name


# ------------------------------------------------------------------------------------------------------------------
# Windows with non-finite gradients


def _amp_run(
    make_scaler: Callable[[], Any], windows: Sequence[int], bad: Optional[Tuple[int, float]], scales: Sequence[float]
) -> Tuple[nn.Linear, AdaScale, List[float], List[float]]:
    """Train ``Linear(3, 2)`` through a grad scaler, two micro-batches a window, one window per entry of ``windows``.

    ``bad`` multiplies the first micro-batch loss of that window by inf or NaN. ``scales`` (one per window), if any,
    set the loss scale for each window, so that a reference without the bad window uses the scales of the run with it.
    Returns the model, the optimizer, the gain after each window and the loss scale each window used.
    """
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    scaler = make_scaler()
    gains, used = [], []
    for i, window in enumerate(windows):
        optim.zero_grad()
        for micro in range(2):
            loss = model(_micro_batch(window, micro)).pow(2).mean() / 2
            if bad is not None and (window, micro) == (bad[0], 0):
                loss = loss * bad[1]
            scaler.scale(loss).backward()
        used.append(scaler.get_scale())
        scaler.step(optim)
        scaler.update(scales[i + 1] if i + 1 < len(scales) else None)
        gains.append(optim.gain())
    return model, optim, gains, used


@pytest.mark.skipif(not CPU_SCALERS, reason=NO_CPU_SCALERS)
@pytest.mark.parametrize("poison", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize(
    "make_scaler", [_torch_scaler, _fairscale_scaler], ids=["torch.amp.GradScaler", "fairscale.GradScaler"]
)
def test_overflow_window_is_left_out_of_the_statistics(make_scaler: Callable[[], Any], poison: float) -> None:
    model, optim, gains, used = _amp_run(make_scaler, [0, 1, 2, 3], (1, poison), [])
    assert used == [16.0, 16.0, 8.0, 8.0], "the scaler skipped window 1 and backed off"
    # The reference never had window 1, with the loss scales that windows 0, 2 and 3 used above.
    ref_model, ref_optim, ref_gains, _ = _amp_run(make_scaler, [0, 2, 3], None, [used[0], used[2], used[3]])
    assert all(math.isfinite(g) for g in gains), gains
    assert gains[1] == gains[0], "the skipped window changed the statistics"
    assert [gains[0], gains[2], gains[3]] == ref_gains
    assert _statistics(optim) == _statistics(ref_optim)
    _assert_same_weights(model, ref_model)


def _fp16_run(windows: Sequence[int], overflow: Sequence[int] = ()) -> Tuple[AdaScale, List[float], Tensor]:
    """An fp16 parameter whose gradient is the micro-batch's coefficients, two micro-batches a window; the windows in
    ``overflow`` have 40000 in both micro-batches: the squared norms of the micro-batches are finite, the
    accumulated fp16 gradient (80000) is inf. A window with a non-finite gradient is not stepped, as a scaler would."""
    param = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    optim = AdaScale(SGD([param], lr=0.01), world_size=1, num_gradients_to_accumulate=2)
    gains = []
    for window in windows:
        optim.zero_grad()
        for micro in range(2):
            coefficients = torch.randn(3, generator=torch.Generator().manual_seed(10 * window + micro))
            if window in overflow:
                coefficients[0] = 40000.0
            (param * coefficients.half()).sum().backward()
        assert param.grad is not None
        if bool(torch.isfinite(param.grad).all()):
            optim.step()
        gains.append(optim.gain())
    return optim, gains, param.detach().clone()


def test_window_whose_accumulated_gradient_overflows_is_left_out() -> None:
    optim, gains, weight = _fp16_run([0, 1, 2], overflow=[1])
    ref_optim, ref_gains, ref_weight = _fp16_run([0, 2])
    assert gains[1] == gains[0] and [gains[0], gains[2]] == ref_gains, (gains, ref_gains)
    assert _statistics(optim) == _statistics(ref_optim)
    assert torch.equal(weight, ref_weight)


# ------------------------------------------------------------------------------------------------------------------
# Frozen parameters


def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _train_windows(model: nn.Module, optim: AdaScale, windows: Sequence[int], step: bool = True) -> List[float]:
    gains = []
    for window in windows:
        optim.zero_grad()
        for micro in range(2):
            (model(_micro_batch(window, micro)).pow(2).mean() / 2).backward()
        if step:
            optim.step()
        gains.append(optim.gain())
    return gains


def test_frozen_parameters_are_accepted_and_left_out_of_the_statistics() -> None:
    model = _two_layers()
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen at construction is nothing to warn about
        optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
        ref_optim = AdaScale(SGD(reference[2].parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
        assert len(optim._hook_handles) == 2, "only the parameters that require grad are hooked"
        gains = _train_windows(model, optim, range(3))
    assert gains == _train_windows(reference, ref_optim, range(3))
    assert _statistics(optim) == _statistics(ref_optim)
    _assert_same_weights(model, reference)


def test_stale_gradient_of_a_frozen_parameter_is_left_out() -> None:
    model = _two_layers()
    reference = copy.deepcopy(model)
    model[0].requires_grad_(False)
    model[0].weight.grad = torch.ones_like(model[0].weight)  # left from before it was frozen: not this window's
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    ref_optim = AdaScale(SGD(reference[2].parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    for micro in range(2):  # no zero_grad() first
        (model(_micro_batch(0, micro)).pow(2).mean() / 2).backward()
        (reference(_micro_batch(0, micro)).pow(2).mean() / 2).backward()
    assert optim.gain() == ref_optim.gain() and _statistics(optim) == _statistics(ref_optim)


def test_add_param_group_accepts_a_frozen_group() -> None:
    model = _two_layers()
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    optim = AdaScale(SGD(model[2].parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    ref_optim = AdaScale(SGD(reference[2].parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    optim.add_param_group({"params": model[0].parameters(), "lr": 0.5})  # a generator, as in the report
    assert len(optim.param_groups) == 2 and len(optim.param_groups[1]["params"]) == 2
    assert len(optim._state["grad_sqr_avg"]) == 2 and len(optim._hook_handles) == 2
    gains = []
    for window in range(3):
        _train_windows(model, optim, [window])
        _train_windows(reference, ref_optim, [window])
        gains.append((optim.gain(0), ref_optim.gain(0)))
    assert [got for got, _ in gains] == [want for _, want in gains]
    _assert_same_weights(model, reference)


def test_failed_add_param_group_changes_nothing() -> None:
    model, extra = _two_layers(), nn.Linear(2, 2)
    reference = copy.deepcopy(model)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    ref_optim = AdaScale(SGD(reference.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    handles, groups, statistics = list(optim._hook_handles), list(optim.param_groups), _statistics(optim)
    for bad, error in [
        ({"params": [extra.weight, model[0].weight]}, ValueError),  # a parameter of another group: torch refuses
        ({"params": iter([extra.weight, "not a tensor"])}, TypeError),
        ({"params": {extra.weight}}, TypeError),  # a set has no order: torch refuses
    ]:
        with pytest.raises(error):
            optim.add_param_group(bad)
        assert optim.param_groups == groups and optim._optimizer.param_groups == groups
        assert optim._hook_handles == handles and _statistics(optim) == statistics
    # No hook of the failed calls is left: each gradient is measured once, as by an AdaScale that never saw them.
    assert _train_windows(model, optim, range(2)) == _train_windows(reference, ref_optim, range(2))
    assert extra.weight.grad is None


def test_parameter_unfrozen_later_is_hooked_and_its_first_window_left_out() -> None:
    model = _two_layers()
    model[0].requires_grad_(False)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    # The reference holds the first layer trainable from the start, but gives it no gradient in window 0 (the
    # statistics then cover what the frozen run measured), and never sees window 1.
    reference = copy.deepcopy(model).requires_grad_(True)
    ref_optim = AdaScale(SGD(reference.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    first_gain = _train_windows(model, optim, [0])[0]
    ref_optim.zero_grad()
    for micro in range(2):
        hidden = reference[1](reference[0](_micro_batch(0, micro))).detach()
        (reference[2](hidden).pow(2).mean() / 2).backward()
    ref_optim.step()
    assert ref_optim.gain() == first_gain

    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match=r"group 0, param 0; group 0, param 1\).*unfrozen since.*left out"):
        # Not stepped: the run goes on with the reference's weights.
        assert _train_windows(model, optim, [1], step=False) == [first_gain], "the unmeasured window was used"
    assert len(optim._hook_handles) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        assert _train_windows(model, optim, [2, 3]) == _train_windows(reference, ref_optim, [2, 3])
    assert _statistics(optim) == _statistics(ref_optim)


def test_parameters_all_frozen_at_construction_are_hooked_at_the_first_step_after_unfreezing() -> None:
    model = _two_layers().requires_grad_(False)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    assert optim._hook_handles == []
    model.requires_grad_(True)
    with pytest.warns(UserWarning, match="unfrozen since.*this step used the last gain"):
        assert _train_windows(model, optim, [0]) == [1.0]  # no hook: nothing measured, the step used gain 1
    # From here on it measures like a new AdaScale over the same weights.
    reference = copy.deepcopy(model)
    ref_optim = AdaScale(SGD(reference.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    assert _train_windows(model, optim, [1, 2]) == _train_windows(reference, ref_optim, [1, 2])
    assert _statistics(optim) == _statistics(ref_optim)


def test_unhook_stays_unhooked_after_unfreezing() -> None:
    model = _two_layers()
    model[0].requires_grad_(False)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    optim.unhook()
    model[0].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _train_windows(model, optim, range(2)) == [1.0, 1.0]
    assert optim._hook_handles == []


# ------------------------------------------------------------------------------------------------------------------
# Two gloo ranks


def _ddp_amp_run(rank: int, windows: Sequence[int], bad: bool, scales: Sequence[float]) -> Tuple[List[float], Any]:
    """DDP, two micro-batches a window (the first under ``no_sync``), ShardedGradScaler; with ``bad``, rank 1's first
    micro-batch of window 1 overflows (only its local statistics see the inf before the all-reduce)."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    optim = AdaScale(SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    scaler = ShardedGradScaler(init_scale=16.0, device="cpu")
    gains, used = [], []
    for i, window in enumerate(windows):
        optim.zero_grad()
        with model.no_sync():
            loss = model(_micro_batch(window, 0, rank)).pow(2).mean() / 2
            scaler.scale(loss * (math.inf if bad and window == 1 and rank == 1 else 1.0)).backward()
        scaler.scale(model(_micro_batch(window, 1, rank)).pow(2).mean() / 2).backward()
        used.append(scaler.get_scale())
        scaler.step(optim)
        scaler.update(scales[i + 1] if i + 1 < len(scales) else None)
        gains.append(optim.gain())
    return gains + used, model.module.weight.detach().clone()


def _ddp_overflow_case(rank: int, out: List[Any]) -> None:
    got, weight = _ddp_amp_run(rank, [0, 1, 2, 3], True, [])
    gains, used = got[:4], got[4:]
    assert used == [16.0, 16.0, 8.0, 8.0] and gains[1] == gains[0], got
    want, ref_weight = _ddp_amp_run(rank, [0, 2, 3], False, [used[0], used[2], used[3]])
    assert [gains[0], gains[2], gains[3]] == want[:3]
    assert torch.equal(weight, ref_weight)
    out.append(gains)


def _fp16_rank_run(rank: int, windows: Sequence[int], overflow_on_rank_1: Sequence[int]) -> List[float]:
    """Without DDP, the same coefficients on both ranks (standing in for reduced gradients), except that in the
    windows of ``overflow_on_rank_1`` rank 1's accumulated fp16 gradient overflows while its micro-batches' squared
    norms stay finite: only rank 1's reduced gradient is not finite."""
    param = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    optim = AdaScale(SGD([param], lr=0.01), num_gradients_to_accumulate=2)
    gains = []
    for window in windows:
        optim.zero_grad()
        for micro in range(2):
            coefficients = torch.randn(3, generator=torch.Generator().manual_seed(10 * window + micro))
            if window in overflow_on_rank_1 and rank == 1:
                coefficients[0] = 40000.0
            (param * coefficients.half()).sum().backward()
        gains.append(optim.gain())
    return gains


def _one_rank_overflow_case(rank: int, out: List[Any]) -> None:
    gains = _fp16_rank_run(rank, [0, 1, 2], [1])
    want = _fp16_rank_run(rank, [0, 2], [])
    assert gains[1] == gains[0] and [gains[0], gains[2]] == want, (gains, want)
    out.append(gains)


def _oss_frozen_case(rank: int, out: List[Any]) -> None:
    """AdaScale(OSS) under DDP with a frozen layer, and a frozen group added later: the gains and weights of an
    AdaScale(OSS) that holds only the trainable layer."""
    runs = []
    for frozen_in_optimizer in (True, False):
        model = _two_layers()
        model[0].requires_grad_(False)
        ddp = DDP(model)
        params = model.parameters() if frozen_in_optimizer else model[2].parameters()
        optim = AdaScale(OSS(params, optim=SGD, lr=0.1, momentum=0.9))
        if frozen_in_optimizer:
            frozen = nn.Linear(2, 2).requires_grad_(False)
            optim.add_param_group({"params": frozen.parameters()})
            assert len(optim.param_groups) == 2 and len(optim._hook_handles) == 2
        gains = []
        for window in range(3):
            optim.zero_grad()
            ddp(_micro_batch(window, 0, rank)).pow(2).sum().backward()
            optim.step()
            gains.append(optim.gain(0))
        runs.append((gains, [p.detach().clone() for p in model.parameters()]))
    (gains, weights), (want_gains, want_weights) = runs
    assert gains == want_gains
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights))
    out.append(gains)


def _hardening_world_body(rank: int, world_size: int) -> Dict[str, Any]:
    results: Dict[str, List[Any]] = {"ddp": [], "fp16": [], "oss": []}
    scaler_cases = [
        ("DDP + ShardedGradScaler, overflow on one rank", functools.partial(_ddp_overflow_case, rank, results["ddp"]))
    ]
    run_cases(
        (scaler_cases if CPU_SCALERS else [])
        + [
            (
                "reduced gradient not finite on one rank",
                functools.partial(_one_rank_overflow_case, rank, results["fp16"]),
            ),
            ("AdaScale(OSS) with frozen parameters", functools.partial(_oss_frozen_case, rank, results["oss"])),
        ]
    )
    return results


def test_adascale_hardening_on_two_ranks() -> None:
    ranks = run_distributed(_hardening_world_body, 2, timeout=TIMEOUT)
    assert ranks[0] == ranks[1], "the ranks' gains differ"
    assert all(math.isfinite(g) for gains in ranks[0].values() if gains for g in gains[0])


# ------------------------------------------------------------------------------------------------------------------
# Copies (a deliberate difference from 0.4.13, whose copies lacked the wrapped optimizer and failed at first use)


def test_copies_are_refused_and_the_state_dict_carries_the_statistics() -> None:
    model = _two_layers()
    optim = AdaScale(SGD(model.parameters(), lr=0.1, momentum=0.9), world_size=1, num_gradients_to_accumulate=2)
    _train_windows(model, optim, range(2))
    for attempt in (lambda: copy.deepcopy(optim), lambda: copy.copy(optim), lambda: torch.save(optim, io.BytesIO())):
        with pytest.raises(TypeError, match=r"AdaScale cannot be copied or pickled.*load_state_dict"):
            attempt()
    # What the message says to do: a new AdaScale over the copied model, loaded from the state dict, goes on as the
    # original does (same gains and weights), statistics included. A copy of the state dict: as torch's optimizers,
    # state_dict() returns the live state and load_state_dict() takes it as given, so the two would share it.
    clone = copy.deepcopy(model)
    clone_optim = AdaScale(SGD(clone.parameters(), lr=0.1, momentum=0.9), world_size=1, num_gradients_to_accumulate=2)
    clone_optim.load_state_dict(copy.deepcopy(optim.state_dict()))
    assert _statistics(clone_optim) == _statistics(optim)
    assert _train_windows(clone, clone_optim, range(2, 5)) == _train_windows(model, optim, range(2, 5))
    _assert_same_weights(clone, model)
