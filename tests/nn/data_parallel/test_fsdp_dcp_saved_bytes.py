# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``dcp.load`` scans each saved object (an optimizer's lr, betas, any non-tensor entry) before it loads it.

DCP writes such an object as the bytes of ``torch.save``; the load read them with ``torch.load(weights_only=True)``,
which hashes whatever dict keys the pickle builds. A saved ``lr`` replaced by a 1 KB ``torch.save`` zip whose pickle
uses a tuple shared at every level (60 levels) as a dict key hung every rank forever (a security review, session 50).
Now every rank raises ``UntrustedCheckpointError`` at once and nothing is loaded; the world runs under a timeout, so
the old hang fails the test instead of hanging it. The checkpoint is real: saved by ``dcp.save``, its ``.metadata``
then edited to point the object at the appended bytes (as someone handing the checkpoint over could).
"""

import os
import pickle
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp

# The hostile files shared with the scan's own tests live in tests/internal; that folder is on sys.path however this
# file is run.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "internal"))
from _pickle_bombs import hash_bomb  # noqa: E402

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - old torch
    DTensor = None

pytestmark = pytest.mark.skipif(DTensor is None, reason="needs torch with DTensor and torch.distributed.checkpoint")

LR = "optimizer.param_groups.0.lr"


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    fsdp = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    return fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)


def _replace_saved_object(checkpoint: str, fqn: str, blob: bytes) -> None:
    """Point the saved object ``fqn`` of ``checkpoint`` at ``blob``, appended to the data file that held it."""
    metadata_path = os.path.join(checkpoint, ".metadata")
    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, to edit it
    index = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[index]
    data_file = os.path.join(checkpoint, info.relative_path)
    info.offset, info.length = os.path.getsize(data_file), len(blob)
    with open(data_file, "ab") as f:
        f.write(blob)
    with open(metadata_path, "wb") as f:
        pickle.dump(metadata, f)


def _bomb_body(rank: int, world_size: int, root: str, fqn: str) -> None:
    fsdp, optim = _model(0)
    fsdp(torch.randn(2, 4)).sum().backward()
    optim.step()
    checkpoint = os.path.join(root, "ckpt")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=checkpoint)
    dist.barrier()
    if rank == 0:
        _replace_saved_object(checkpoint, fqn, hash_bomb(60))
    dist.barrier()
    other, other_optim = _model(5)
    with other.summon_full_params():
        before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match="nothing was loaded") as info:
        fsdp_dcp.load(other, other_optim, checkpoint_id=checkpoint)
    message = str(info.value)
    # Each entry is scanned as the reader reaches it (a tensor's too: DCP saves each with torch.save, and its reader
    # loaded them unscanned; a review, session 50).
    assert "UntrustedCheckpointError" in message and "refusing the entry of the checkpoint's data file" in message
    assert "take more than" in message and "steps to hash" in message, message
    assert other_optim.param_groups[0]["lr"] == 0.1  # nothing was loaded
    with other.summon_full_params():
        assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before))


@pytest.mark.parametrize("fqn", [LR, "model.0.weight"])
def test_a_hash_bomb_entry_is_refused_on_every_rank(tmp_path: Any, fqn: str) -> None:
    run_distributed(_bomb_body, 2, str(tmp_path), fqn, timeout=90)
