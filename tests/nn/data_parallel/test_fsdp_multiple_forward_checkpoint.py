# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Several forwards per step with activation checkpointing and batch norm (upstream topic of the same name).

One residual conv block (with ``BatchNorm2d``) is applied three times per model forward, and the model runs twice
(two micro-inputs) before a single backward. The block is plain FSDP, ``FSDP(checkpoint_wrapper(block))`` or
``checkpoint_wrapper(FSDP(block))``, with or without ``auto_wrap_bn``, in fp32 and bf16. Everything is compared with
a single-process reference: loss per step, parameters after the steps, and the batch-norm running statistics (which
must be updated once per block call, never in the no-grad checkpointing pass).

Batch norm uses ``momentum=None`` (cumulative average), so the expected statistics do not depend on the order in
which backward recomputes the calls: they are the plain average of every call's batch statistics.
"""

import copy
from typing import Any, Dict, List, Tuple

import torch
from _models import (
    assert_close_dict,
    assert_idle,
    assert_update_close,
    full_params,
    local_slice,
    mean_over_ranks,
    ref_params,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.checkpoint import checkpoint_wrapper, is_recomputing
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel._fsdp.batchnorm_wrap import auto_wrap_bn

WS = 2
TIMEOUT = 150.0
LOCAL_BATCH = 3
REPEATS = 3  # block calls per model forward
FORWARDS = 2  # model forwards per backward
STEPS = 2
# bf16 vs the fp32 reference: parameter error relative to the reference's update (a lost or doubled gradient gives
# about 1; bf16 rounding through three batch norms about 0.1).
BF16_PARAM_REL = 0.25
ORDERS = ("fsdp(block)", "fsdp(ckpt(block))", "ckpt(fsdp(block))")
PRECISIONS: Dict[str, Dict[str, Any]] = {"fp32": {}, "bf16": {"mixed_precision": True, "compute_dtype": torch.bfloat16}}


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels, momentum=None)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class MultiForwardNet(nn.Module):
    """stem (conv + BN) -> the same ResBlock ``REPEATS`` times -> global average pool -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 5, 3, padding=1, bias=False), nn.BatchNorm2d(5, momentum=None))
        self.block = ResBlock(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.stem(x))
        for _ in range(REPEATS):
            x = self.block(x)
        return self.head(x.mean((2, 3)))


def _wrap(model: MultiForwardNet, order: str, bn: bool, fsdp_kwargs: Dict[str, Any]) -> FSDP:
    if bn:
        auto_wrap_bn(model)
    if order == "fsdp(block)":
        model.block = FSDP(model.block, **fsdp_kwargs)
    elif order == "fsdp(ckpt(block))":
        model.block = FSDP(checkpoint_wrapper(model.block), **fsdp_kwargs)
    elif order == "ckpt(fsdp(block))":
        model.block = checkpoint_wrapper(FSDP(model.block, **fsdp_kwargs))
    else:
        raise ValueError(order)
    return FSDP(model, **fsdp_kwargs)


