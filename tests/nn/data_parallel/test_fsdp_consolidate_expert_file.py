# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``consolidate_shard_weights(strict=False)`` of one rank's MoE expert file, as fairseq's and metaseq's
``stitch_fsdp_ckpt.py`` call it (a fuzz of client code, session 49).

Each expert lives on a process group of one rank (``no_broadcast_optim_state=True``), so a rank's file holds its
expert whole: the scripts consolidate it alone, with the whole model's metadata and ``strict=False`` (the dense
entries they left out are skipped, as upstream). The checkpoint identity this fork adds to the metadata made that
"saved by 2 ranks but 1 shards were given"; with ``strict=True`` every rank's files are still required.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class _MoE(nn.Module):
    def __init__(self, expert: nn.Module) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.expert = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.relu(self.dense(x)))


def _body(rank: int, world_size: int) -> None:
    singles = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(10 + rank)
    expert = nn.Linear(8, 8)
    want = {f"expert.{k}": v.clone() for k, v in expert.state_dict().items()}
    torch.manual_seed(0)
    model = FSDP(_MoE(FSDP(expert, process_group=singles[rank], no_broadcast_optim_state=True)))
    with torch.no_grad():
        model(torch.randn(2, 8))
    weights, meta = model.local_state_dict(), model.local_metadata_dict()
    expert_file = {k: v for k, v in weights.items() if "expert" in k}  # what a "-rank-N" expert file holds
    full = FSDP.consolidate_shard_weights([expert_file], [meta], strict=False)
    assert sorted(full) == sorted(want)
    for key, value in want.items():
        assert torch.equal(full[key], value), key
    with pytest.raises(ValueError, match="saved by 2 ranks but 1 shards were given .*strict=False"):
        FSDP.consolidate_shard_weights([expert_file], [meta])
    # Some ranks' files of the dense part cannot make its tensors whole, strict or not: said so.
    with pytest.raises(
        ValueError, match=rf"given \(ranks \[{rank}\] of 2: ranks \[{1 - rank}\] missing\) hold .* elements"
    ):
        FSDP.consolidate_shard_weights([weights], [meta], strict=False)


def test_an_expert_file_consolidates_alone_without_strict() -> None:
    run_distributed(_body, 2, timeout=120.0)
