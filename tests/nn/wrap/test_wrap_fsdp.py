# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""wrap / enable_wrap / auto_wrap with FullyShardedDataParallel as the wrapper class, on a real gloo group.

The stand-in wrapper tests are in ``test_wrap.py``; size-policy details with FSDP in ``test_wrap_fsdp_policy.py``.
Here: the arguments reach real FSDP instances, hand-nested ``wrap()`` calls and ``auto_wrap`` build the tree the
wrapping modes of the FSDP tests build by hand, and the result trains like the unwrapped model.
"""

import functools
import os
import sys
from typing import Any, Dict, List

import pytest
import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "data_parallel"))
from _models import NestedWrappedModule, assert_idle, train_and_compare  # noqa: E402

from fairscale.fair_dev.testing.engine import run_cases, run_distributed  # noqa: E402
from fairscale.internal.collectives import count_collectives  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # noqa: E402
from fairscale.nn.data_parallel import get_fsdp_instances  # noqa: E402
from fairscale.nn.wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap  # noqa


def _owned_numels(root: FSDP) -> Dict[str, int]:
    """Owned parameter numel per instance, by clean module path ("" for the root)."""
    out = {}
    for name, m in root.named_modules():
        if isinstance(m, FSDP):
            path = ".".join(c for c in name.split(".") if c not in ("_fsdp_wrapped_module", "_fpw_module"))
            out[path] = int(m.buffer_size)
    return out


def _wrap_arguments_reach_fsdp(rank: int, ws: int) -> None:
    linear = nn.Linear(3, 3)
    assert wrap(linear) is linear  # outside the context: a no-op
    with enable_wrap(wrapper_cls=FSDP, mixed_precision=True, flatten_parameters=False):
        plain = wrap(nn.Linear(3, 3))
        overridden = wrap(nn.Linear(3, 3), mixed_precision=False, reshard_after_forward=False)
        tagged = nn.Linear(3, 3)
        tagged.wrapper_config = dict(bucket_cap_mb=0, compute_dtype=torch.bfloat16)  # type: ignore[assignment]
        configured = wrap(tagged)
    assert isinstance(plain, FSDP) and plain.mixed_precision and not plain.flatten_parameters
    assert plain.world_size == ws and plain.compute_dtype == torch.float16
    assert not overridden.mixed_precision and not overridden.reshard_after_forward
    assert configured.bucket_cap_mb == 0 and configured.compute_dtype == torch.bfloat16 and configured.mixed_precision


def _hand_nested_wrap_trains(rank: int, ws: int) -> None:
    """Upstream's idiom: wrap() the blocks inside enable_wrap, then the whole model."""

    def wrapper(model: nn.Module) -> FSDP:
        with enable_wrap(wrapper_cls=FSDP, bucket_cap_mb=0):
            model.layers[1] = wrap(model.layers[1])
            model.layers[2] = wrap(model.layers[2])
            root = wrap(model)
        assert _owned_numels(root) == {"": 58, "layers.1": 104, "layers.2": 30}
        return root

    model = train_and_compare(rank, ws, NestedWrappedModule, {}, "one", wrapper=wrapper)
    with count_collectives() as counter:
        model(torch.randn(2, 7)).sum().backward()
    assert counter.count("all_gather", "forward") == 3 and counter.count("reduce_scatter") == 3, counter.summary()
    assert_idle(model)


def _auto_wrap_case(rank: int, ws: int, min_num_params: int, expected: Dict[str, int], kwargs: Dict[str, Any]) -> None:
    policy = functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)

    def wrap_fn(model: nn.Module) -> FSDP:
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            wrapped = auto_wrap(model, auto_wrap_policy=policy)
        root = wrapped if isinstance(wrapped, FSDP) else FSDP(wrapped, **kwargs)
        assert _owned_numels(root) == expected, _owned_numels(root)
        assert all(m.mixed_precision == kwargs.get("mixed_precision", False) for m in get_fsdp_instances(root))
        return root

    train_and_compare(rank, ws, NestedWrappedModule, kwargs, "one", wrapper=wrap_fn)


class _SharedLayer(nn.Module):
    """One linear layer used twice (registered in two places), as weight-shared blocks are."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(8, 8)
        self.seq = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(8, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.seq(x)

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 8, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _auto_wrap_a_layer_in_two_places(rank: int, ws: int) -> None:
    # The first place got an FSDP instance and the second kept the bare layer: the root then refused the tree
    # (the layer's weights belonged to the instance). Both places hold the same instance now, and it trains as the
    # unwrapped model.
    def wrapper(model: nn.Module) -> FSDP:
        with enable_wrap(wrapper_cls=FSDP):
            wrapped = auto_wrap(model, auto_wrap_policy=functools.partial(default_auto_wrap_policy, min_num_params=50))
        assert wrapped.seq[0] is wrapped.seq[2] and isinstance(wrapped.seq[0], FSDP)
        return FSDP(wrapped)

    train_and_compare(rank, ws, _SharedLayer, {}, "nested", wrapper=wrapper)


def _wrap_and_auto_wrap_with_fsdp_body(rank: int, ws: int) -> None:
    cases: List[Any] = [
        ("wrap arguments", lambda: _wrap_arguments_reach_fsdp(rank, ws)),
        ("hand-nested wrap", lambda: _hand_nested_wrap_trains(rank, ws)),
        ("a layer in two places", lambda: _auto_wrap_a_layer_in_two_places(rank, ws)),
    ]
    # Thresholds: 100 wraps block 1 (104) only; 30 descends into both blocks and wraps every linear of at least
    # 30 parameters (the "leaf" layout of the FSDP tests), leaving the 18-parameter last linear to the root.
    leaves = {"": 18, "layers.0": 40, "layers.1.0": 54, "layers.1.2": 50, "layers.2.0": 30}
    for min_params, expected in ((100, {"": 88, "layers.1": 104}), (30, leaves)):
        for mp in (False, True):
            kwargs = dict(mixed_precision=mp)
            cases.append(
                (
                    f"auto_wrap min={min_params} mixed={mp}",
                    lambda m=min_params, e=expected, k=kwargs: _auto_wrap_case(rank, ws, m, e, k),
                )
            )
    run_cases(cases)


def test_wrap_and_auto_wrap_with_fsdp() -> None:
    run_distributed(_wrap_and_auto_wrap_with_fsdp_body, 2)


class Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.norm.wrapper_config = dict(mixed_precision=False, flatten_parameters=False)  # type: ignore[assignment]
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.body(x)).to(self.head.weight.dtype))


def _config_policy_and_already_wrapped_trees_body(rank: int, ws: int) -> None:
    model = Tagged()
    with enable_wrap(wrapper_cls=FSDP, mixed_precision=True):
        wrapped = auto_wrap(model, auto_wrap_policy=config_auto_wrap_policy)
    root = FSDP(wrapped, mixed_precision=True)
    norm = root.module.module.norm
    assert isinstance(norm, FSDP) and not norm.mixed_precision and not norm.flatten_parameters
    assert not isinstance(root.module.module.body, FSDP)
    root(torch.randn(3, 4)).float().sum().backward()
    assert_idle(root)
    # A tree that already contains FSDP instances is refused: its parameters are managed already.
    with enable_wrap(wrapper_cls=FSDP):
        with pytest.raises(ValueError):
            auto_wrap(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 3)))


def test_config_policy_and_already_wrapped_trees() -> None:
    run_distributed(_config_policy_and_already_wrapped_trees_body, 2)
