# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of the "Distributed checkpoints (DCP)" section of ``docs/checkpointing.rst`` run as written on two
gloo ranks and do what the text says: what is saved comes back here, into FSDP2 and into the plain module.

Registered as "script" blocks in ``tests/test_docs_examples.py``.
"""

import os
from typing import Any, Dict, List

import pytest
import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without FSDP2
    DTensor = None

pytestmark = pytest.mark.skipif(DTensor is None, reason="needs torch with FSDP2 (fully_shard) and DTensor")

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    "docs",
    "checkpointing.rst",
)
SECTION = "Distributed checkpoints (DCP)"
OSS_SUBSECTION = "OSS optimizer state"


def _blocks() -> List[str]:
    from test_docs_examples import rst_blocks  # tests/ is on sys.path (rootdir conftest)

    lines = open(DOC).read().splitlines()
    start = lines.index(SECTION) + 1
    end = lines.index(OSS_SUBSECTION) + 1  # its examples are run by tests/optim/test_oss_dcp.py
    return [code for line, code in rst_blocks(DOC) if start < line < end]


class MyModel(nn.Module):
    """What the examples call ``MyModel``: blocks in ``.blocks`` (one FSDP instance each) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5)) for _ in range(2))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _fairscale(seed: int) -> FSDP:
    torch.manual_seed(seed)
    net = MyModel()
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FSDP(block)
    return FSDP(net)


def _step(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    optim.zero_grad()
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    optim.step()


def _full(sd: Dict[str, Any]) -> Dict[str, Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def _same(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key}"


def _run(code: str, namespace: Dict[str, Any]) -> None:
    exec(compile(code, DOC, "exec"), namespace)


def _examples(rank: int, world_size: int, directory: str) -> None:
    os.chdir(directory)
    blocks = _blocks()
    assert len(blocks) == 6, len(blocks)  # the sixth (tensor parallelism) is run by test_fsdp_dcp_groups.py
    model = _fairscale(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optim, rank)
    ns: Dict[str, Any] = {"model": model, "optim": optim, "torch": torch, "MyModel": MyModel, "world_size": world_size}
    _run(blocks[0], ns)  # dcp.save of the state dicts
    saved = model.state_dict()
    optim_saved = {i: {k: v.clone() for k, v in entry.items()} for i, entry in optim.state_dict()["state"].items()}
    _step(model, optim, rank)  # something for the load to undo
    _run(blocks[1], ns)  # dcp.load + set_state_dict
    _same(model.state_dict(), saved, "resumed with dcp.load")
    for i, entry in optim_saved.items():
        for key, value in entry.items():
            assert torch.equal(optim.state_dict()["state"][i][key], value), (i, key)
    _step(model, optim, rank)
    at_step_3 = model.state_dict()
    _run(blocks[2], ns)  # save, async_save, load
    _same(model.state_dict(), at_step_3, "save / async_save / load")
    other = _fairscale(1)  # another model loads the async checkpoint too
    other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
    _run(
        "fsdp_dcp.load(other, other_optim, checkpoint_id='ckpt/step-3')", dict(ns, other=other, other_optim=other_optim)
    )
    _same(other.state_dict(), at_step_3, "another fairscale model")
    _run(blocks[3], ns)  # FSDP2
    _same(_full(get_model_state_dict(ns["net"])), at_step_3, "FSDP2")
    _run(blocks[4], ns)  # the plain module
    _same(ns["plain"].state_dict(), at_step_3, "plain module")


def test_dcp_doc_examples(tmp_path: Any) -> None:
    run_distributed(_examples, 2, str(tmp_path))
