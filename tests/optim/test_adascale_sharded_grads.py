# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale where the ranks do not hold the same, averaged gradient, and AdaScale(OSS)'s consolidated state dict.

* Under FullyShardedDataParallel or ShardedDataParallel, and inside ``OSS(params, optim=AdaScaleWrapper)``, each rank
  measured a different gradient, computed its own gain and stepped its shard with its own learning rate, silently.
  The squared norms the ranks measured ride in the window's all-reduce: the first window's end warns, once, on every
  rank alike. Under DDP (the gains of a plain-torch reference) nothing is warned.
* ``OSS(params, optim=AdaScaleWrapper)`` with a rank that owns no parameter hung at the first window's end: it is
  refused at construction, on every rank.
* ``AdaScale(OSS)``: the consolidated state dict held the live AdaScale statistics (and tensor hyper-parameters), so
  later steps and ``set_scale()`` rewrote a checkpoint documented as a snapshot.
"""

import copy
import math
import warnings
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.optim import OSS, AdaScale, AdaScaleWrapper
from fairscale.optim._adascale import measured_grads

TIMEOUT = 60.0
WARNING_START = "AdaScale: the ranks measured different gradients"


def _inputs(step: int, rank: int) -> Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _reference_first_gain(world_size: int) -> float:
    """The first step's gain from the paper's formulas, with plain torch: each rank's gradient, DDP's average."""
    model = _two_layers()
    grads = []
    for rank in range(world_size):
        model.zero_grad()
        model(_inputs(0, rank)).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.detach().double().flatten() for p in model.parameters()]))
    n, scale = world_size, float(world_size)
    local = float(sum(g.pow(2).sum() for g in grads))
    total = float(torch.stack(grads).mean(0).pow(2).sum())
    var = local * (scale / n) / (n - 1) - total * scale / (n - 1)
    sqr = total - var / scale
    var, sqr = max(var, 1e-6), max(sqr, 0.0)
    return (var + sqr) / (var / scale + sqr)


def _train(wrapping: str, steps: int) -> Tuple[List[float], List[str]]:
    """Train the two layers with AdaScale under ``wrapping``; the gains and AdaScale's rank warnings."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
    from fairscale.nn.data_parallel import ShardedDataParallel as SDP

    model = _two_layers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapping == "ddp":
            wrapped: nn.Module = DDP(model)
            optim: Any = AdaScale(OSS(model.parameters(), optim=SGD, lr=0.1))
        elif wrapping == "sdp":
            oss = OSS(model.parameters(), optim=SGD, lr=0.1)
            wrapped = SDP(model, oss, reduce_buffer_size=0)
            optim = AdaScale(oss)
        elif wrapping == "sdp_buckets":
            oss = OSS(model.parameters(), optim=SGD, lr=0.1)
            wrapped = SDP(model, oss, reduce_buffer_size=2**20)
            optim = AdaScale(oss)
        elif wrapping == "fsdp":
            wrapped = FSDP(model)
            optim = AdaScale(SGD(wrapped.parameters(), lr=0.1))
        else:  # OSS wrapping AdaScale, under DDP
            wrapped = DDP(model)
            optim = OSS(model.parameters(), optim=AdaScaleWrapper, optim_cls=SGD, lr=0.1)
        adascale = optim if isinstance(optim, AdaScale) else optim.optim
        gains = []
        for step in range(steps):
            optim.zero_grad()
            wrapped(_inputs(step, torch.distributed.get_rank())).pow(2).mean().backward()
            optim.step()
            gains.append(adascale.gain())
    return gains, [str(w.message) for w in caught if str(w.message).startswith(WARNING_START)]


def _sharded_body(rank: int, world_size: int, wrapping: str) -> Dict[str, Any]:
    torch.set_num_threads(1)
    ddp_gains, ddp_warnings = _train("ddp", 3)
    gains, messages = _train(wrapping, 3)
    return {"ddp_gains": ddp_gains, "ddp_warnings": ddp_warnings, "gains": gains, "warnings": messages}


@pytest.mark.parametrize("wrapping", ["sdp", "sdp_buckets", "fsdp", "oss_wraps_adascale"])
def test_ranks_measuring_different_gradients_warn_once_on_every_rank(wrapping: str) -> None:
    results = run_distributed(_sharded_body, 2, wrapping, timeout=TIMEOUT)
    reference = _reference_first_gain(2)
    for result in results:
        # DDP: the plain-torch gain, the same on every rank, and no warning.
        assert result["ddp_gains"][0] == pytest.approx(reference, rel=1e-5)
        assert result["ddp_gains"] == results[0]["ddp_gains"]
        assert result["ddp_warnings"] == []
        # Sharded gradients: one warning per AdaScale over three windows, the same on every rank, naming the fix.
        assert len(result["warnings"]) == 1, result["warnings"]
        assert result["warnings"] == results[0]["warnings"]
        for advice in ("DistributedDataParallel", "AdaScale(OSS(", "optim_cls=OSS", "optim=AdaScaleWrapper"):
            assert advice in result["warnings"][0]
    # The reason for the warning: the ranks' gains differ.
    assert results[0]["gains"] != results[1]["gains"]


