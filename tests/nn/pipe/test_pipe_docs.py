# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of ``docs/pipe.rst`` run as written and do what the text says (registered as "script" blocks in
``tests/test_docs_examples.py``)."""

import os
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from fairscale.fair_dev.testing.engine import run_distributed

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "docs", "pipe.rst"
)


def _blocks() -> List[str]:
    """The page's code blocks (all python), dedented."""
    from test_docs_examples import rst_blocks  # tests/ is on sys.path (rootdir conftest)

    return [code for _, code in rst_blocks(DOC)]


def _run(code: str) -> Dict[str, Any]:
    namespace: Dict[str, Any] = {"__name__": "doc_example"}
    exec(compile(code, DOC, "exec"), namespace)
    return namespace


def test_three_examples() -> None:
    assert len(_blocks()) == 3


def test_pipe_example() -> None:
    ns = _run(_blocks()[0])
    pipe, x, out = ns["pipe"], ns["x"], ns["out"]
    # "equals model(x)": the partitions hold the model's layers.
    reference = torch.nn.Sequential(*pipe)
    assert torch.allclose(out, reference(x), atol=1e-6)
    assert all(p.grad is not None for p in pipe.parameters())


def test_skip_example() -> None:
    ns = _run(_blocks()[1])
    x, out = ns["x"], ns["out"]
    assert torch.allclose(out, F.relu(2 * x) + x)
    assert len(ns["pipe"].partitions) == 2


def _async_example(rank: int, world_size: int, code: str) -> bool:
    ns = _run(code)
    pipe = ns["pipe"]
    if pipe.final_stage:
        torch.manual_seed(0)
        reference = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        )
        assert torch.allclose(ns["out"], reference(ns["x"]), atol=1e-5)
    return all(p.grad is not None for p in pipe.parameters())


def test_async_pipe_example() -> None:
    assert run_distributed(_async_example, 2, _blocks()[2], timeout=60) == [True, True]
