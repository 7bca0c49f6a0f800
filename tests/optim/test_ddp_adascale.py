# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale with DistributedDataParallel over real gloo worlds (upstream ran these on >= 2 GPUs only).

Expected gains and weights were produced by running upstream fairscale 0.4.13 on the same problems; the
two-worker gains equal the single-process gains with two accumulated micro-batches.
"""

import functools
import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch.nn import Linear
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.optim import AdaScale

# The expected gains and weights were recorded on another machine. AdaScale's statistics are float32 (squared
# gradient norms over at most 6 elements, reduced over 2 ranks, smoothed over at most 4 steps); another CPU's
# kernels sum them in another order and move them by a few float32 ulps (measured between two x86-64 machines:
# 4e-8 relative on a gain). FP32_REL allows about 8 ulps (float32 eps 1.19e-7); a wrong formula (scale, smoothing,
# unbiasing, the world size) moves a gain by 1e-3 or more.
FP32_REL = 1e-6

# Per case: one input per rank and step, the gains after each step, the averaged weight gradient of the last step.
BASIC_CASES = [
    ([[1.0, 0.0], [0.0, 1.0]], [4 / 3], [[0.5, 0.5], [0.5, 0.5]]),
    ([[1.0, 1.0], [1.0, 1.0]], [1.0000000833333265], [[1.0, 1.0], [1.0, 1.0]]),
    ([[-1.0, 1.0], [1.0, -1.0]], [2.0], [[0.0, 0.0], [0.0, 0.0]]),
    ([[1.0, 4.0], [5.0, 0.5]], [1.4688796680497926], [[3.0, 2.25], [3.0, 2.25]]),
    ([[-0.2, 3.0], [5.0, 0.5]], [1.8472893901708], [[2.4000000953674316, 1.75], [2.4000000953674316, 1.75]]),
    (
        [[-0.2, 3.3], [5.2, 0.7], [1.0, 4.0], [3.1, 0.1]],
        [1.7982220119900174, 1.6720968158031417],
        [[2.049999952316284] * 2] * 2,
    ),
]
MOMENTUM_GAINS = [2.0, 1.4585498880250212, 1.6300445819765195, 1.5945266664277278]
MOMENTUM_WEIGHT = [
    [-0.7043057680130005, -0.29621586203575134, -0.567938506603241],
    [0.8287379741668701, -0.08174531161785126, 0.21224091947078705],
]
# Linear(3, 1, bias=False) and loss = output: each rank's gradient is its input.
CORR_INPUTS = [
    ([1.0, 0.0, 2.0], [2.0, 0.0, 1.0]),
    ([0.0, 2.0, 1.0], [2.0, 0.0, 1.0]),
    ([3.0, 1.0, 0.0], [2.0, 1.0, 1.0]),
]


def _basic_case(rank: int, case: int) -> None:
    inputs, want_gains, want_grad = BASIC_CASES[case]
    torch.manual_seed(0)
    model = DDP(Linear(2, 2))
    optim = AdaScale(SGD(model.parameters(), lr=0.1))
    assert optim.scale == 2 and optim._world_size == 2
    gains = []
    for it in range(len(inputs) // 2):
        model(torch.tensor([inputs[2 * it + rank]])).sum().backward()
        gains.append(optim.gain())
        if it < len(inputs) // 2 - 1:
            optim.step()
            optim.zero_grad()
    assert gains == pytest.approx(want_gains, rel=FP32_REL, abs=0)
    assert model.module.weight.grad is not None and model.module.weight.grad.tolist() == want_grad


def _grad_accum_case(rank: int) -> None:
    """Two workers x two micro-batches (DDP no_sync), orthogonal inputs: the gain is the full scale, 4."""
    torch.manual_seed(0)
    model = DDP(Linear(4, 2, bias=False))
    optim = AdaScale(SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    eye = torch.eye(4)
    with count_collectives() as counter:
        with model.no_sync():
            model(eye[rank : rank + 1]).sum().backward()
        assert counter.count() == 0  # no statistics are reduced before the window is complete
        model(eye[2 + rank : 3 + rank]).sum().backward()
    assert counter.count("all_reduce") == 1, counter.summary()  # AdaScale's local squared norms
    assert optim.gain() == 4.0
    optim.step()


def _momentum_case(rank: int, use_oss: bool) -> None:
    """Momentum SGD, four steps: upstream's gains and weights, also with ``AdaScale(OSS(...))`` (the sharded
    optimizer steps only the owned parameters; the statistics and the gain are those of the plain optimizer)."""
    from fairscale.optim import OSS

    torch.manual_seed(0)
    model = DDP(Linear(3, 2))
    if use_oss:
        base: torch.optim.Optimizer = OSS(model.parameters(), optim=SGD, lr=0.1, momentum=0.9)
    else:
        base = SGD(model.parameters(), lr=0.1, momentum=0.9)
    optim = AdaScale(base, smoothing=0.9)
    gains = []
    for it in range(4):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * it + rank))
        model(x).pow(2).sum().backward()
        gains.append(optim.gain())
        optim.step()
        optim.zero_grad()
    assert gains == pytest.approx(MOMENTUM_GAINS, rel=FP32_REL, abs=0)
    for got, want in zip(model.module.weight.tolist(), MOMENTUM_WEIGHT):
        assert got == pytest.approx(want, rel=FP32_REL, abs=FP32_REL)
    if use_oss:  # the AdaScale statistics travel in the consolidated checkpoint
        base.consolidate_state_dict(recipient_rank=0)  # type: ignore[attr-defined]
        if rank == 0:
            state = optim.state_dict()["state"]["adascale"]
            assert state["grad_sqr_avg"].tolist() == optim.state["adascale"]["grad_sqr_avg"].tolist()


def _corr_mean_case(rank: int) -> None:
    model = DDP(Linear(3, 1, bias=False))
    optim = AdaScale(SGD(model.parameters(), lr=0.1))
    for pair in CORR_INPUTS:
        optim.zero_grad()
        with model.no_sync():  # keep each rank's own gradient
            model(torch.tensor([pair[rank]])).sum().backward()
        want = float(np.corrcoef(np.array(pair))[0, 1])
        got = optim._compute_intra_grad_corr_mean()
        assert got.item() == pytest.approx(want, rel=1e-5), (pair, got)
    assert [float(np.corrcoef(np.array(p))[0, 1]) for p in CORR_INPUTS[:2]] == pytest.approx([0.5, -1.0])
    # A subclass's _gather_flat_grad (upstream's method name) is what gets correlated.
    flipping = _SignFlippingAdaScale(SGD(model.parameters(), lr=0.1))
    flipping.sign = -1.0 if rank == 1 else 1.0
    pair = CORR_INPUTS[0]
    flipping.zero_grad()
    with model.no_sync():
        model(torch.tensor([pair[rank]])).sum().backward()
    got = flipping._compute_intra_grad_corr_mean()
    assert got.item() == pytest.approx(-float(np.corrcoef(np.array(pair))[0, 1]), rel=1e-5)


class _SignFlippingAdaScale(AdaScale):
    sign = 1.0

    def _gather_flat_grad(self) -> torch.Tensor:
        return super()._gather_flat_grad() * self.sign


def _disagree_case(rank: int) -> None:
    """Other param groups or accumulation windows on one rank: the same RanksDisagreeError on every rank at
    construction (before, the window's all-reduce of one value per group waited for gloo's timeout)."""
    model = Linear(2, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias]}] if rank == 1 else [{"params": model.parameters()}]
    with pytest.raises(RanksDisagreeError, match="entry 0: 1 vs 2"):
        AdaScale(SGD(groups, lr=0.1))
    with pytest.raises(RanksDisagreeError, match="entry 1: 1 vs 2"):
        AdaScale(SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=1 + rank)
    optim = AdaScale(SGD([model.weight], lr=0.1))
    optim.add_param_group({"params": [model.bias]})  # every rank adds one: they agree
    assert len(optim.param_groups) == 2 and len(optim._state["grad_sqr_avg"]) == 2


def _adascale_world_body(rank: int, world_size: int) -> None:
    cases = [(f"basic {i}", functools.partial(_basic_case, rank, i)) for i in range(len(BASIC_CASES))]
    cases += [
        ("grad accum no_sync", functools.partial(_grad_accum_case, rank)),
        ("momentum + smoothing", functools.partial(_momentum_case, rank, False)),
        ("AdaScale(OSS)", functools.partial(_momentum_case, rank, True)),
        ("intra-gradient correlation", functools.partial(_corr_mean_case, rank)),
        ("ranks disagree", functools.partial(_disagree_case, rank)),
    ]
    run_cases(cases)


def test_ddp_adascale() -> None:
    run_distributed(_adascale_world_body, 2)