def _ddp_world_body(rank: int, world_size: int) -> Tuple[List[float], List[str]]:
    """DDP, two micro-batches a window (the first under no_sync), gradients of very different sizes from window to
    window: no warning at any world size, as the reduced gradients are the same on every rank."""
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 5))
    ddp = DDP(model)
    optim = AdaScale(SGD(model.parameters(), lr=0.01), num_gradients_to_accumulate=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            optim.zero_grad()
            for micro in range(2):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                x = x * 10.0 ** (step % 5 - 2)
                if micro == 0:
                    with ddp.no_sync():
                        ddp(x).pow(2).mean().backward()
                else:
                    ddp(x).pow(2).mean().backward()
            optim.step()
    return [optim.gain()], [str(w.message) for w in caught if str(w.message).startswith(WARNING_START)]


def test_measured_gradients_tolerance() -> None:
    """Unit check of the rule every rank applies to the all-reduced sums, then DDP worlds that must not warn."""
    same = measured_grads.payload_values(np.array([1234.5678, 0.0]))
    sums = [2 * v for v in torch.tensor(same).tolist()]  # two ranks, in the payload's fp32
    assert measured_grads.differing_group(sums, 2) is None
    other = measured_grads.payload_values(np.array([1234.5678, 1e-3]))  # group 1: 0 on one rank, 1e-3 on the other
    found = measured_grads.differing_group([a + b for a, b in zip(same, other)], 2)
    assert found is not None and found[0] == 1 and found[1] == pytest.approx(1.0)
    shifted = measured_grads.payload_values(np.array([1234.5678 * 1.01, 0.0]))  # 1% apart: told apart
    found = measured_grads.differing_group([a + b for a, b in zip(same, shifted)], 2)
    assert found is not None and found[0] == 0
    huge = measured_grads.payload_values(np.array([1e20, 0.0]))  # the square is beyond fp32: not checked
    assert measured_grads.differing_group(torch.tensor(huge).mul(2).tolist(), 2) is None
    for world_size in (2, 3):
        results = run_distributed(_ddp_world_body, world_size, timeout=TIMEOUT)
        assert all(messages == [] for _, messages in results), results
        assert all(gains == results[0][0] and math.isfinite(gains[0]) for gains, _ in results)


def _empty_rank_body(rank: int, world_size: int) -> str:
    """One parameter: OSS gives it to rank 0, and rank 1's AdaScale holds nothing to hook."""
    torch.set_num_threads(1)
    model = nn.Linear(4, 2, bias=False)
    try:
        OSS(model.parameters(), optim=AdaScaleWrapper, optim_cls=SGD, lr=0.1)
    except RanksDisagreeError as e:
        return str(e)
    return "built"


def test_oss_wrapping_adascale_with_a_rank_owning_nothing_is_refused_on_every_rank() -> None:
    messages = run_distributed(_empty_rank_body, 2, timeout=TIMEOUT)
    for message in messages:
        assert "holds a parameter that requires grad" in message, message
        assert "AdaScale(OSS(" in message and "optim_cls=OSS" in message
    assert messages[0].split("] ", 1)[-1] == messages[1].split("] ", 1)[-1]


def _snapshot_body(rank: int, world_size: int, debias_ewma: bool) -> Dict[str, Any]:
    torch.set_num_threads(1)
    model = _two_layers()
    ddp = DDP(model)

    def build() -> AdaScale:
        return AdaScale(OSS(model.parameters(), optim=SGD, lr=0.1, momentum=0.9), debias_ewma=debias_ewma)

    optim = build()

    def train(step: int) -> None:
        optim.zero_grad()
        ddp(_inputs(step, rank)).pow(2).mean().backward()
        optim.step()

    for step in range(2):
        train(step)
    optim.consolidate_state_dict(recipient_rank=-1)
    saved = optim.state_dict()
    at_save = copy.deepcopy(saved)
    gain_at_save = optim.gain()
    optim.set_scale(4.0)
    for step in range(2, 4):
        train(step)
    changed = [
        key
        for key, value in at_save["state"]["adascale"].items()
        if not np.array_equal(value, saved["state"]["adascale"][key])
    ]
    optim.unhook()
    resumed = build()
    resumed.load_state_dict(copy.deepcopy(saved))
    return {"changed": changed, "gain_at_save": gain_at_save, "resumed_gain": resumed.gain()}


@pytest.mark.parametrize("debias_ewma", [True, False])
def test_consolidated_adascale_statistics_are_a_snapshot(debias_ewma: bool) -> None:
    for result in run_distributed(_snapshot_body, 2, debias_ewma, timeout=TIMEOUT):
        assert result["changed"] == []
        # The checkpoint resumes with the gain of the moment it was taken (later steps rescaled it for scale 4).
        assert result["resumed_gain"] == result["gain_at_save"]


def test_consolidated_tensor_hyper_parameters_are_a_snapshot() -> None:
    """A tensor ``lr``, which torch's schedulers update in place, is copied into the consolidated dict too."""
    model = nn.Linear(4, 2)
    optim = OSS(model.parameters(), optim=SGD, lr=torch.tensor(0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    optim.consolidate_state_dict()
    saved = optim.state_dict()
    scheduler.step()
    assert float(optim.param_groups[0]["lr"]) == pytest.approx(0.05)
    assert float(saved["param_groups"][0]["lr"]) == pytest.approx(0.1)
