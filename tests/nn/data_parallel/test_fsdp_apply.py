# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP.apply: a function applied to every submodule sees full parameters, as on the unwrapped module."""

import itertools
from typing import Any, Dict

import torch
from _models import (
    NestedWrappedModule,
    TransformerWithSharedParams,
    assert_close_dict,
    assert_idle,
    build,
    full_params,
    ref_params,
    train_and_compare,
    wrap_model,
)
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import get_fsdp_instances


def init_weights(module: nn.Module) -> None:
    """A typical init function: random draws in module order, so the visiting order matters too."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.5)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.uniform_(module.bias, -0.3, 0.3)
    if isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(2.0)


def _apply_like_unwrapped(model_cls: Any, kwargs: Dict[str, Any], mode: str, initialised: bool) -> None:
    model, ref = build(model_cls)
    fsdp = wrap_model(model, kwargs, mode)
    if initialised:
        with torch.no_grad():
            fsdp(*model_cls.sample(2, torch.Generator().manual_seed(0)))
    torch.manual_seed(7)
    assert fsdp.apply(init_weights) is fsdp
    torch.manual_seed(7)
    ref.apply(init_weights)
    assert_idle(fsdp, after_forward=True)
    if not initialised:
        # apply() on a fresh model undoes the lazy init it needed, so the model can still be moved/changed.
        assert all(m._is_root is None for m in get_fsdp_instances(fsdp))
    assert_close_dict(full_params(fsdp), ref_params(ref), "after apply", rtol=0, atol=0)


def _apply_initialises_like_the_unwrapped_module_body(rank: int, ws: int) -> None:
    cases = []
    for model_cls, mode, flatten, initialised in itertools.product(
        (NestedWrappedModule, TransformerWithSharedParams), ("one", "nested"), (True, False), (False, True)
    ):
        kwargs = dict(flatten_parameters=flatten)
        name = f"{model_cls.__name__},{mode},flatten={flatten},initialised={initialised}"
        cases.append((name, lambda c=model_cls, k=kwargs, m=mode, i=initialised: _apply_like_unwrapped(c, k, m, i)))
    cases.append(("leaf", lambda: _apply_like_unwrapped(NestedWrappedModule, {}, "leaf", False)))
    run_cases(cases)


def test_apply_initialises_like_the_unwrapped_module() -> None:
    run_distributed(_apply_initialises_like_the_unwrapped_module_body, 3)


def _training_after_apply_matches_reference_body(rank: int, ws: int) -> None:
    class Initialised(NestedWrappedModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.apply(init_weights)

    # The reference is built the same way; wrapping and apply() on FSDP must give the same starting point.
    train_and_compare(rank, ws, Initialised, {}, "nested")

    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    torch.manual_seed(3)
    fsdp.apply(init_weights)
    torch.manual_seed(3)
    ref.apply(init_weights)
    x = torch.randn(2, 7)
    torch.testing.assert_close(fsdp(x), ref(x))


def test_training_after_apply_matches_reference() -> None:
    run_distributed(_training_after_apply_matches_reference_body, 2)
