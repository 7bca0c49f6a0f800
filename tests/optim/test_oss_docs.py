# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of ``docs/oss.rst`` run as written on two gloo ranks and do what the text says.

The only edit is ``dist.init_process_group(`` (the test rank's group exists already). Registered as "script"
blocks in ``tests/test_docs_examples.py``.
"""

import copy
import os
from typing import Any, Dict, List

import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "oss.rst")


def _blocks() -> List[str]:
    from test_docs_examples import rst_blocks  # tests/ is on sys.path (rootdir conftest)

    return [code for _, code in rst_blocks(DOC)]


def _init_process_group(backend: str, *args: Any, **kwargs: Any) -> None:
    assert dist.is_initialized() and backend in ("gloo", "nccl")


def _run(code: str, namespace: Dict[str, Any]) -> Dict[str, Any]:
    assert "dist.init_process_group(" in code or "init_process_group" not in code
    exec(compile(code.replace("dist.init_process_group(", "_init_process_group("), DOC, "exec"), namespace)
    return namespace


def _my_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loader(rank: int) -> List[torch.Tensor]:
    return [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(3)]


def _same_across_ranks(model: nn.Module) -> None:
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered)


def _ddp_example(rank: int, world_size: int) -> None:
    """OSS + DDP: same parameters as a one-process AdamW on the average of the ranks' losses."""
    ns = _run(_blocks()[0], {"MyModel": _my_model, "loader": _loader(rank), "_init_process_group": _init_process_group})
    assert isinstance(ns["optimizer"], OSS)
    ref = _my_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(3):
        opt.zero_grad()
        for r in range(world_size):
            (ref(_loader(r)[step]).pow(2).mean() / world_size).backward()
        opt.step()
    for a, b in zip(ns["model"].module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _sdp_example(rank: int, world_size: int) -> Dict[str, Any]:
    """OSS + ShardedDataParallel with accumulation over two microbatches and clipping: ranks agree, loss moves."""
    loader = [[x, x * 0.5] for x in _loader(rank)]
    ns = _run(_blocks()[1], {"MyModel": _my_model, "loader": loader})
    assert isinstance(ns["model"], ShardedDataParallel)
    _same_across_ranks(ns["model"])
    changed = [not torch.equal(a, b) for a, b in zip(ns["model"].parameters(), _my_model().parameters())]
    assert all(changed)
    return ns


def _checkpoint_example(rank: int, world_size: int, path: str) -> None:
    ns = _sdp_example(rank, world_size)
    model, optimizer = ns["model"], ns["optimizer"]
    expected = copy.deepcopy(optimizer.state_dict(all_ranks=True))
    ns.update({"dist": dist, "path": path})
    _run(_blocks()[2], ns)
    dist.barrier()  # "later": the file is written
    _run(_blocks()[3], ns)
    # Loaded back: the same consolidated state, and the owned state on each rank.
    again = optimizer.state_dict(all_ranks=True)
    assert list(again["state"]) == list(expected["state"])
    for key, entry in expected["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(again["state"][key][name], value)
    assert isinstance(model, ShardedDataParallel)


def _examples_body(rank: int, world_size: int, path: str) -> None:
    run_cases(
        [
            ("oss + ddp", lambda: _ddp_example(rank, world_size)),
            ("oss + sharded ddp", lambda: _sdp_example(rank, world_size)),
            ("checkpoint", lambda: _checkpoint_example(rank, world_size, path)),
        ]
    )


def test_oss_doc_examples(tmp_path: Any) -> None:
    assert len(_blocks()) == 4
    run_distributed(_examples_body, 2, os.path.join(str(tmp_path), "ckpt.pt"))
