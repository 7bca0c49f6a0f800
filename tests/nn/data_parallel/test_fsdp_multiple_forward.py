# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A wrapped module called several times in one forward, and several root forwards before one backward."""

import contextlib
import itertools
from typing import Any, Dict, Tuple

import torch
from _models import MIXED, assert_close_dict, assert_idle, gather_full_grads, train_and_compare
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import zero2_groups


class SharedBlockTwice(nn.Module):
    """``block`` is applied twice per forward (weight reuse, as in recurrent or ALBERT-style models)."""

    NESTED = ("block",)
    LEAF = ("inp", "block", "out")
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.block(self.block(self.inp(x))))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 4, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _module_called_twice_per_forward_body(rank: int, ws: int) -> None:
    cases = []
    for reshard, mp, flatten, mode in itertools.product(
        (True, False), ("fp32", "fp16"), (True, False), ("one", "nested", "leaf")
    ):
        kwargs: Dict[str, Any] = dict(reshard_after_forward=reshard, flatten_parameters=flatten, **MIXED[mp])
        cases.append(
            (
                f"reshard={reshard},{mp},flatten={flatten},{mode}",
                lambda k=kwargs, m=mode: train_and_compare(rank, ws, SharedBlockTwice, k, m),
            )
        )
    run_cases(cases)


def test_module_called_twice_per_forward() -> None:
    run_distributed(_module_called_twice_per_forward_body, 2)


def _several_root_forwards_before_one_backward_body(rank: int, ws: int) -> None:
    for reshard in (True, False):
        torch.manual_seed(0)
        model, ref = SharedBlockTwice(), SharedBlockTwice()
        ref.load_state_dict(model.state_dict())
        model.block = FSDP(model.block, reshard_after_forward=reshard, bucket_cap_mb=0)
        fsdp = FSDP(model, bucket_cap_mb=0)
        xs = [torch.randn(2, 4) for _ in range(3)]
        with count_collectives() as counter:
            loss = sum(fsdp(x).sum() for x in xs)
            assert_idle(fsdp, after_forward=True)
            loss.backward()
        assert_idle(fsdp)
        # Gradients are reduced once per parameter, however many forwards fed the backward.
        assert counter.count("reduce_scatter") == 2, counter.summary()
        sum(ref(x).sum() for x in xs).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert_close_dict(gather_full_grads(fsdp), expected, f"reshard={reshard} grad", rtol=1e-5, atol=1e-6)


def test_several_root_forwards_before_one_backward() -> None:
    run_distributed(_several_root_forwards_before_one_backward_body, 2)


def _forwards_before_their_backwards_body(rank: int, ws: int) -> None:
    """fwd, fwd, fwd, bwd, bwd, bwd of a model whose block is used twice per forward (micro-batches whose losses are
    kept, or a siamese pass backed up one loss at a time), with and without a zero2 group: the end of the first
    backward forgot the later forwards, and the next backwards reduce-scattered the block once per use (bf16)."""
    zero2 = zero2_groups(1)
    for use_zero2, sync, mp in itertools.product((False, True), (True, False), ("fp32", "bf16")):
        torch.manual_seed(0)
        model, ref = SharedBlockTwice(), SharedBlockTwice()
        ref.load_state_dict(model.state_dict())
        kwargs: Dict[str, Any] = dict(zero2_process_group=zero2 if use_zero2 else None, bucket_cap_mb=0, **MIXED[mp])
        # bf16: the block's gradient arrives in one piece per use (see FSDPUnit.grad_forward_tokens).
        model.block = FSDP(model.block, **kwargs)
        fsdp = FSDP(model, **kwargs)
        xs = [torch.randn(2, 4) for _ in range(4)]
        context = contextlib.nullcontext() if sync else fsdp.no_sync()
        with context:
            losses = [fsdp(x).sum() for x in xs[:3]]
            for loss in losses:
                with count_collectives() as counter:
                    loss.backward()
                # Each backward reduces each flat parameter once (the block's two uses together), or not at all.
                assert counter.count("reduce_scatter") == (2 if sync else 0), counter.summary()
        fsdp(xs[3]).sum().backward()
        assert_idle(fsdp)
        sum(ref(x).sum() for x in xs).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        what = f"zero2={use_zero2},sync={sync},{mp} grad"
        tol = dict(rtol=1e-5, atol=1e-6) if mp == "fp32" else dict(rtol=2e-2, atol=2e-2)
        assert_close_dict(gather_full_grads(fsdp), expected, what, **tol)


def test_forwards_before_their_backwards() -> None:
    run_distributed(_forwards_before_their_backwards_body, 2)


def _build_shared_block(**kwargs: Any) -> Tuple[FSDP, SharedBlockTwice]:
    torch.manual_seed(0)
    model, ref = SharedBlockTwice(), SharedBlockTwice()
    ref.load_state_dict(model.state_dict())
    model.block = FSDP(model.block, bucket_cap_mb=0, **kwargs)
    return FSDP(model, bucket_cap_mb=0, **kwargs), ref


def _abandoned_forward_slice_body(rank: int, ws: int) -> None:
    """An abandoned forward (no backward) keeps its zero2 slices; after the optimizer step, the next forward's
    prefetch gathered a stale slice (then the unit's own forward threw it away and gathered again)."""
    fsdp, _ = _build_shared_block(zero2_process_group=zero2_groups(1), forward_prefetch=True)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    fsdp(x).sum().backward()  # gradients for the step, and the order the next forwards prefetch by
    fsdp(x + 1)  # abandoned
    opt.step()
    with count_collectives() as counter:
        fsdp(x)
    # The root and the block from their shards; the block's second use from the slice its first use kept.
    assert [r.group_size for r in counter.records if r.kind == "all_gather"] == [ws, ws, 1], counter.summary()


def test_abandoned_forward_keeps_no_stale_slice_for_prefetch() -> None:
    run_distributed(_abandoned_forward_slice_body, 2)


class DataSGD(torch.optim.Optimizer):
    """SGD that writes through ``p.data``, as older optimizers do: no version counter moves."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _kept_output_and_data_step_body(rank: int, ws: int) -> None:
    """A grad-mode output kept without a backward (logging) and a step through ``p.data``, which moves no version
    counter: the next forward computes with the new weights (a guard: keeping full parameters or zero2 slices for a
    waiting forward over the step, tried in session 46, computed with the old ones)."""
    for kwargs in (dict(reshard_after_forward=False), dict(zero2_process_group=zero2_groups(1))):
        fsdp, ref = _build_shared_block(**kwargs)
        opt, ref_opt = DataSGD(fsdp.parameters(), lr=0.5), DataSGD(ref.parameters(), lr=0.5)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))  # the same batch on every rank
        for step in range(3):
            kept = fsdp(x + 1)  # noqa: F841  # held, never backed up
            out = fsdp(x)
            torch.testing.assert_close(out, ref(x), msg=lambda m: f"{kwargs} step {step}: {m}")
            out.sum().backward()
            ref(x).sum().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()


def test_kept_output_and_a_step_through_data() -> None:
    run_distributed(_kept_output_and_data_step_body, 2)
