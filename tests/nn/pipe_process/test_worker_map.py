# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe where torch RPC runs (upstream's test helpers start it): upstream's transport rules.

With RPC initialised, AsyncPipe sends through RPC, as upstream did, so a missing ``worker_map`` is upstream's
``ValueError``; with ``get_worker_map()`` it trains and matches the same layers run in one process. Without RPC the
point-to-point default needs no worker map (tests/nn/pipe_process/test_pipe.py).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.testing import get_worker_map, torch_spawn
from fairscale.nn.model_parallel import get_pipeline_parallel_group
from fairscale.nn.pipe import AsyncPipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _missing_worker_map() -> None:
    with pytest.raises(ValueError, match="'RpcTransport' requires 'worker_map' to be set"):
        AsyncPipe(_model(), [2, 1], group=get_pipeline_parallel_group())


torch_spawn([2])(_missing_worker_map)


def _rpc_pipe_matches_one_process() -> None:
    reference = _model()
    pipe = AsyncPipe(copy.deepcopy(reference), [2, 1], group=get_pipeline_parallel_group(), worker_map=get_worker_map())
    x = torch.linspace(-1, 1, 24).view(6, 4)
    out = pipe(x)
    expected = reference(x)
    expected.sum().backward()
    # This rank's stage: layers [0, 2) on rank 0, [2, 3) on rank 1.
    local = list(reference[:2].parameters()) if dist.get_rank() == 0 else list(reference[2:].parameters())
    if dist.get_rank() == 1:  # the last stage returns the output and starts the backward
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.sum().backward()
    got_params = list(pipe.parameters())
    assert len(got_params) == len(local), (len(got_params), len(local))
    for got, want in zip(got_params, local):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


torch_spawn([2])(_rpc_pipe_matches_one_process)
