# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel is freed by reference counting, not left to the cycle collector.

The root used to sit in a reference cycle (root -> its unit -> the tree state -> the root's bound
``_finalize_backward`` -> root), so a dropped model, with its flat parameters, buckets and process groups, waited for
the cycle collector; at interpreter exit that runs after ``destroy_process_group()``. These tests drop a trained model
and its optimizer with the collector off and check weak references to them.
"""

from typing import Any, Dict, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not inside a rank
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.fair_dev.testing.testing_memory import alive_without_cycle_collector
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

TIMEOUT = 60.0


def _model(nested: bool, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(4, 8), FSDP(inner, **kwargs) if nested else inner, nn.ReLU(), nn.Linear(8, 2))


def _train(rank: int, nested: bool, accumulate: bool, obc: bool) -> Dict[str, Any]:
    """A few steps of FSDP + SGD; returns the objects to drop (the caller's only references)."""
    kwargs = {"optimize_backward_concat": obc}
    model = FSDP(_model(nested, **kwargs), **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        batch = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        if accumulate:
            with model.no_sync():
                model(batch).sum().backward()
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()
    return {"root": model, "unit": model._fsdp_unit, "tree": model._fsdp_unit.tree, "optimizer": optim}


def _freed_body(rank: int, world_size: int, nested: bool, mode: str) -> List[str]:
    return alive_without_cycle_collector(_train(rank, nested, mode != "step", mode == "no_sync obc"))


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("mode", ["step", "no_sync", "no_sync obc"])
def test_dropped_fsdp_model_is_freed_without_the_cycle_collector(nested: bool, mode: str) -> None:
    alive = run_distributed(_freed_body, 2, nested, mode, timeout=TIMEOUT)
    assert alive == [[], []], f"still alive after del with gc disabled (rank 0, rank 1): {alive}"


def _wrapped_finalizer_body(rank: int, world_size: int) -> int:
    """A finalizer replaced on the instance before the first forward (a plain function) still runs every backward."""
    model = FSDP(_model(False))
    original = model._finalize_backward
    calls = []

    def counted() -> None:
        calls.append(1)
        original()

    model._finalize_backward = counted  # type: ignore[method-assign]
    for step in range(2):
        model(torch.randn(3, 4)).sum().backward()
    return len(calls)


def test_a_finalizer_replaced_before_the_first_forward_runs_every_backward() -> None:
    assert run_distributed(_wrapped_finalizer_body, 2, timeout=TIMEOUT) == [2, 2]


class _Boom(RuntimeError):
    pass


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise _Boom("backward aborted on purpose")


def _hook_output_to_raise(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.register_hook(_raise_in_backward)


def _aborted_body(rank: int, world_size: int) -> List[str]:
    """A backward that raised after the inner unit handed its gradient to the bucketer (queued in a fill, or sent and
    still pending on CPU): the dropped model is freed at once, not when the next forward would have discarded what
    the bucketer holds (its callbacks point back at the unit)."""
    model = FSDP(_model(True))
    inner = model.module.module[1]  # type: ignore[index]
    model.module.module[0].register_forward_hook(_hook_output_to_raise)  # type: ignore[index]
    out = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).sum()
    held = []
    try:
        out.backward()
    except _Boom:
        assert model._tree is not None
        buckets = model._tree.bucketer.buckets.values()
        held.append(model._tree.bucketer.pending or any(b.callbacks for b in buckets))
        del buckets
    del out
    assert held == [True], "the error must strike while the bucketer holds the inner unit's reduction"
    objects = {"root": model, "inner": inner, "inner_unit": inner._fsdp_unit, "tree": model._fsdp_unit.tree}
    del model, inner  # the dict holds the only references
    return alive_without_cycle_collector(objects)


def test_model_dropped_after_an_aborted_backward_is_freed_without_the_cycle_collector() -> None:
    alive = run_distributed(_aborted_body, 2, timeout=TIMEOUT)
    assert alive == [[], []], f"still alive after del with gc disabled (rank 0, rank 1): {alive}"
