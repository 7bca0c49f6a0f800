# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DynamicLossScaler: cases that used to give silently wrong gradients, skip every step, or fail with an aten error.

* An overflow lowers ``loss_scale`` inside ``step()`` (upstream's timing, kept); a second optimizer's gradients were
  then unscaled by the lowered scale and came out ``scale_factor`` times too large, and two overflowing optimizers
  lowered the scale twice. Now every optimizer's gradients are divided by the scale the loss was multiplied with,
  and the scale is lowered once per iteration, as ``torch.amp.GradScaler`` does (the reference here).
* After a skipped step, ``step()`` ran again, lowering the scale once more per call, and ``unscale_()`` was taken.
* ``scale_factor <= 1``, ``tolerance`` above 0.5 (an overflowing iteration counts twice) or NaN, and
  ``threshold=inf`` left the scale too high for good.
* Sparse gradients failed in the norm with an aten dispatcher error.
"""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use

from fairscale.experimental.optim import DynamicLossScaler

# The reference, torch's scaler on the CPU, exists from torch 2.3 on.
needs_torch_cpu_scaler = pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"), reason="the reference, torch.amp.GradScaler on the CPU, needs torch >= 2.3"
)


def _scale_of(scaler: Any) -> float:
    return float(scaler.loss_scale) if isinstance(scaler, DynamicLossScaler) else float(scaler.get_scale())


def _two_optimizers(make: Callable[[], Any], overflow: Tuple[bool, bool]) -> Tuple[List[List[float]], float]:
    """One loss over two parameters, one optimizer each; ``overflow`` puts an inf into a parameter's gradient."""
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    optims = [torch.optim.SGD([p], lr=1.0) for p in params]
    scaler = make()
    scaler.scale((params[0] * 3).sum() + (params[1] * 3).sum()).backward()
    for p, inf in zip(params, overflow):
        if inf:
            with torch.no_grad():
                p.grad[0] = math.inf  # type: ignore[index]
    for optim in optims:
        scaler.step(optim)
    scaler.update()
    return [p.detach().tolist() for p in params], _scale_of(scaler)


@needs_torch_cpu_scaler
def test_each_optimizer_is_unscaled_by_the_scale_of_its_loss() -> None:
    for overflow in ((True, False), (False, True), (True, True), (False, False)):
        got = _two_optimizers(lambda: DynamicLossScaler(init_scale=2.0**10), overflow)
        want = _two_optimizers(lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10), overflow)
        # Before, (True, False): the second parameter stepped to -5 (gradient 6, not 3); (True, True): scale 256.
        assert got == want, overflow


def test_a_skipped_step_counts_as_the_step_of_the_iteration() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale(p.sum()).backward()
    with torch.no_grad():
        p.grad[0] = math.inf  # type: ignore[index]
    assert scaler.step(optim) is None
    assert scaler.loss_scale == 512.0  # lowered at once, in step(), as upstream
    # Before: each further step() lowered the scale again (256, 128) and unscale_() divided by the lowered scale.
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called on this optimizer"):
        scaler.step(optim)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(optim)
    assert scaler.loss_scale == 512.0 and p.detach().tolist() == [1.0, 1.0]
    # The losses of this iteration are still multiplied by the scale it started with; the next one uses the new.
    assert scaler.scale(torch.ones(1)).item() == 1024.0
    scaler.update()
    optim.zero_grad()
    scaler.scale(p.sum()).backward()
    assert p.grad.tolist() == [512.0, 512.0]  # type: ignore[union-attr]
    scaler.step(optim)
    assert p.grad.tolist() == [1.0, 1.0]  # type: ignore[union-attr]
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.9))


