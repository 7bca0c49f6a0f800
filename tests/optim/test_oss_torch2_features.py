# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS with features torch 2.x optimizers have and upstream never saw (a fuzz of them, session 49).

* Global step hooks (``register_optimizer_step_pre_hook``) ran for OSS and again for the optimizer it wraps: one that
  halves the gradients halved the owned ones twice. They run once per ``OSS.step()``; hooks registered on the
  wrapped optimizer itself still run.
* ``add_param_group`` of named parameters (``(name, parameter)`` pairs, torch 2.6+) failed with "'tuple' object has
  no attribute 'shape'".
* Ranks passing tensor ``betas`` that differ were not told apart (the tuple's repr rounds its tensors): the replicas
  drifted apart silently.

Two gloo ranks, the same batch on both; torch's optimizer over the same parameters is the reference.
"""

import functools
from typing import Any, List

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.version import torch_version
from fairscale.optim import OSS


def _halve_grads(calls: List[str], optimizer: Any, args: Any, kwargs: Any) -> None:
    calls.append(type(optimizer).__name__)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def _record(calls: List[str], what: str, optimizer: Any, args: Any, kwargs: Any) -> None:
    calls.append(f"{what} {type(optimizer).__name__}")


def _global_hooks_once(rank: int) -> None:
    calls: List[str] = []
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Linear(4, 4))
    plain = torch.optim.SGD(models[0].parameters(), lr=0.5)
    oss = OSS(models[1].parameters(), optim=torch.optim.SGD, lr=0.5)
    inner_pre = oss.optim.register_step_pre_hook(functools.partial(_record, calls, "inner pre"))
    handles = [
        register_optimizer_step_pre_hook(functools.partial(_halve_grads, calls)),
        register_optimizer_step_post_hook(functools.partial(_record, calls, "global post")),
    ]
    try:
        for model, optimizer in zip(models, (plain, oss)):
            calls.clear()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        assert calls == ["OSS", "inner pre SGD", "global post OSS"], calls
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        for handle in handles + [inner_pre]:
            handle.remove()


def _named_parameters_added(rank: int) -> None:
    if torch_version() < (2, 6, 0):
        return  # torch's optimizers take (name, parameter) pairs from 2.6
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    named = [list(m.named_parameters()) for m in models]
    plain = torch.optim.Adam(named[0][:2], lr=0.01)
    oss = OSS(named[1][:2], optim=torch.optim.Adam, lr=0.01)
    for optimizer, params in ((plain, named[0]), (oss, named[1])):
        optimizer.add_param_group({"params": params[2:], "lr": 0.02})
    assert oss.param_groups[1]["param_names"] == plain.param_groups[1]["param_names"] == ["1.weight", "1.bias"]
    for step in range(2):
        for model, optimizer in zip(models, (plain, oss)):
            optimizer.zero_grad()
            model(torch.full((2, 4), float(step + 1))).sum().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _tensor_betas_that_differ(rank: int) -> None:
    params = list(nn.Linear(2, 2).parameters())
    betas = (torch.tensor(0.9), torch.tensor(0.999 + 4e-5 * rank))  # equal in the tuple's repr (4 digits)
    with pytest.raises(RanksDisagreeError, match="betas"):
        OSS(params, optim=torch.optim.Adam, lr=0.01, betas=betas)
    OSS(params, optim=torch.optim.Adam, lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.999)))  # equal: fine


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("global step hooks run once", functools.partial(_global_hooks_once, rank)),
            ("add_param_group of named parameters", functools.partial(_named_parameters_added, rank)),
            ("tensor betas that differ between ranks", functools.partial(_tensor_betas_that_differ, rank)),
        ]
    )


def test_oss_with_torch_2_optimizer_features() -> None:
    run_distributed(_body, 2, timeout=120.0)
