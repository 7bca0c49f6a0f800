# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP, ShardedDataParallel and OSS under PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

What FSDP cannot check without a collective per step (ranks whose control flow diverges: another number of
``no_sync`` microbatches, ``clip_grad_norm_`` on one rank only, ``state_dict()`` on rank 0 only) is what PyTorch's
debug mode is for: every process group, FSDP's own included, is wrapped in a checker that compares each collective's
fingerprint across ranks first and raises "Detected mismatch between collectives" on every rank. docs/fsdp.rst sends
users there. These worlds prove that fairscale's collectives layer runs under it unchanged (same training as a
single-process reference) and that a diverging rank is then an error on every rank, not a hang or a gloo abort.
"""

import atexit
import copy
import functools
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import init_gloo_world, run_ranks
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import ShardedDataParallel, hybrid_groups, zero2_groups
from fairscale.optim import OSS

WORLD = 2
TIMEOUT = 90.0
STEPS, MICROBATCHES, BATCH = 2, 2, 3


def _init_detail(directory: str, rank: int, world_size: int = WORLD) -> None:
    """A gloo world with the debug level set before the groups exist (the env var is read at ``import torch``)."""
    init_gloo_world(directory, rank, world_size, dist.DebugLevel.DETAIL)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 2))


def _data(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(100 * step + 10 * mb + rank))


def _reference(world_size: int) -> nn.Module:
    """One process, the whole global batch: what every rank's model must equal after the same steps."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            for rank in range(world_size):
                (model(_data(step, mb, rank)).pow(2).sum() / world_size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model


def _parity_body(directory: str, kind: str, world_size: int, rank: int) -> str:
    _init_detail(directory, rank, world_size)
    wrapper_type = type(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))).__name__
    net = _net()
    model: Any
    if kind.startswith("fsdp"):
        groups: Dict[str, Any] = {}
        if kind == "fsdp_zero2":
            groups = {"zero2_process_group": zero2_groups(1)}
        elif kind == "fsdp_hybrid":
            shard, replicate = hybrid_groups(2)
            groups = {"process_group": shard, "replicate_process_group": replicate}
        net[2] = FSDP(net[2], flatten_parameters=False, **groups)
        model = FSDP(net, reshard_after_forward=True, **groups)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
        clip = model.clip_grad_norm_
    else:
        opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1)
        model = ShardedDataParallel(net, opt)
        clip = opt.clip_grad_norm
    for step in range(STEPS):
        with model.no_sync():
            model(_data(step, 0, rank)).pow(2).sum().backward()
        for mb in range(1, MICROBATCHES):
            model(_data(step, mb, rank)).pow(2).sum().backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()
    if kind.startswith("fsdp"):
        full = model.state_dict()
    else:
        opt.consolidate_state_dict(recipient_rank=0)  # OSS's own broadcasts, checked too
        full = net.state_dict()
    for key, value in _reference(world_size).state_dict().items():
        torch.testing.assert_close(full[key].float(), value, rtol=1e-5, atol=1e-6, msg=key)
    return wrapper_type


@pytest.mark.parametrize(
    "kind, world_size", [("fsdp", 2), ("fsdp_zero2", 2), ("fsdp_hybrid", 4), ("sharded_ddp_oss", 2)]
)
def test_training_under_the_collective_checker(tmp_path: Any, kind: str, world_size: int) -> None:
    body = functools.partial(_parity_body, str(tmp_path), kind, world_size)
    wrapper_types = run_ranks(body, world_size, timeout=TIMEOUT)
    # The checker really wrapped the groups (without it the backend would be ProcessGroupGloo).
    assert wrapper_types == ["_ProcessGroupWrapper"] * world_size, wrapper_types


def _diverging_body(directory: str, rank: int) -> str:
    _init_detail(directory, rank)
    # A group torn down after a failed collective can abort gloo at interpreter exit: end the rank after its report.
    atexit.register(os._exit, 0)
    model = FSDP(copy.deepcopy(_net()))
    model(_data(0, 0, rank)).sum().backward()
    try:
        if rank == 0:  # the classic mistake: a call that is collective, made on one rank only
            model.clip_grad_norm_(1.0)
        model(_data(1, 0, rank)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_diverging_rank_is_an_error_on_every_rank_under_the_checker(tmp_path: Any) -> None:
    messages: List[str] = run_ranks(functools.partial(_diverging_body, str(tmp_path)), WORLD, timeout=TIMEOUT)
    for rank, msg in enumerate(messages):
        assert "Detected mismatch between collectives" in msg, f"rank {rank}: {msg[:500]}"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