@needs_torch_cpu_scaler
def test_unscale_then_clip_then_step_with_two_optimizers_matches_torch() -> None:
    # The first optimizer overflows; the second is unscaled by hand and clipped before its step (before: by the
    # lowered scale, so its gradients came out twice too large and were clipped).
    results = []
    for make in (lambda: DynamicLossScaler(init_scale=64.0), lambda: torch.amp.GradScaler("cpu", init_scale=64.0)):
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.arange(3.0))]
        optims = [torch.optim.SGD([p], lr=0.5) for p in params]
        scaler = make()
        scaler.scale((params[0] ** 2).sum() + (params[1] ** 2).sum()).backward()
        with torch.no_grad():
            params[0].grad[1] = math.nan  # type: ignore[index]
        scaler.step(optims[0])
        scaler.unscale_(optims[1])
        torch.nn.utils.clip_grad_norm_([params[1]], max_norm=5.0)  # true norm 4.47: not clipped
        scaler.step(optims[1])
        scaler.update()
        results.append(([p.detach().clone() for p in params], _scale_of(scaler)))
    (got, got_scale), (want, want_scale) = results
    assert got_scale == want_scale == 32.0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"scale_factor": 0.5}, "scale_factor must be a finite number > 1"),
        ({"scale_factor": 1}, "scale_factor must be a finite number > 1"),
        ({"scale_factor": True}, "scale_factor must be a finite number > 1"),
        ({"tolerance": 2.0}, "tolerance must be a number in \\[0, 0.5\\]"),
        ({"tolerance": 0.6}, "tolerance must be a number in \\[0, 0.5\\]"),
        ({"tolerance": -0.1}, "tolerance must be a number in \\[0, 0.5\\]"),
        ({"tolerance": math.nan}, "tolerance must be a number in \\[0, 0.5\\]"),
        ({"tolerance": "0"}, "tolerance must be a number in \\[0, 0.5\\]"),
        ({"threshold": math.inf}, "threshold must be None or a finite number > 0"),
        ({"threshold": 0.0}, "threshold must be None or a finite number > 0"),
        ({"threshold": 1e6}, "threshold \\(1000000.0\\) must not exceed init_scale"),
        ({"min_loss_scale": math.nan}, "min_loss_scale must be a finite number >= 0"),
        ({"init_scale": True}, "init_scale must be a finite number > 0"),
    ],
)
def test_settings_that_keep_the_scale_too_high_are_refused(kwargs: Dict[str, Any], message: str) -> None:
    # Before: accepted; with fp16 gradients every step was then skipped, silently (no FloatingPointError either).
    with pytest.raises(ValueError, match=f"DynamicLossScaler: {message}"):
        DynamicLossScaler(**kwargs)


def _fp16_steps_taken(**kwargs: Any) -> Tuple[int, float]:
    """40 iterations on an fp16 parameter whose gradients overflow above a scale of about 65."""
    scaler = DynamicLossScaler(scale_window=3, **kwargs)
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    optim = torch.optim.SGD([p], lr=1e-6)
    taken = 0
    for _ in range(40):
        optim.zero_grad()
        scaler.scale((p * 1000).sum()).backward()
        before = p.detach().clone()
        scaler.step(optim)
        taken += not torch.equal(before, p.detach())
        scaler.update()
    return taken, float(scaler.loss_scale)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{}, {"scale_factor": 1.5}, {"tolerance": 0.5}, {"threshold": 2.0**15}, {"min_loss_scale": 0}]
)
def test_boundary_settings_still_train(kwargs: Dict[str, Any]) -> None:
    taken, _ = _fp16_steps_taken(**kwargs)
    if "threshold" in kwargs:  # a floor at the initial scale: every step overflows, as the user asked
        assert taken == 0
    else:
        assert taken >= 15
    # The refused neighbours (before: 0 steps taken, or a scale of inf).
    bad: Dict[str, Any] = {"scale_factor": 1.0, "tolerance": 0.6, "threshold": math.inf, "min_loss_scale": math.nan}
    name = next(iter(kwargs), "scale_factor")
    with pytest.raises(ValueError):
        DynamicLossScaler(**{name: bad[name]})


def _train_embedding(make: Callable[[], Any], inf_step: Optional[int]) -> Tuple[torch.Tensor, List[float]]:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    optim = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = make()
    scales = []
    for step in range(4):
        optim.zero_grad()
        # Index 1 appears twice: the sparse gradient holds duplicate entries (uncoalesced).
        scaler.scale(emb(torch.tensor([1, 2, 1, 3 + step])).pow(2).sum()).backward()
        if step == inf_step:
            with torch.no_grad():
                emb.weight.grad._values()[0, 0] = math.inf  # type: ignore[union-attr]
        scaler.step(optim)
        scaler.update()
        scales.append(_scale_of(scaler))
    return emb.weight.detach().clone(), scales


@needs_torch_cpu_scaler
@pytest.mark.parametrize("inf_step", [None, 1])
def test_sparse_gradients_are_checked_and_unscaled_as_torch_does(inf_step: Optional[int]) -> None:
    # Before: NotImplementedError "Could not run 'aten::linalg_vector_norm' with arguments from the 'SparseCPU'".
    got, got_scales = _train_embedding(lambda: DynamicLossScaler(init_scale=16.0), inf_step)
    want, want_scales = _train_embedding(lambda: torch.amp.GradScaler("cpu", init_scale=16.0), inf_step)
    torch.testing.assert_close(got, want)
    assert got_scales == want_scales == ([16.0] * 4 if inf_step is None else [16.0, 8.0, 8.0, 8.0])
