# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``p.data = tensor`` of the shard's own shape on an FSDP parameter between steps.

``torch.nn.utils.vector_to_parameters(v, model.parameters())`` (an evolution strategy, a weight average written back)
does exactly that. FSDP gathered from its own reference to the shard, and the end of the next forward set ``p.data``
back to it: the values were lost, silently (found by a fuzz of FSDP with torch utilities, session 42). Now the next
forward or summon (``state_dict()`` too) copies them into the shard; a tensor of another dtype or device is refused.
Two gloo ranks, the same data on both: compared with a single-process model given the same values.
"""

import functools
from typing import List

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 2
TIMEOUT = 120.0


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def _wrapped(flatten: bool, mixed_precision: bool) -> FSDP:
    net = _net()
    kwargs = dict(flatten_parameters=flatten, mixed_precision=mixed_precision)
    net[2] = FSDP(net[2], **kwargs)
    return FSDP(net, **kwargs)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> torch.Tensor:
    out = model(_batch(step))
    out.pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    return out.detach().float()


def _case_vector_to_parameters(flatten: bool, mixed_precision: bool, read_first: bool) -> None:
    model = _wrapped(flatten, mixed_precision)
    reference = _net()
    tol = dict(rtol=2e-2, atol=2e-2) if mixed_precision else dict(rtol=1e-5, atol=1e-6)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    _step(model, optim, 0)
    _step(reference, ref_optim, 0)
    # Each rank halves its own shards (rank-local, as vector_to_parameters is), the reference all its parameters.
    vector_to_parameters(parameters_to_vector(model.parameters()) * 0.5, model.parameters())
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    if read_first:  # a state dict before the next forward sees the values too
        state = model.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name].float(), value, **tol, msg=lambda m: f"{name}: {m}")
    for step in (1, 2):  # the optimizer keeps stepping the same parameters: their data is FSDP's shard again
        torch.testing.assert_close(_step(model, optim, step), _step(reference, ref_optim, step), **tol)
    with model.summon_full_params():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), **tol, msg=lambda m: f"{name}: {m}")


def _case_other_dtype_is_refused(flatten: bool) -> None:
    model = _wrapped(flatten, False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    param = next(model.parameters())
    shard = param.data
    param.data = shard.double()
    with pytest.raises(
        RuntimeError,
        match=r"replaced by a torch.float64 tensor on cpu .* torch.float32 shard on cpu. Convert .* model.to",
    ):
        model(_batch(1))
    param.data = shard  # put back: the model trains on
    _step(model, optim, 1)


def _halve(model: FSDP) -> List[torch.Tensor]:
    vector_to_parameters(parameters_to_vector(model.parameters()) * 0.5, model.parameters())
    return [p.data.clone() for p in model.parameters()]


def _case_shard_readers_take_it(flatten: bool) -> None:
    """Calls that read or write the shards directly (found by a review, session 43): local_state_dict() returned the
    values from before the assignment, a failed load rolled back to them, and a local (or DCP) load was overwritten
    by the pending tensor at the next forward."""
    model = _wrapped(flatten, False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    pending = _halve(model)
    local = model.local_state_dict()
    assert len(local) == len(pending)
    for got, want in zip(local.values(), pending):  # both in the flat parameters' order
        torch.testing.assert_close(got, want)
    bad = model.state_dict()
    bad.pop(next(iter(bad)))
    pending = _halve(model)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(bad)
    for p, want in zip(model.parameters(), pending):  # "unchanged" is the model with the assignment
        assert torch.equal(p.data, want)
    vector_to_parameters(torch.zeros_like(parameters_to_vector(model.parameters())), model.parameters())
    model.load_local_state_dict(local)
    model(_batch(1))  # the pending zeros were taken before the load, not over it at this forward
    for got, want in zip(model.local_state_dict().values(), local.values()):
        torch.testing.assert_close(got, want)


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (
                f"vector_to_parameters{', not flattened' if not flatten else ''}"
                f"{', mixed precision' if mp else ''}{', state_dict first' if read else ''}",
                functools.partial(_case_vector_to_parameters, flatten, mp, read),
            )
            for flatten in (True, False)
            for mp in (False, True)
            for read in (False, True)
        ]
        + [
            ("another dtype refused", functools.partial(_case_other_dtype_is_refused, True)),
            ("another dtype refused, not flattened", functools.partial(_case_other_dtype_is_refused, False)),
            ("shard readers take it", functools.partial(_case_shard_readers_take_it, True)),
            ("shard readers take it, not flattened", functools.partial(_case_shard_readers_take_it, False)),
        ]
    )


def test_same_shape_data_replacement_is_taken() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
