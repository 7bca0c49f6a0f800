# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gradient accumulation with and without ``no_sync()`` (and mixed), and the communication of each iteration."""

import contextlib
import itertools
import math
from typing import Any, Dict, List, Sequence

import pytest
import torch
from _models import (
    MIXED,
    NestedWrappedModule,
    assert_close_dict,
    assert_idle,
    build,
    gather_full_grads,
    global_batch,
    local_slice,
    make_optim,
    scaled_loss,
    wrap_model,
)
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

# Per microbatch: True = run forward and backward inside root.no_sync().
SCHEDULES = {
    "no_sync": (True, True, False),
    "sync_every_micro": (False, False, False),
    "mixed": (False, True, False),
    "mixed2": (True, False, True, False),
}


def _accumulate_and_compare(
    rank: int, ws: int, fsdp_kwargs: Dict[str, Any], mode: str, schedule: Sequence[bool], windows: int = 2
) -> None:
    """Each window: len(schedule) microbatches accumulated, compared with the big-batch reference, then a step."""
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, fsdp_kwargs, mode)
    opt, ref_opt = make_optim(fsdp.parameters(), "sgd"), make_optim(ref.parameters(), "sgd")
    micro_n = 2 * ws
    total_n = micro_n * len(schedule)
    low_precision = fsdp_kwargs.get("mixed_precision", False)
    tol = dict(rtol=2e-2, atol=2e-3) if low_precision else dict(rtol=1e-5, atol=1e-6)
    for window in range(windows):
        opt.zero_grad()
        ref_opt.zero_grad()
        micros = [global_batch(ref, 10 * window + i, micro_n) for i in range(len(schedule))]
        for batch, skip_sync in zip(micros, schedule):
            ctx = fsdp.no_sync() if skip_sync else contextlib.nullcontext()
            with ctx:
                scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), total_n, ws).backward()
            if skip_sync:
                # Unreduced: full-size gradients (compute dtype) stay on the parameters.
                for p in fsdp.params:
                    assert p.grad is not None and p.grad.shape == p._orig_size  # type: ignore[attr-defined]
        assert_idle(fsdp)
        for p in fsdp.parameters():
            assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
        big = tuple(torch.cat(parts) for parts in zip(*micros))
        scaled_loss(NestedWrappedModule, ref(*big), total_n, 1).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert_close_dict(gather_full_grads(fsdp), expected, f"window {window} grad", **tol)
        opt.step()
        ref_opt.step()


def _cases(rank: int, ws: int, precisions: Sequence[str]) -> List[Any]:
    cases = []
    for name, schedule in SCHEDULES.items():
        for reshard, flatten, mode, mp in itertools.product(
            (True, False), (True, False), ("one", "nested"), precisions
        ):
            if mp != "fp32" and mode == "one":
                continue  # low precision: the nested tree is the harder case; keeps the world fast
            kwargs = dict(reshard_after_forward=reshard, flatten_parameters=flatten, **MIXED[mp])

            def case(kwargs: Dict[str, Any] = kwargs, mode: str = mode, schedule: Sequence[bool] = schedule) -> None:
                _accumulate_and_compare(rank, ws, kwargs, mode, schedule)

            cases.append((f"{name},reshard={reshard},flatten={flatten},{mode},{mp}", case))
    return cases


def _accumulation_equals_big_batch_body(rank: int, ws: int, precisions: Sequence[str]) -> None:
    run_cases(_cases(rank, ws, precisions))


@pytest.mark.parametrize("world_size,precisions", [(2, ("fp32", "fp16")), (1, ("fp32", "fp16", "bf16"))])
def test_accumulation_equals_big_batch(world_size: int, precisions: Sequence[str]) -> None:
    """World size 1 includes upstream's crash (mixed precision + no_sync at world size 1), fixed in this fork."""

    run_distributed(_accumulation_equals_big_batch_body, world_size, precisions, timeout=240)


def _no_sync_before_the_first_forward_and_flag_restore_body(rank: int, ws: int) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    batch = global_batch(ref, 0, 2 * ws)
    with fsdp.no_sync():  # lazy init happens here
        scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    assert all(m._require_backward_grad_sync for m in fsdp.modules() if isinstance(m, FSDP))
    with pytest.raises(ZeroDivisionError):
        with fsdp.no_sync():
            raise ZeroDivisionError()
    assert all(m._require_backward_grad_sync for m in fsdp.modules() if isinstance(m, FSDP))
    scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    scaled_loss(NestedWrappedModule, ref(*batch), 2 * ws, 1).mul(2).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    assert_close_dict(gather_full_grads(fsdp), expected, "grad", rtol=1e-5, atol=1e-6)


def test_no_sync_before_the_first_forward_and_flag_restore() -> None:
    run_distributed(_no_sync_before_the_first_forward_and_flag_restore_body, 2)


# ------------------------------------------------------------------------------------------------------ counts

# Owned numel per instance in "nested" mode (root, block 1, block 2) and per parameter when not flattened.
INSTANCE_NUMELS = {"root": [40, 18], "block1": [54, 50], "block2": [30]}


def _padded(numel: int, ws: int) -> int:
    return math.ceil(numel / ws) * ws


def _expected_bytes(ws: int, flatten: bool, instances: Sequence[str], element_size: int) -> int:
    if flatten:
        return sum(_padded(sum(INSTANCE_NUMELS[i]), ws) for i in instances) * element_size
    # Non-flat: every weight and bias is gathered/reduced on its own (numels of weight, bias).
    split = {"root": [35, 5, 15, 3], "block1": [45, 9, 45, 5], "block2": [25, 5]}
    return sum(_padded(n, ws) for i in instances for n in split[i]) * element_size


