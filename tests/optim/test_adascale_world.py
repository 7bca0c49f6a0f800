# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale's world: the group its statistics are all-reduced over, the settings its ranks must share, and its
gains' roundings.

* ``world_size=N > 1`` where the default group has another size (or without ``torch.distributed``, where the
  all-reduce does nothing) computed the statistics for workers that did not exist: the gain stayed 1 for good,
  silently (upstream: the same in a group of another size; without ``torch.distributed`` it failed at the first
  backward). The first window's end raises now, on every rank alike.
* Ranks with another ``scale`` or smoothing trained with other learning rates, silently: the construction's
  agreement check covers them, and the scale rides in every window's all-reduce (``set_scale()`` on one rank).
* The gains are upstream's to the last bit also where ``scale / (c * N)`` and ``c * N - 1`` are not exact in binary.
"""

import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn
from torch.optim import SGD

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.errors import FairscaleValueError
from fairscale.optim import AdaScale

TIMEOUT = 90.0


def test_world_size_without_torch_distributed_is_refused_at_the_first_window_end() -> None:
    model = nn.Linear(2, 1)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=2)  # building it alone still works, as upstream
    assert optim.scale == 2
    with pytest.raises(FairscaleValueError, match="world_size is 2 but the default process group has 1 rank"):
        model(torch.ones(1, 2)).sum().backward()


def _world_body(rank: int, world_size: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    model = nn.Linear(2, 1)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=4)
    try:
        model(torch.ones(1, 2)).sum().backward()
    except FairscaleValueError as e:
        seen["world_size"] = str(e)
    cases = [
        ("scale", {"scale": 2.0 + rank}),
        ("smoothing", {"smoothing": 0.5 + rank / 4}),
        # Other statistics rules give other gains, so other learning rates (they were not compared).
        ("debias_ewma", {"debias_ewma": rank == 0}),
        ("is_scaled_loss", {"is_scaled_loss": rank == 0}),
    ]
    for name, kwargs in cases:
        try:
            AdaScale(SGD(nn.Linear(2, 1).parameters(), lr=0.1), **kwargs)
        except RanksDisagreeError as e:
            seen[name] = str(e)
    # The same scale written as an int on one rank and a float on the other agrees.
    model = nn.Linear(2, 1)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), scale=4 if rank else 4.0)
    # set_scale() on one rank only, later: the scale rides in the window's all-reduce.
    if rank == 1:
        optim.set_scale(5.0)
    try:
        model(torch.ones(1, 2)).sum().backward()
    except RanksDisagreeError as e:
        seen["set_scale"] = str(e).replace("this rank has 5, ", "this rank has 4, ")
    optim.zero_grad()
    optim.set_scale(4.0)
    model(torch.ones(1, 2)).sum().backward()  # agreeing again: the next window works
    optim.step()
    return seen


def test_ranks_raise_alike_for_another_world_size_scale_or_smoothing() -> None:
    first, second = run_distributed(_world_body, 2, timeout=TIMEOUT)
    assert first == second
    assert "world_size is 4 but the default process group has 2 rank(s)" in first["world_size"]
    assert "scale, smoothing" in first["scale"] and "entry 3: '2.0' vs '3.0'" in first["scale"]
    assert "entry 4: '0.5' vs '0.75'" in first["smoothing"]
    assert "debias_ewma, is_scaled_loss" in first["debias_ewma"] and "entry 5: True vs False" in first["debias_ewma"]
    assert "entry 6: True vs False" in first["is_scaled_loss"]
    assert "the scale differs between ranks: this rank has 4, the mean over the 2 ranks is 4.5" in first["set_scale"]


def _gains(accum: int, scale: Any) -> List[str]:
    """Two steps on gradients that are exact small integers (a bias-free layer at zero): every rounding is then one
    of the statistics' elementwise operations, the same on any CPU."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=accum, scale=scale)
    inputs = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [1.0, 3.0], [0.0, 2.0]]
    gains = []
    for step in range(2):
        for i in range(accum):
            model(torch.tensor([inputs[(i + step) % len(inputs)]])).sum().backward()
        optim.step()
        optim.zero_grad()
        gains.append(float(optim.gain()).hex())
    return gains


