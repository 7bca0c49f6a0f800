# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SyncBatchNorm faults: a double backward raises instead of giving wrong second-order gradients, and ranks that
disagree on whether the layer's input requires grad raise RanksDisagreeError in forward instead of hanging in the
backward's gradient all-reduce (which only some of them would run)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn import SyncBatchNorm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives

WORLD = 2


def _double_backward_body(rank: int, world_size: int) -> None:
    # torch warns that all_reduce has no autograd kernel when create_graph=True; the error below is the point.
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3)
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    weights = torch.arange(1.0, 6.0)
    (grad,) = torch.autograd.grad((layer(x).pow(2) * weights).sum(), x, create_graph=True)
    # The first-order gradient is still BatchNorm's (one rank: the global batch is this rank's).
    x_ref = x.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad((ref(x_ref).pow(2) * weights).sum(), x_ref)
    torch.testing.assert_close(grad, grad_ref)
    # The second order was silently wrong (mean/invstd were constants of the backward): now torch's error.
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.pow(2).sum().backward()


def test_double_backward_raises() -> None:
    run_distributed(_double_backward_body, 1, timeout=60)


def _expect_disagreement(layer: SyncBatchNorm, x: torch.Tensor, grad_mode: bool) -> None:
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.set_grad_enabled(grad_mode), count_collectives() as counter:
        with pytest.raises(RanksDisagreeError, match="disagree on whether the layer's input requires grad"):
            layer(x)
    # Carried by the count's all-reduce (no extra collective), raised before the statistics change.
    assert counter.count("all_reduce") == 1, counter.summary()
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k


def _requires_grad_disagree_body(rank: int, world_size: int) -> None:
    # The input requires grad on rank 0 only (layers before it frozen on one rank): rank 0's backward waited forever
    # in the gradient all-reduce. Every rank raises in forward now.
    layer = SyncBatchNorm(3)
    _expect_disagreement(layer, torch.randn(4, 3, 5).requires_grad_(rank == 0), grad_mode=True)
    # Grad mode off on rank 1 only: the same.
    _expect_disagreement(layer, torch.randn(4, 3, 5, requires_grad=True), grad_mode=rank == 0)
    # Ranks that agree still run: no input gradient anywhere (weight/bias gradients stay local, no collective in
    # backward), and no_grad on every rank; then a full step (the group is still usable).
    with count_collectives() as counter:
        layer(torch.randn(4, 3, 5)).sum().backward()
        with torch.no_grad():
            layer(torch.randn(4, 3, 5))
        layer(torch.randn(4, 3, 5, requires_grad=True)).sum().backward()
    assert counter.count("all_reduce") == 2 + 2 + 3, counter.summary()


def test_requires_grad_disagreement_raises_on_every_rank() -> None:
    # run_distributed raises the first failing rank's error: every rank checks its own RanksDisagreeError above.
    run_distributed(_requires_grad_disagree_body, WORLD, timeout=60)


def _mixed_dtype_body(rank: int, world_size: int) -> None:
    layer = SyncBatchNorm(3).double()
    x = torch.randn(4, 3)  # a forgotten .double() of the input
    before = (layer.running_mean.clone(), layer.running_var.clone())
    with pytest.raises(RuntimeError, match="input dtype torch.float32 does not match"):
        layer(x)
    assert torch.equal(layer.running_mean, before[0]) and torch.equal(layer.running_var, before[1])
    # The supported mix is still accepted: half-precision input over float32 parameters.
    layer32 = SyncBatchNorm(3)
    assert layer32(torch.randn(4, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_input_of_another_dtype_than_the_parameters_raises_on_every_rank() -> None:
    """A float32 input over float64 parameters was accepted silently where torch's batch norm refuses it (found by a
    randomized sequence of API calls)."""
    run_distributed(_mixed_dtype_body, WORLD, timeout=60)


def test_a_failed_load_changes_nothing() -> None:
    """torch's load copied the entries that fit (weight, bias, running_mean, num_batches_tracked) before raising on
    one of another shape (found by a fuzz of experimental.nn, session 40); the layer's own load is all or nothing now
    (a parent module's load is torch's, as for every module)."""
    layer = SyncBatchNorm(3)
    bad = {k: v.clone() + 1 for k, v in layer.state_dict().items()}
    bad["running_var"] = torch.ones(4)
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(RuntimeError, match="running_var"):
        layer.load_state_dict(bad)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    good = {k: v.clone() + 1 for k, v in layer.state_dict().items()}
    layer.load_state_dict(good)
    assert all(torch.equal(v, good[k]) for k, v in layer.state_dict().items())
