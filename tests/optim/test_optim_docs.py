# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of ``docs/optim.rst`` run as written on two gloo ranks and do what the text says.

Registered as "script" blocks in ``tests/test_docs_examples.py``; run here with the names they use (``model``,
``data``, ``DDP``) provided.
"""

import os
from typing import Any, Dict, List, Tuple

import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.device import device_generic_amp_scaler
from fairscale.optim import AdaScale
from fairscale.optim.grad_scaler import ShardedGradScaler

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "optim.rst")


def _blocks() -> List[str]:
    from test_docs_examples import rst_blocks

    return [code for _, code in rst_blocks(DOC)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(rank: int) -> List[torch.Tensor]:
    return [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(4)]


def _run(index: int, namespace: Dict[str, Any]) -> Dict[str, Any]:
    exec(compile(_blocks()[index], f"{DOC}:block{index}", "exec"), namespace)
    return namespace


def _scaler_example(rank: int, out: List[Tuple[float, bool]]) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    ns = _run(0, {"torch": torch, "model": model, "data": _data(rank)})
    # Enabled on the CPU from torch 2.3 (device-generic torch.amp.GradScaler); before, disabled there, as the page says.
    assert isinstance(ns["scaler"], ShardedGradScaler) and ns["scaler"].is_enabled() == device_generic_amp_scaler()
    with ns["model"].summon_full_params():
        changed = any(not torch.equal(a, p) for a, p in zip(before, ns["model"].module.parameters()))
    out.append((ns["scaler"].get_scale(), changed))


def _adascale_example(rank: int, out: List[Tuple[float, bool]]) -> None:
    ns = _run(1, {"torch": torch, "model": _model(), "data": _data(rank), "DDP": DistributedDataParallel})
    optimizer = ns["optimizer"]
    assert isinstance(optimizer, AdaScale) and optimizer.scale == 2
    assert 1.0 <= optimizer.gain() <= 2.0 and optimizer.param_groups[0]["lr"] == 0.1  # the gain is not left behind
    out.append((optimizer.gain(), True))


def _body(rank: int, world_size: int) -> List[Tuple[float, bool]]:
    out: List[Tuple[float, bool]] = []
    run_cases([("grad scaler", lambda: _scaler_example(rank, out)), ("adascale", lambda: _adascale_example(rank, out))])
    return out


def test_optim_doc_examples() -> None:
    results = run_distributed(_body, 2)
    assert results[0] == results[1]  # same scale (and gain) on both ranks
    (scale, stepped), (gain, _) = results[0]
    assert stepped and 1.0 <= scale <= 2.0**16 and 1.0 <= gain <= 2.0
