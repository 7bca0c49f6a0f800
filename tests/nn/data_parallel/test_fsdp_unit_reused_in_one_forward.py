# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""An FSDP unit called twice in one forward (a shared block, ``blk(blk(x))``) under one backward.

Its gradient arrives in pieces, one per use, with ``optimize_backward_concat`` (one views node per forward) and in
mixed precision (one gradient accumulator per gather). Reducing at the first piece reduce-scattered each use's part on
its own, and the next use gathered the parameters again, over the whole group even with ``zero2_process_group``: two
all-gathers and two reduce-scatters where the flag-off fp32 path makes one of each, and gradients that were no longer
bitwise equal with the flag on and off. The reduction now waits for the end of backward and runs once.
"""

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import zero2_groups


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 7)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Twice(nn.Module):
    def __init__(self, kwargs: Dict[str, Any]) -> None:
        super().__init__()
        self.head = nn.Linear(7, 7)
        self.blk = FSDP(_Block(), **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.blk(self.blk(self.head(x)))


def _backward(kwargs: Dict[str, Any], rank: int, no_sync_first: bool) -> Tuple[List[Tuple[str, int]], List[Tensor]]:
    """One step's backward collectives (kind, group size) and the gradients after it."""
    torch.manual_seed(0)
    kwargs = dict(kwargs, bucket_cap_mb=0)  # one reduce-scatter per reduction, so that they can be counted
    model = FSDP(_Twice(kwargs), **kwargs)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    if no_sync_first:
        with model.no_sync():
            model(x).pow(2).sum().backward()
    loss = model(x * 2).float().pow(2).sum()
    with count_collectives() as counter:
        loss.backward()
    kinds = [(r.kind, r.group_size) for r in counter.records if r.kind in ("all_gather", "reduce_scatter")]
    return kinds, [p.grad.clone() for p in model.parameters()]


def _flag_on_equals_flag_off(rank: int, world_size: int, extra: Dict[str, Any], no_sync_first: bool) -> None:
    on = _backward(dict(extra, optimize_backward_concat=True), rank, no_sync_first)
    off = _backward(dict(extra, optimize_backward_concat=False), rank, no_sync_first)
    assert on[0] == off[0], (on[0], off[0])
    # The shared unit: one all-gather (its second use finds the parameters still gathered) and one reduce-scatter.
    assert on[0].count(("all_gather", world_size)) == 1, on[0]
    assert on[0].count(("reduce_scatter", world_size)) == 2, on[0]  # the shared unit and the root
    assert all(torch.equal(a, b) for a, b in zip(on[1], off[1])), "gradients differ with the flag on and off"


def _zero2_gathers_stay_in_the_group(rank: int, world_size: int, flag: bool) -> None:
    kwargs = dict(
        mixed_precision=True,
        compute_dtype=torch.bfloat16,
        zero2_process_group=zero2_groups(2),
        optimize_backward_concat=flag,
    )
    kinds, _ = _backward(kwargs, rank, False)
    gathers = [size for kind, size in kinds if kind == "all_gather"]
    assert gathers and all(size == 2 for size in gathers), kinds  # never over the whole group of 4
    assert [k for k in kinds if k[0] == "reduce_scatter"].count(("reduce_scatter", 4)) == 2, kinds


def _world2_body(rank: int, world_size: int) -> None:
    bf16 = dict(mixed_precision=True, compute_dtype=torch.bfloat16)
    run_cases(
        [
            ("fp32", lambda: _flag_on_equals_flag_off(rank, world_size, {}, False)),
            ("fp32 after a no_sync microbatch", lambda: _flag_on_equals_flag_off(rank, world_size, {}, True)),
            ("bf16", lambda: _flag_on_equals_flag_off(rank, world_size, bf16, False)),
            (
                "bf16, fp32_reduce_scatter",
                lambda: _flag_on_equals_flag_off(rank, world_size, dict(bf16, fp32_reduce_scatter=True), False),
            ),
        ]
    )


def test_a_unit_used_twice_reduces_once_and_bitwise_equal_with_the_flag() -> None:
    run_distributed(_world2_body, 2)


def _world4_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("zero2, bf16", lambda: _zero2_gathers_stay_in_the_group(rank, world_size, False)),
            ("zero2, bf16, optimize_backward_concat", lambda: _zero2_gathers_stay_in_the_group(rank, world_size, True)),
        ]
    )


def test_a_unit_used_twice_gathers_over_the_zero2_group_only() -> None:
    run_distributed(_world4_body, 4)


class _Blocks(nn.Module):
    """Three instances in a row, each used once per forward; optionally each run under torch's non-reentrant
    checkpoint (recomputed inside backward)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList([FSDP(_Block(), bucket_cap_mb=0) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _recomputation_is_not_a_second_use(rank: int, world_size: int) -> None:
    # A recomputation inside backward redoes the use of the forward: counted as a second use, every checkpointed
    # instance kept its full parameters to the end of backward (all gathers first, all reductions last).
    torch.manual_seed(0)
    model = FSDP(_Blocks(checkpointed=True), bucket_cap_mb=0)
    loss = model(torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))).sum()
    with count_collectives() as counter:
        loss.backward()
    kinds = [r.kind for r in counter.records if r.kind in ("all_gather", "reduce_scatter")]
    assert kinds == ["all_gather", "reduce_scatter"] * 3, kinds  # each instance reduced right after its backward


def test_a_recomputed_instance_is_reduced_at_its_own_backward() -> None:
    run_distributed(_recomputation_is_not_a_second_use, 2)


def _step_after_a_dropped_forward(rank: int, dropped: str) -> Tuple[List[str], List[Tensor]]:
    torch.manual_seed(0)
    model = FSDP(_Blocks(checkpointed=False), bucket_cap_mb=0)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    kept = None
    if dropped == "dropped":
        float(model(x + 1).sum())  # a grad-mode evaluation pass: its graph is freed right away
    elif dropped == "kept":
        kept = model(x + 1).sum()  # its backward may still come: a second use
    loss = model(x).sum()
    with count_collectives() as counter:
        loss.backward()
    del kept
    kinds = [r.kind for r in counter.records if r.kind in ("all_gather", "reduce_scatter")]
    return kinds, [p.grad.clone() for p in model.parameters()]


def _a_dropped_forward_is_not_a_use(rank: int, world_size: int) -> None:
    # Counted as a use, a grad-mode forward that never got its backward made every instance of the next backward
    # keep its full parameters and gradient to the end of backward (all gathers first, all reductions last).
    kinds, grads = _step_after_a_dropped_forward(rank, "dropped")
    reference_kinds, reference_grads = _step_after_a_dropped_forward(rank, "none")
    assert kinds == reference_kinds == ["all_gather", "reduce_scatter"] * 3, (kinds, reference_kinds)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))
    # A forward whose output is still referenced may still get its backward: the reductions wait, as documented.
    kinds, grads = _step_after_a_dropped_forward(rank, "kept")
    assert kinds == ["all_gather"] * 3 + ["reduce_scatter"] * 3, kinds
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))


def test_a_dropped_grad_mode_forward_does_not_delay_the_next_reductions() -> None:
    run_distributed(_a_dropped_forward_is_not_a_use, 2)
