# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Several forwards first, then their backwards, all but the last inside ``no_sync()`` (pipeline-style schedules)."""

import itertools
from typing import Any, Dict

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

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives

MICRO = 3


def _fwd_fwd_bwd_bwd(rank: int, ws: int, kwargs: Dict[str, Any], mode: str) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(kwargs, bucket_cap_mb=0), mode)
    opt, ref_opt = make_optim(fsdp.parameters(), "sgd"), make_optim(ref.parameters(), "sgd")
    n = 2 * ws
    tol = dict(rtol=2e-2, atol=2e-3) if kwargs.get("mixed_precision") else dict(rtol=1e-5, atol=1e-6)
    for step in range(2):
        micros = [global_batch(ref, 10 * step + i, n) for i in range(MICRO)]
        losses = [scaled_loss(NestedWrappedModule, fsdp(*local_slice(b, rank, ws)), n * MICRO, ws) for b in micros]
        assert_idle(fsdp, after_forward=True)
        with count_collectives() as counter:
            with fsdp.no_sync():
                for loss in losses[:-1]:
                    loss.backward()
            assert counter.count("reduce_scatter") == 0, counter.summary()
            losses[-1].backward()
        instances = len([m for m in fsdp.modules() if hasattr(m, "_handles") and m.params])
        handles = sum(len(m.params) for m in fsdp.modules() if hasattr(m, "_handles"))
        assert counter.count("reduce_scatter") == handles, (instances, counter.summary())
        assert_idle(fsdp)
        big = tuple(torch.cat(parts) for parts in zip(*micros))
        ref_opt.zero_grad()
        scaled_loss(NestedWrappedModule, ref(*big), n * MICRO, 1).backward()
        assert_close_dict(gather_full_grads(fsdp), {k: p.grad for k, p in ref.named_parameters()}, "grad", **tol)
        opt.step()
        ref_opt.step()
        opt.zero_grad()


def _forwards_then_backwards_body(rank: int, ws: int) -> None:
    run_cases(
        (
            f"reshard={r},{mp},flatten={f},{mode}",
            lambda k=dict(reshard_after_forward=r, flatten_parameters=f, **MIXED[mp]), m=mode: _fwd_fwd_bwd_bwd(
                rank, ws, k, m
            ),
        )
        for r, mp, f, mode in itertools.product((True, False), ("fp32", "fp16"), (True, False), ("one", "nested"))
    )


def test_forwards_then_backwards() -> None:
    run_distributed(_forwards_then_backwards_body, 2)
