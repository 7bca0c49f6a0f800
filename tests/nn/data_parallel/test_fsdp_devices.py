# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The same FSDP checks on every device: CPU/gloo always, CUDA/NCCL where two GPUs exist.

The rest of the suite runs on CPU only (its ranks are pinned to CPU by the engine). This module is the CUDA variant
of the core behaviour: training parity with a single-process fp32 reference over an accumulation window (mixed
precision, resharding, optimize_backward_concat, zero2), state dicts between a forward and its backward, and the
collectives seen by the counter. The CPU run checks the checks themselves, so a GPU session only adds the device.

Bodies are module-level functions with picklable arguments: a CUDA world is spawned when this process has already
initialised CUDA.
"""

import contextlib
import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
from _models import DTYPES, UPDATE_REL, assert_update_close
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances, zero2_groups

WORLD = 2  # of the collectives test; parity also runs at world size 1 (a machine with one GPU)
TIMEOUT = 240.0  # a spawned CUDA world starts slowly
DIM_IN, DIM, DIM_OUT, BATCH = 6, 11, 3, 4
DEVICES = ["cpu", "cuda"]
PARITY_WORLDS = [("cpu", 1), ("cpu", 2), ("cuda", 1), ("cuda", 2)]


class Net(nn.Module):
    """input linear -> two residual blocks -> head; odd sizes so every shard is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM_IN, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM + 2), nn.Tanh(), nn.Linear(DIM + 2, DIM)) for _ in range(2)
        )
        self.head = nn.Linear(DIM, DIM_OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _batch(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(BATCH, DIM_IN, generator=torch.Generator().manual_seed(100 * step + 10 * mb + rank))


def _loss(out: Tensor) -> Tensor:
    return out.float().pow(2).mean()


def _build(device: torch.device, prec: str, raf: bool, obc: bool, zero2: Any) -> FSDP:
    torch.manual_seed(0)
    net = Net().to(device)
    kwargs: Dict[str, Any] = dict(
        mixed_precision=prec != "fp32",
        compute_dtype=DTYPES[prec] if prec != "fp32" else None,
        reshard_after_forward=raf,
        optimize_backward_concat=obc,
        zero2_process_group=zero2,
    )
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], **kwargs)
    return FSDP(net, **kwargs)


def _reference(steps: int, num_mb: int, world_size: int) -> Dict[str, Tensor]:
    """Single process, fp32, on CPU: every rank's microbatches, gradient averaged as FSDP does."""
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        for mb in range(num_mb):
            for rank in range(world_size):
                (_loss(ref(_batch(step, mb, rank))) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _initial() -> Dict[str, Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def _assert_idle(model: FSDP) -> None:
    for m in get_fsdp_instances(model):
        assert m.training_state == TrainingState.IDLE, m.training_state


def _train_case(device_type: str, rank: int, world_size: int, prec: str, raf: bool, obc: bool, zero2: Any) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    model = _build(device, prec, raf, obc, zero2)
    assert all(m.compute_device.type == device.type for m in get_fsdp_instances(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, num_mb = 2, 2
    idle = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(steps):
        for mb in range(num_mb):
            ctx = model.no_sync() if mb < num_mb - 1 else contextlib.nullcontext()
            with ctx:
                out = model(_batch(step, mb, rank).to(device))
                assert out.device.type == device.type
                assert out.dtype == (torch.float32 if prec == "fp32" else DTYPES[prec])
                loss = _loss(out)
                if step == 0 and mb == 0:
                    # A checkpoint between a forward and its backward returns the idle values, changes nothing.
                    mid = model.state_dict()
                    assert list(mid) == list(idle)
                    for k in idle:
                        assert torch.equal(mid[k], idle[k]), k
                with count_collectives() as counter:
                    loss.backward()
                _assert_idle(model)
                if mb < num_mb - 1:  # no_sync: no gradient leaves the rank
                    assert counter.count() == counter.count("all_gather"), counter.summary()
        for p in model.parameters():
            assert p.grad is not None and p.grad.device.type == device.type and p.grad.dtype == torch.float32
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    want = _reference(steps, num_mb, world_size)
    assert list(got) == list(want)
    if prec == "fp32":
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    else:
        assert_update_close(got, want, _initial(), UPDATE_REL[prec], f"{device_type} {prec}")


def _training_body(rank: int, world_size: int, device_type: str) -> None:
    zero2 = zero2_groups(1)
    cases = []
    for prec in ("fp32", "fp16", "bf16"):
        for raf in (True, False):
            for obc in (False, True):
                name = f"{prec},raf={raf},obc={obc}"
                cases.append(
                    (name, lambda p=prec, r=raf, o=obc: _train_case(device_type, rank, world_size, p, r, o, None))
                )
    for prec in ("fp32", "bf16"):
        name = f"{prec},zero2 group of 1"
        cases.append((name, lambda p=prec: _train_case(device_type, rank, world_size, p, True, True, zero2)))
    run_cases(cases)


@pytest.mark.parametrize("device_type,world_size", PARITY_WORLDS, ids=[f"{d}-ws{w}" for d, w in PARITY_WORLDS])
def test_training_parity_on_device(device_type: str, world_size: int) -> None:
    """Parity with the fp32 reference after two 2-microbatch windows, on the device, across the feature matrix."""
    run_distributed(_training_body, world_size, device_type, device=device_type, timeout=TIMEOUT)


def _communication_body(rank: int, world_size: int, device_type: str) -> List[Any]:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    model = _build(device, "bf16", True, False, None)
    _loss(model(_batch(0, 0, rank).to(device))).backward()  # first iteration: lazy init and its one-time check
    with count_collectives() as counter:
        _loss(model(_batch(1, 0, rank).to(device))).backward()
    return [(r.kind, r.phase, r.group_size, r.dtype) for r in counter.records]


@pytest.mark.parametrize("device_type", DEVICES)
def test_collectives_per_iteration_on_device(device_type: str) -> None:
    """bf16 compute: 3 forward gathers, 2 backward gathers (the root keeps its parameters), one bucketed
    reduce-scatter of the bf16 gradients, everything over the 2 ranks."""
    records = run_distributed(_communication_body, WORLD, device_type, device=device_type, timeout=TIMEOUT)[0]
    assert [r[:2] for r in records] == [("all_gather", "forward")] * 3 + [("all_gather", "backward")] * 2 + [
        ("reduce_scatter", "backward")
    ], records
    assert all(r[2] == WORLD and r[3] == torch.bfloat16 for r in records), records
