# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of ``docs/pipe.rst`` run as written and do what the text says (registered as "script" blocks in
``tests/test_docs_examples.py``)."""

import os
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from fairscale.fair_dev.testing.engine import run_distributed

from ._util import run_scripts

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


# The AsyncPipe example as a real 2-rank script that simply ends: no barrier, no flush, no destroy_process_group.
_SCRIPT = """
import sys

import torch.distributed as dist

rank, store, code_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
exec(compile(open(code_path).read(), "docs/pipe.rst", "exec"), {"__name__": "__main__"})
print(f"rank {rank}: end of script", flush=True)
"""

# Seconds both worlds together may take (four interpreters import torch at once); a hang is killed then.
_EXIT_TIMEOUT_S = 90.0


def _eval_variant(code: str) -> str:
    """The example with ``pipe.eval()`` right after the construction: no gradient crosses the stages then."""
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("pipe = AsyncPipe("))
    return "\n".join(lines[: at + 1] + ["pipe.eval()"] + lines[at + 1 :])


def test_async_pipe_example_script_exits(tmp_path) -> None:
    """Run as a script that just ends, every rank of the example exits with 0, in train and in eval mode.

    Before, the sends still queued on the sender thread at the end of the script were lost: in training the first
    stage waited forever for the gradients, in eval the first stage died with SIGABRT ("terminate called without an
    active exception") and the last stage waited forever for the activations.
    """
    code = _blocks()[2]
    worlds = {}
    for mode, variant in (("train", code), ("eval", _eval_variant(code))):
        code_path = tmp_path / f"{mode}.py"
        code_path.write_text(variant)
        worlds[mode] = [str(code_path)]
    results = run_scripts(_SCRIPT, worlds, str(tmp_path), _EXIT_TIMEOUT_S)
    failed = {key: result for key, result in results.items() if result[0] != 0}
    assert not failed, "\n".join(f"{mode} rank {rank}: {rc}\n{out}" for (mode, rank), (rc, out) in failed.items())