def _inputs(step: int) -> List[Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return [torch.randn(LOCAL_BATCH * WS, 2, 5, 5, generator=gen) for _ in range(FORWARDS)]


def _loss(out: Tensor, global_n: int, scale: int) -> Tensor:
    return (out.float() - 0.1).pow(2).sum() * (scale / global_n)


class BatchStats:
    """Every batch-norm call's batch statistics on this rank's inputs, under the reference's current parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.seen: Dict[str, List[Tuple[Tensor, Tensor]]] = {}
        for name, layer in self.model.named_modules():
            if isinstance(layer, nn.BatchNorm2d):
                self.seen[name] = []
                layer.register_forward_pre_hook(lambda _m, args, name=name: self._record(name, args[0]))

    def _record(self, name: str, x: Tensor) -> None:
        self.seen[name].append((x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=True)))

    @torch.no_grad()
    def observe(self, ref: nn.Module, inputs: List[Tensor]) -> None:
        for p, p_ref in zip(self.model.parameters(), ref.parameters()):
            p.copy_(p_ref)
        for x in inputs:
            self.model(x)

    def expected(self) -> Dict[str, Tensor]:
        """Running statistics of a ``momentum=None`` batch norm: the average over all calls."""
        out: Dict[str, Tensor] = {}
        for name, stats in self.seen.items():
            out[f"{name}.running_mean"] = torch.stack([m for m, _ in stats]).mean(0)
            out[f"{name}.running_var"] = torch.stack([v for _, v in stats]).mean(0)
            out[f"{name}.num_batches_tracked"] = torch.tensor(len(stats))
        return out


def _case(rank: int, order: str, bn: bool, precision: str, plain_results: Dict[Tuple[bool, str], Any]) -> None:
    torch.manual_seed(11)
    ref = MultiForwardNet()
    model = copy.deepcopy(ref)
    stats = BatchStats(ref)
    init = ref_params(ref)
    recomputed: List[bool] = []
    model.block.conv.register_forward_pre_hook(lambda *_: recomputed.append(is_recomputing()))
    fsdp = _wrap(model, order, bn, PRECISIONS[precision])
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    n = LOCAL_BATCH * WS * FORWARDS
    first_loss = None
    for step in range(STEPS):
        inputs = _inputs(step)
        local = [local_slice((x,), rank, WS)[0] for x in inputs]
        stats.observe(ref, local)
        opt.zero_grad()
        loss = sum((_loss(fsdp(x), n, WS) for x in local), torch.zeros(()))
        loss.backward()
        assert_idle(fsdp)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = sum((_loss(ref(p), n, 1) for x in inputs for p in x.tensor_split(WS)), torch.zeros(()))
        ref_loss.backward()
        ref_opt.step()
        first_loss = abs(ref_loss.item()) if first_loss is None else first_loss
        tol = 1e-5 if precision == "fp32" else 5e-2
        got = mean_over_ranks(loss.item())
        assert abs(got - ref_loss.item()) <= tol * first_loss, f"step {step}: loss {got} vs {ref_loss.item()}"
    calls = STEPS * FORWARDS * REPEATS
    expected_recomputes = 0 if order == "fsdp(block)" else calls
    assert len(recomputed) == calls + expected_recomputes and sum(recomputed) == expected_recomputes
    _check_running_stats(fsdp, stats.expected(), precision, calls)
    params = full_params(fsdp)
    if precision == "fp32":
        assert_close_dict(params, ref_params(ref), "param", rtol=1e-4, atol=1e-5)
    else:
        assert_update_close(params, ref_params(ref), init, BF16_PARAM_REL, "param")
    # The recomputation computes exactly what the first pass computed, so a checkpointed model matches plain FSDP far
    # more tightly than bf16 matches fp32. One exception: checkpoint_wrapper(FSDP(block)) re-runs the FSDP forward
    # for each call and sums the calls' bf16 gradients in another order than plain FSDP does, which differs by bf16
    # rounding.
    if order == "fsdp(block)":
        plain_results[bn, precision] = params
    elif precision == "bf16" and order == "ckpt(fsdp(block))":
        assert_update_close(params, plain_results[bn, precision], init, 0.05, "param vs plain FSDP")
    else:
        assert_close_dict(params, plain_results[bn, precision], "param vs plain FSDP", rtol=1e-5, atol=1e-6)


def _check_running_stats(fsdp: FSDP, expected: Dict[str, Tensor], precision: str, block_calls: int) -> None:
    wrapper_parts = ("_fsdp_wrapped_module", "_fpw_module")
    got = {".".join(c for c in k.split(".") if c not in wrapper_parts): v for k, v in fsdp.named_buffers()}
    assert sorted(got) == sorted(expected)
    assert got["block.bn.num_batches_tracked"].item() == block_calls, "one statistics update per block call"
    assert got["stem.1.num_batches_tracked"].item() == STEPS * FORWARDS
    tol = 1e-5 if precision == "fp32" else 3e-2
    for name, value in expected.items():
        torch.testing.assert_close(got[name].to(value.dtype), value, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def _multiple_forwards_with_checkpoint_and_batchnorm_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Any]] = []
    plain_results: Dict[Tuple[bool, str], Any] = {}
    for order in ORDERS:
        for bn, precision in ((False, "fp32"), (True, "fp32"), (True, "bf16")):

            def case(order: str = order, bn: bool = bn, precision: str = precision) -> None:
                _case(rank, order, bn, precision, plain_results)

            cases.append((f"{order},auto_wrap_bn={bn},{precision}", case))
    run_cases(cases)


def test_multiple_forwards_with_checkpoint_and_batchnorm() -> None:
    run_distributed(_multiple_forwards_with_checkpoint_and_batchnorm_body, WS, timeout=TIMEOUT)
