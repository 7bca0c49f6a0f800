# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The examples of ``docs/model_parallel.rst`` run as written on two gloo ranks and do what the text says.

The only edit is ``dist.init_process_group(`` (the test rank's group exists already). Registered as "script"
blocks in ``tests/test_docs_examples.py``.
"""

import os
from typing import Any, Dict, List

import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
import torch.nn.functional as F

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.nn.model_parallel import initialize as mpu

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    "docs",
    "model_parallel.rst",
)


def _blocks() -> List[str]:
    from test_docs_examples import rst_blocks  # tests/ is on sys.path (rootdir conftest)

    return [code for _, code in rst_blocks(DOC)]


def _init_process_group(backend: str, *args: Any, **kwargs: Any) -> None:
    assert dist.is_initialized() and backend in ("gloo", "nccl")


def _run(code: str) -> Dict[str, Any]:
    assert "dist.init_process_group(" in code
    namespace: Dict[str, Any] = {"_init_process_group": _init_process_group, "__name__": "doc_example"}
    exec(compile(code.replace("dist.init_process_group(", "_init_process_group("), DOC, "exec"), namespace)
    return namespace


def _tensor_parallel_example() -> None:
    ns = _run(_blocks()[0])
    try:
        assert mpu.get_model_parallel_world_size() == 2
        losses = collectives.all_gather_object(ns["loss"].item())
        assert losses[0] == losses[1]  # the full loss on both shards
        model = ns["model"]
        model.eval()
        x = ns["x"]
        logits = torch.cat(collectives.all_gather_object(model(x).detach()), dim=-1)
        # The dense model from both ranks' slices (after the step) gives the same logits.
        shards = collectives.all_gather_object({k: v.clone() for k, v in model.state_dict().items()})
        w = {k: torch.cat([s[k] for s in shards], dim=1 if k == "down.weight" else 0) for k in shards[0]}
        w["down.bias"] = shards[0]["down.bias"]
        dense = F.linear(F.gelu(F.linear(x, w["up.weight"], w["up.bias"])), w["down.weight"], w["down.bias"])
        dense = F.linear(dense, w["head.weight"], w["head.bias"])
        assert torch.allclose(logits, dense, atol=1e-5), (logits - dense).abs().max()
    finally:
        mpu.destroy_model_parallel()


def _moe_example() -> None:
    ns = _run(_blocks()[1])
    assert ns["out"].shape == ns["x"].shape
    assert all(p.expert and p.grad is not None for p in ns["expert"].parameters())


def _fsdp_moe_example() -> None:
    ns = _run(_blocks()[2])
    assert ns["expert"].no_broadcast_optim_state
    if dist.get_rank() == 0:
        assert len(ns["full_state"]["uncollected_local_ids"]) == 1
    else:
        assert ns["full_state"] is None


def _docs_body(rank: int, world_size: int) -> None:
    assert len(_blocks()) == 3
    run_cases(
        [
            ("tensor_parallel", _tensor_parallel_example),
            ("moe", _moe_example),
            ("fsdp_moe", _fsdp_moe_example),
        ]
    )


def test_model_parallel_docs_examples() -> None:
    run_distributed(_docs_body, 2)