@pytest.mark.parametrize(
    "accum, scale, want",
    [  # produced by upstream fairscale 0.4.13 on the same inputs
        (3, None, ["0x1.8000000000000p+0", "0x1.626f2acfab7b4p+0"]),
        (3, 5.0, ["0x1.0000000000000p+1", "0x1.c4de559f56f66p+0"]),
        (6, None, ["0x1.8cf19f293a7cbp+0", "0x1.8cf19f293a7cap+0"]),
        (5, 7.0, ["0x1.d60864b8a7de7p+0", "0x1.ae36343d2c42ap+0"]),
    ],
)
def test_gains_are_upstreams_to_the_last_bit(accum: int, scale: Any, want: List[str]) -> None:
    assert _gains(accum, scale) == want


def _loads_body(rank: int, world_size: int) -> Dict[str, Any]:
    # Under DDP (the same reduced gradients on every rank), one rank loading another checkpoint's statistics (a stale
    # file on one node) computed another gain, so another learning rate: the replicas drifted apart, silently (found
    # by a rank-disagreement fuzz, session 40). The next window's end compares the statistics after any load.
    seen: Dict[str, Any] = {}
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optim = AdaScale(SGD(model.parameters(), lr=0.1))

    def step(i: int) -> None:
        optim.zero_grad()
        ddp(torch.tensor([[float(i + rank), 1.0 + rank]])).pow(2).sum().backward()
        optim.step()

    step(0)
    old = optim.state_dict()
    old = {"state": {k: dict(v) for k, v in old["state"].items()}, "param_groups": old["param_groups"]}
    step(1)
    current = optim.state_dict()
    # Every rank loads the same dict: fine. Only rank 0 loads (its own state, the same as the others'): fine.
    optim.load_state_dict(current)
    step(2)
    if rank == 0:
        optim.load_state_dict(optim.state_dict())
    step(3)
    gain = optim.gain()
    # Rank 1 loads the older checkpoint: every rank raises at the backward that ends the window, before any step.
    if rank == 1:
        optim.load_state_dict(old)
    before = [p.detach().clone() for p in model.parameters()]
    optim.zero_grad()
    try:
        ddp(torch.ones(1, 2)).sum().backward()
    except RanksDisagreeError as e:
        seen["stale"] = str(e)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    seen["gain"] = float(gain)
    return seen


def test_ranks_that_loaded_different_statistics_raise_alike() -> None:
    first, second = run_distributed(_loads_body, 2, timeout=TIMEOUT)
    assert first == second
    assert "after load_state_dict() on rank(s) [1], the ranks' AdaScale statistics differ" in first["stale"]


def _sharded_loads_body(rank: int, world_size: int, how: str) -> str:
    # Ranks that measure different gradients (here no gradient sync at all, as with sharded gradients) resume from
    # their own checkpoints: legitimately different statistics. The first window after the load may not tell sharding
    # apart (an AMP overflow, all-zero gradients): the comparison waits for one that does (found by the session's
    # review: every rank raised there).
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
    optim = AdaScale(SGD(model.parameters(), lr=0.1), world_size=world_size)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
        optim.step()
    optim.load_state_dict(optim.state_dict())  # each rank its own
    warnings.simplefilter("ignore")  # AdaScale warns that the ranks measured different gradients
    for factor in ((float("inf"),) if how == "overflow" else (0.0,) if how == "zero" else ()) + (1.0,):
        optim.zero_grad()
        (model(torch.randn(4, 3, generator=g)).pow(2).sum() * factor).backward()
    return "ok"


@pytest.mark.parametrize("how", ["normal", "overflow", "zero"])
def test_per_rank_checkpoints_of_sharded_gradients_load(how: str) -> None:
    assert run_distributed(_sharded_loads_body, 2, how, timeout=TIMEOUT) == ["ok", "ok"]