def _handles(flatten: bool, instances: Sequence[str]) -> int:
    per_instance = {"root": 4, "block1": 4, "block2": 2}
    return len(instances) if flatten else sum(per_instance[i] for i in instances)


def _check_iteration(
    counter: Any, ws: int, flatten: bool, fwd: Sequence[str], bwd: Sequence[str], rs: bool, first: bool = False
) -> None:
    every = ["root", "block1", "block2"]
    got = counter.summary()
    # The first forward also compares the FSDP instances across ranks, once (a mismatch would hang otherwise).
    assert counter.count("all_gather_object", phase="init") == (1 if first else 0), got
    assert all(r.group_size == ws for r in counter.records), got
    assert counter.count("all_gather", phase="forward") == _handles(flatten, fwd), got
    assert counter.count("all_gather", phase="backward") == _handles(flatten, bwd), got
    assert counter.total_bytes("all_gather", phase="forward") == _expected_bytes(ws, flatten, fwd, 4), got
    assert counter.total_bytes("all_gather", phase="backward") == _expected_bytes(ws, flatten, bwd, 4), got
    assert counter.count("reduce_scatter") == (_handles(flatten, every) if rs else 0), got
    assert counter.total_bytes("reduce_scatter") == (_expected_bytes(ws, flatten, every, 4) if rs else 0), got
    assert counter.count() == counter.count("all_gather") + counter.count("reduce_scatter") + int(first), got


def _count_case(rank: int, ws: int, reshard: bool, flatten: bool) -> None:
    torch.manual_seed(0)
    kwargs = dict(reshard_after_forward=reshard, flatten_parameters=flatten, bucket_cap_mb=0)
    fsdp = wrap_model(NestedWrappedModule(), kwargs, "nested")
    x = torch.randn(2, 7)
    every, inner = ["root", "block1", "block2"], ["block1", "block2"]

    def iteration(no_sync: bool) -> Any:
        with count_collectives() as counter:
            with fsdp.no_sync() if no_sync else contextlib.nullcontext():
                fsdp(x).sum().backward()
        return counter

    # Upstream's numbers (spec 1.12). The root never reshards after forward, so it is not gathered in backward.
    if reshard:
        _check_iteration(iteration(False), ws, flatten, every, inner, rs=True, first=True)
        _check_iteration(iteration(True), ws, flatten, every, inner, rs=False)
        # After no_sync the root still holds its full parameters: no gather for it in the next forward.
        _check_iteration(iteration(False), ws, flatten, inner, inner, rs=True)
        _check_iteration(iteration(False), ws, flatten, every, inner, rs=True)
    else:
        _check_iteration(iteration(False), ws, flatten, every, [], rs=True, first=True)
        _check_iteration(iteration(True), ws, flatten, every, [], rs=False)
        _check_iteration(iteration(False), ws, flatten, [], [], rs=True)
        _check_iteration(iteration(False), ws, flatten, every, [], rs=True)
    assert_idle(fsdp)


def _communication_per_iteration_body(rank: int, ws: int) -> None:
    run_cases(
        (f"reshard={r},flatten={f}", lambda r=r, f=f: _count_case(rank, ws, r, f))
        for r, f in itertools.product((True, False), (True, False))
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_communication_per_iteration(world_size: int) -> None:
    run_distributed(_communication_per_iteration_body, world_size)


def _communication_dtypes_and_bytes_under_mixed_precision_body(rank: int, ws: int) -> None:
    def run(**kwargs: Any) -> Any:
        torch.manual_seed(0)
        fsdp = wrap_model(NestedWrappedModule(), dict(bucket_cap_mb=0, **kwargs), "nested")
        with count_collectives() as counter:
            fsdp(torch.randn(2, 7)).sum().backward()
        return counter

    every = ["root", "block1", "block2"]
    for kwargs, gather_dtype, reduce_dtype in [
        (MIXED["fp16"], torch.float16, torch.float16),
        (MIXED["bf16"], torch.bfloat16, torch.bfloat16),
        (dict(mixed_precision=True, fp32_reduce_scatter=True), torch.float16, torch.float32),
        ({}, torch.float32, torch.float32),
    ]:
        counter = run(**kwargs)
        gathers = [r for r in counter.records if r.kind == "all_gather"]
        reductions = [r for r in counter.records if r.kind == "reduce_scatter"]
        assert {r.dtype for r in gathers} == {gather_dtype}, counter.records
        assert {r.dtype for r in reductions} == {reduce_dtype}, counter.records
        rs_size = torch.empty(0, dtype=reduce_dtype).element_size()
        assert sum(r.bytes for r in reductions) == _expected_bytes(ws, True, every, rs_size)
        fwd_size = torch.empty(0, dtype=gather_dtype).element_size()
        assert counter.total_bytes("all_gather", "forward") == _expected_bytes(ws, True, every, fwd_size)


def test_communication_dtypes_and_bytes_under_mixed_precision() -> None:
    run_distributed(_communication_dtypes_and_bytes_under_mixed_precision_body, 3)


def _leaf_instances_without_grad_do_not_reduce_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].requires_grad_(False)
    model[1] = FSDP(model[1], bucket_cap_mb=0)
    fsdp = FSDP(model, bucket_cap_mb=0)
    with count_collectives() as counter:
        fsdp(torch.randn(2, 3)).sum().backward()
    assert counter.count("reduce_scatter") == 1, counter.summary()
    assert counter.count("all_gather", "forward") == 2, counter.summary()
    assert_idle(fsdp)


def test_leaf_instances_without_grad_do_not_reduce() -> None:
    """A frozen instance takes part in gathers but never in reduce-scatters."""

    run_distributed(_leaf_instances_without_grad_do_not_reduce_body, 2)
