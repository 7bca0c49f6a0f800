# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel + OSS trains exactly like PyTorch's DDP + the plain optimizer.

The matrix of upstream's parity test (buckets on/off, gradient accumulation with ``no_sync``, manual reduction,
several forwards through one sub-module, gradient clipping, two optimizers) with SGD, Adam and AdamW, on real gloo
worlds. Trainability changes are compared with the same computation on one process (DDP itself never reduces a
parameter that was frozen when it was built). Both zeroing styles are checked: ``ShardedDataParallel.zero_grad()``
and the optimizer's ``zero_grad()`` (set-to-None), which broke upstream's gradient buckets on torch 2.
"""

import copy
import itertools
from typing import Any, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 120.0
STEPS = 3
OPTIMS = {
    "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


class _MLPEmb(nn.Module):
    """Embedding -> trunk of three linears -> head of two linears (applied twice with ``multiple_fw``)."""

    def __init__(self, multiple_fw: bool) -> None:
        super().__init__()
        self.multiple_fw = multiple_fw
        self.emb = nn.Embedding(32, 2)
        self.trunk = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.trunk(self.emb(x)))
        return self.head(h) if self.multiple_fw else h


def _model(multiple_fw: bool, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return _MLPEmb(multiple_fw).to(device)


def _batch(step: int, micro: int, rank: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 32, (8, 2), generator=gen).to(device)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.abs().sum()


def _assert_same(model: nn.Module, ref: nn.Module, msg: str) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-5, rtol=1e-5, msg=f"{msg}: {name}")


def _parity_case(
    rank: int,
    device: torch.device,
    optim: str,
    buffer: int,
    accumulate: bool,
    manual: bool,
    multiple_fw: bool,
    clip: bool,
    zero: str,
) -> None:
    optim_cls, kwargs = OPTIMS[optim]
    model = _model(multiple_fw, device)
    ref_model = copy.deepcopy(model)
    oss = OSS(model.parameters(), optim_cls, **kwargs)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
    ddp = DDP(ref_model, device_ids=[device.index] if device.type == "cuda" else None)
    ref_opt = optim_cls(ref_model.parameters(), **kwargs)
    micro = 2 if accumulate else 1
    for step in range(STEPS):
        if zero == "sdp":
            sdp.zero_grad(set_to_none=step % 2 == 1)
        else:
            oss.zero_grad()  # set_to_none=True: gradients detached from the buckets
        ref_opt.zero_grad()
        for m in range(micro):
            last = m == micro - 1
            with sdp.no_sync() if (not last or manual) else _null():
                _loss(sdp(_batch(step, m, rank, device))).backward()
            with ddp.no_sync() if not last else _null():
                _loss(ddp(_batch(step, m, rank, device))).backward()
        if manual:
            sdp.reduce()
        if clip:
            norm = oss.clip_grad_norm(0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
            torch.testing.assert_close(norm, ref_norm, msg="clip_grad_norm total")
        oss.step()
        ref_opt.step()
        _assert_same(model, ref_model, f"step {step}")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _parity_body(rank: int, world_size: int, device_type: str, scope: str) -> None:
    """``scope``: "all" (every optimizer everywhere), "matrix" (the full option matrix), "core" (a cheap subset)."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    cases: List[Tuple[str, Any]] = []
    for buffer, accumulate, manual, multiple_fw, zero in itertools.product(
        (0, 2**20), (False, True), (False, True), (False, True), ("sdp", "optimizer")
    ):
        if scope == "core" and (manual or multiple_fw):
            continue
        if scope == "core":
            optims = ["adamw"] if accumulate else ["sgd"]
        else:
            optims = list(OPTIMS) if scope == "all" or (accumulate and not manual) else ["sgd"]
        for optim in optims:
            clip = multiple_fw and optim == "sgd"
            name = f"{optim},buffer={buffer},accum={accumulate},manual={manual},multi_fw={multiple_fw},zero={zero}"
            args = (rank, device, optim, buffer, accumulate, manual, multiple_fw, clip, zero)
            cases.append((name, lambda a=args: _parity_case(*a)))
    run_cases(cases)


