# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Frozen parameters (requires_grad=False) set before or after wrapping, in their own or in a shared instance."""

from typing import Any, Callable, Dict

import pytest
import torch
from _models import (
    assert_close_dict,
    assert_idle,
    build,
    full_params,
    gather_full_grads,
    global_batch,
    local_slice,
    make_optim,
    ref_params,
    scaled_loss,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class TrunkHead(nn.Module):
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.trunk(x))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 6, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _train(rank: int, ws: int, wrap: Callable[[nn.Module], FSDP], freeze_after: Callable[[FSDP], None]) -> None:
    """Freeze ``trunk`` in the reference; ``wrap`` may freeze before wrapping, ``freeze_after`` after it."""
    model, ref = build(TrunkHead)
    ref.trunk.requires_grad_(False)
    fsdp = wrap(model)
    freeze_after(fsdp)
    opt = make_optim([p for p in fsdp.parameters() if p.requires_grad], "sgd")
    ref_opt = make_optim([p for p in ref.parameters() if p.requires_grad], "sgd")
    init = ref_params(ref)
    n = 2 * ws
    for step in range(3):
        batch = global_batch(ref, step, n)
        opt.zero_grad()
        with count_collectives() as counter:
            scaled_loss(TrunkHead, fsdp(*local_slice(batch, rank, ws)), n, ws).backward()
        assert_idle(fsdp)
        # Only the head's gradient is reduced (27 elements, padded to 28 per tensor group at world size 2).
        assert counter.total_bytes("reduce_scatter") == 28 * 4, counter.summary()
        ref_opt.zero_grad()
        scaled_loss(TrunkHead, ref(*batch), n, 1).backward()
        expected = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
        assert_close_dict(gather_full_grads(fsdp), expected, f"step {step} grad", rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    params = full_params(fsdp)
    assert_close_dict(params, ref_params(ref), "param", rtol=1e-4, atol=1e-5)
    for name in params:
        if name.startswith("trunk."):
            assert torch.equal(params[name], init[name]), f"frozen {name} changed"


def _freeze_trunk(model: nn.Module) -> nn.Module:
    model.trunk.requires_grad_(False)
    return model


def _no_op(fsdp: FSDP) -> None:
    pass


WRAPPINGS: Dict[str, Any] = {
    # Frozen before wrapping, everything in one non-flat instance.
    "before,one,flatten=False": (lambda m: FSDP(_freeze_trunk(m), flatten_parameters=False), _no_op),
    # Frozen trunk in its own instance (flat), trainable head in the root.
    "before,nested": (
        lambda m: FSDP(_set_trunk(_freeze_trunk(m), lambda t: FSDP(t, reshard_after_forward=True))),
        _no_op,
    ),
    "before,nested,flatten=False": (
        lambda m: FSDP(
            _set_trunk(_freeze_trunk(m), lambda t: FSDP(t, flatten_parameters=False)), flatten_parameters=False
        ),
        _no_op,
    ),
    # Frozen after wrapping, before the first forward: the trunk instance's flat parameter.
    "after,nested": (lambda m: FSDP(_set_trunk(m, FSDP)), lambda f: f.module.module.trunk.requires_grad_(False)),
    "after,nested,flatten=False": (
        lambda m: FSDP(_set_trunk(m, lambda t: FSDP(t, flatten_parameters=False)), flatten_parameters=False),
        lambda f: f.module.module.trunk.requires_grad_(False),
    ),
}


def _set_trunk(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    model.trunk = wrap(model.trunk)
    return model


def _frozen_parameters_match_reference_body(rank: int, ws: int) -> None:
    run_cases((name, lambda w=w, a=a: _train(rank, ws, w, a)) for name, (w, a) in WRAPPINGS.items())


def test_frozen_parameters_match_reference() -> None:
    run_distributed(_frozen_parameters_match_reference_body, 2)


def _mixed_requires_grad_in_one_flat_parameter_is_rejected_body(rank: int, ws: int) -> None:
    model = _freeze_trunk(TrunkHead())
    with pytest.raises(ValueError, match="requires_grad"):
        FSDP(model)


def test_mixed_requires_grad_in_one_flat_parameter_is_rejected() -> None:
    run_distributed(_mixed_requires_grad_in_one_flat_parameter_is_rejected_body, 2)


def _unfreezing_after_wrapping_trains_the_parameters_body(rank: int, ws: int) -> None:
    model, ref = build(TrunkHead)
    model.trunk.requires_grad_(False)
    model.trunk = FSDP(model.trunk)
    fsdp = FSDP(model)
    fsdp.module.module.trunk.requires_grad_(True)
    batch = global_batch(ref, 0, 2 * ws)
    scaled_loss(TrunkHead, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    assert_idle(fsdp)
    scaled_loss(TrunkHead, ref(*batch), 2 * ws, 1).backward()
    expected = {k: p.grad for k, p in ref.named_parameters()}
    assert_close_dict(gather_full_grads(fsdp), expected, "grad", rtol=1e-5, atol=1e-6)


def test_unfreezing_after_wrapping_trains_the_parameters() -> None:
    """Parameters frozen at wrapping time and unfrozen later (fine-tuning schedules) get reduced gradients."""

    run_distributed(_unfreezing_after_wrapping_trains_the_parameters_body, 2)
