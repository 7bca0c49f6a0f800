# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.parallel."""

import os
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed, run_ranks
from fairscale.internal import collectives
from fairscale.internal.parallel import (
    ProcessGroupName,
    chunk_and_pad,
    enable_pytorch_sync_bn,
    get_process_group_cached,
    validate_process_group,
)


@pytest.mark.parametrize(
    "numel, num_chunks, real_sizes",
    [
        (42, 4, [11, 11, 11, 9]),  # last chunk padded by 2
        (5, 4, [2, 2, 1, 0]),  # torch.chunk gives 3 pieces: an all-padding chunk is appended
        (2, 4, [1, 1, 0, 0]),  # fewer elements than chunks
        (1, 3, [1, 0, 0]),
        (8, 4, [2, 2, 2, 2]),  # even split: no padding
        (7, 1, [7]),
        (0, 3, [0, 0, 0]),
    ],
)
def test_chunk_and_pad(numel: int, num_chunks: int, real_sizes: List[int]) -> None:
    tensor = torch.arange(1, numel + 1, dtype=torch.float32)
    chunks = chunk_and_pad(tensor, num_chunks)
    assert len(chunks) == num_chunks
    length = max(real_sizes)
    assert all(c.shape == (length,) and c.dtype == tensor.dtype for c in chunks)
    start = 0
    for chunk, real in zip(chunks, real_sizes):
        assert torch.equal(chunk[:real], tensor[start : start + real])
        assert torch.equal(chunk[real:], torch.zeros(length - real))
        start += real
    assert torch.equal(torch.cat(chunks)[:numel], tensor)


def test_chunk_and_pad_flattens_and_views() -> None:
    tensor = torch.arange(12.0).view(3, 4)
    chunks = chunk_and_pad(tensor, 3)
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert chunks[1].data_ptr() == tensor.data_ptr() + 4 * tensor.element_size()  # unpadded: a view
    with pytest.raises(RuntimeError, match="num_chunks must be positive"):  # torch's class upstream, a ValueError too
        chunk_and_pad(tensor, 0)


def test_process_group_name() -> None:
    assert ProcessGroupName.default == "default" and ProcessGroupName.reduce_scatter == "reduce_scatter"
    assert ProcessGroupName("reduce_scatter") is ProcessGroupName.reduce_scatter
    assert isinstance(ProcessGroupName.default, str)


def test_enable_pytorch_sync_bn() -> None:
    class LegacySyncBN(nn.SyncBatchNorm):
        """A SyncBatchNorm of the PyTorch versions that needed the device count from DDP."""

        def _specify_ddp_gpu_num(self, gpu_size: int) -> None:
            self.told = gpu_size

    plain = nn.BatchNorm1d(3)
    model: Any = nn.Sequential(
        nn.Linear(3, 3), LegacySyncBN(3), nn.Sequential(LegacySyncBN(3)), plain, nn.SyncBatchNorm(3)
    )
    enable_pytorch_sync_bn(model)
    assert model[1].told == 1 and model[2][0].told == 1
    assert not hasattr(plain, "told")


def _not_initialised_body(rank: int) -> None:
    # Under pytest the reduce_scatter name tolerates a missing world (returns None)...
    assert get_process_group_cached(ProcessGroupName.reduce_scatter) is None
    # ...the default one does not.
    with pytest.raises(RuntimeError, match="not initialised"):
        get_process_group_cached()


def test_get_process_group_cached_without_distributed() -> None:
    run_ranks(_not_initialised_body, 1)


def _world_body(rank: int, ws: int, tmp: str) -> None:
    default = get_process_group_cached()
    assert default is get_process_group_cached(ProcessGroupName.default)
    assert default is not dist.group.WORLD  # a new communicator, as upstream
    assert collectives.group_ranks(default) == tuple(range(ws))
    reduce_scatter = get_process_group_cached(ProcessGroupName.reduce_scatter)
    assert reduce_scatter is not default and collectives.group_size(reduce_scatter) == ws
    assert reduce_scatter is get_process_group_cached(name=ProcessGroupName.reduce_scatter)
    # Keyed by sorted unique ranks; every rank creates every group (new_group is world-collective).
    sub = get_process_group_cached(ranks=[2, 0])
    assert sub is get_process_group_cached(ranks=[0, 2, 2])
    other = get_process_group_cached(ProcessGroupName.reduce_scatter, ranks=[0, 2])
    if rank in (0, 2):
        assert sub is not other
        assert collectives.group_ranks(sub) == (0, 2)
        validate_process_group(torch.device("cpu"), sub)
    else:  # was "zeros: Dimension size must be non-negative" (the group size is -1 there)
        with pytest.raises(ValueError, match="not a member of the process group"):
            validate_process_group(torch.device("cpu"), sub)
    validate_process_group(torch.device("cpu"), default)
    validate_process_group(torch.device("cpu"), reduce_scatter)
    with pytest.raises(ValueError, match="ranks is empty"):
        get_process_group_cached(ranks=[])
    # A new world (destroy + init) must not hand out groups of the old one.
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(tmp, "second_world"), ws)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws)
    assert get_process_group_cached() is not default


def test_get_process_group_cached_and_validate(tmp_path: Any) -> None:
    run_distributed(_world_body, 3, tmp=str(tmp_path))