# The whole option matrix at world size 2; a cheap core elsewhere (world size 1: no communication, buckets off).
PARITY_WORLDS = [
    ("cpu", 1, "core"),
    ("cpu", 2, "matrix"),
    ("cpu", 4, "core"),
    ("cuda", 1, "core"),
    ("cuda", 2, "matrix"),
]


@pytest.mark.parametrize(
    "device_type,world_size,scope", PARITY_WORLDS, ids=[f"{d}-ws{w}-{s}" for d, w, s in PARITY_WORLDS]
)
def test_ddp_parity(device_type: str, world_size: int, scope: str) -> None:
    run_distributed(_parity_body, world_size, device_type, scope, device=device_type, timeout=TIMEOUT)


@pytest.mark.slow
def test_ddp_parity_all_optimizers() -> None:
    run_distributed(_parity_body, 2, "cpu", "all", timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Trainability changes and two optimizers: compared with one process computing DDP's average.


def _reference_grads(model: nn.Module, step: int, world_size: int, device: torch.device) -> None:
    for r in range(world_size):
        (_loss(model(_batch(step, 0, r, device))) / world_size).backward()


def _train_change_case(rank: int, world_size: int, optim: str, buffer: int, auto: bool) -> None:
    device = torch.device("cpu")
    optim_cls, kwargs = OPTIMS[optim]
    model = _model(False, device)
    ref = copy.deepcopy(model)
    first, ref_first = next(model.parameters()), next(ref.parameters())
    first.requires_grad_(False)
    ref_first.requires_grad_(False)
    oss = OSS(model.parameters(), optim_cls, **kwargs)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer, auto_refresh_trainable=auto)
    ref_opt = optim_cls(ref.parameters(), **kwargs)
    for step in range(4):
        if step in (1, 3):
            # Unfreeze after the first step, freeze again before the last one.
            first.requires_grad_(step == 1)
            ref_first.requires_grad_(step == 1)
            if not auto:
                sdp.refresh_trainable()
        sdp.zero_grad(set_to_none=True)
        ref_opt.zero_grad()
        _loss(sdp(_batch(step, 0, rank, device))).backward()
        _reference_grads(ref, step, world_size, device)
        oss.step()
        ref_opt.step()
        _assert_same(model, ref, f"step {step}")


def _two_optimizers_case(rank: int, world_size: int, buffer: int) -> None:
    device = torch.device("cpu")
    model = _model(False, device)
    ref = copy.deepcopy(model)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    oss = [OSS(params[:5], torch.optim.SGD, lr=1e-2, momentum=0.9), OSS(params[5:], torch.optim.Adam, lr=1e-2)]
    ref_opts = [torch.optim.SGD(ref_params[:5], lr=1e-2, momentum=0.9), torch.optim.Adam(ref_params[5:], lr=1e-2)]
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
    for step in range(3):
        for o in oss + ref_opts:
            o.zero_grad()
        _loss(sdp(_batch(step, 0, rank, device))).backward()
        _reference_grads(ref, step, world_size, device)
        for o in oss + ref_opts:
            o.step()
        _assert_same(model, ref, f"step {step}")


def _changes_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Any]] = []
    optims = ("sgd", "adamw") if world_size == 2 else ("adamw",)
    for optim, buffer, auto in itertools.product(optims, (0, 2**20), (True, False)):
        name = f"trainability,{optim},buffer={buffer},auto_refresh={auto}"
        cases.append((name, lambda o=optim, b=buffer, a=auto: _train_change_case(rank, world_size, o, b, a)))
    for buffer in (0, 2**20):
        cases.append((f"two_optimizers,buffer={buffer}", lambda b=buffer: _two_optimizers_case(rank, world_size, b)))
    run_cases(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_trainability_change_and_two_optimizers(world_size: int) -> None:
    run_distributed(_changes_body, world_size, timeout=TIMEOUT)
