# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper state dicts exchanged with the plain module: module versions and the wrapper's own members.

Found by the sequence review (findings 6 and 8): ``state_dict()._metadata`` kept the internal ``_fpw_module`` level
and loads did not add it, so a versioned module saw no version when a checkpoint crossed between the wrapper and the
plain module (a quantized Linear failed with ``KeyError``); and a buffer or parameter registered on the wrapper itself
was reported both missing and unexpected when the wrapper loaded its own ``state_dict()``.
"""

import copy
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.nn.misc import FlattenParamsWrapper


class _Versioned(nn.Module):
    """A layer whose load depends on the saved version (as BatchNorm's and quantized layers' do)."""

    _version = 3

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen: List[Optional[int]] = []

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        self.seen.append(local_metadata.get("version"))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin(x)
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Versioned(), nn.Tanh(), nn.Linear(2, 1))


def _versions_seen(model: nn.Module) -> List[Optional[int]]:
    return [v for m in model.modules() if isinstance(m, _Versioned) for v in m.seen]


def _load_and_see(target: str, sd: Dict[str, Any]) -> List[Optional[int]]:
    model = _model() if target == "plain" else FlattenParamsWrapper(_model())
    model.load_state_dict(sd)
    return _versions_seen(model)


@pytest.mark.parametrize("source, target", [("plain", "wrapper"), ("wrapper", "plain")])
def test_module_versions_cross_between_wrapper_and_plain_module(source: str, target: str) -> None:
    plain = _model()
    wrapped: Any = FlattenParamsWrapper(copy.deepcopy(plain))
    sd = plain.state_dict() if source == "plain" else wrapped.state_dict()
    seen = _load_and_see(target, sd)
    # The wrapper's own dicts, both forms, still load into a wrapper with their versions.
    seen += _load_and_see("wrapper", wrapped.state_dict()) + _load_and_see("wrapper", wrapped.flat_state_dict())
    assert seen and all(v == 3 for v in seen)


def test_a_nested_wrapper_saves_versions_under_both_paths() -> None:
    parent = nn.Sequential(FlattenParamsWrapper(_model()))
    sd = parent.state_dict()
    plain_parent = nn.Sequential(_model())
    plain_parent.load_state_dict(sd)  # the plain parent finds its modules' versions...
    parent.load_state_dict(sd)  # ... and so does the wrapper nested in a parent (under the internal paths)
    seen = _versions_seen(plain_parent) + _versions_seen(parent)
    assert len(seen) == 2 and all(v == 3 for v in seen)


def test_the_plain_layout_of_metadata_is_listed() -> None:
    plain = _model()
    sd_meta = getattr(FlattenParamsWrapper(copy.deepcopy(plain)).state_dict(), "_metadata")
    plain_meta = getattr(plain.state_dict(), "_metadata")
    assert all(sd_meta[k] == v for k, v in plain_meta.items())


class _WithOwnMembers(FlattenParamsWrapper):
    """A wrapper subclass keeping state of its own beside the wrapped module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        self.register_parameter("scale", nn.Parameter(torch.ones(1)))
        self.add_module("head", nn.Linear(1, 1))


@pytest.mark.parametrize("flat", [False, True])
def test_members_registered_on_the_wrapper_round_trip(flat: bool) -> None:
    source = _WithOwnMembers(_model())
    with torch.no_grad():
        source.step_count.fill_(7)
        source.scale.fill_(2.5)
        source.head.weight.fill_(-1.0)
    sd = source.flat_state_dict() if flat else source.state_dict()
    assert {"step_count", "scale", "head.weight", "head.bias"} <= set(sd)
    target = _WithOwnMembers(nn.Sequential(_Versioned(), nn.Tanh(), nn.Linear(2, 1)))
    result = target.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert int(target.step_count) == 7 and float(target.scale.detach()) == 2.5
    assert torch.equal(target.head.weight, source.head.weight)
    target_sd = target.state_dict()
    assert all(torch.equal(target_sd[k], v) for k, v in source.state_dict().items())
    # A parent loads them too.
    parent: Any = nn.Sequential(_WithOwnMembers(_model()))
    parent.load_state_dict(nn.Sequential(source).state_dict())
    assert int(parent[0].step_count) == 7
