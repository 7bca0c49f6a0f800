# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper.load_state_dict is all or nothing.

``nn.Module.load_state_dict`` copies every entry that fits before it raises for the ones that do not; the wrapper
first tries the load on shape-only tensors, so a dict that does not fit changes no parameter or buffer (flat or not),
in both the original-name and the flat form, and a dict that fits loads exactly as before.
"""

from typing import Any, Callable, Dict

import pytest
import torch
from torch import nn

from fairscale.nn import FlattenParamsWrapper


def _wrapper() -> FlattenParamsWrapper:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        module[1].running_mean.uniform_()
        module[1].weight.uniform_(2, 3)
    return FlattenParamsWrapper(module, param_list=[module[0].weight, module[0].bias, module[2].weight])


def _state(m: FlattenParamsWrapper) -> Dict[str, torch.Tensor]:
    """Every registered tensor of the wrapper (the flat parameter, the unflattened BatchNorm ones, the buffers)."""
    return {k: v.detach().clone() for k, v in list(m.named_parameters()) + list(m.named_buffers())}


def _ones_like(sd: Dict[str, Any]) -> Dict[str, Any]:
    return {k: torch.ones_like(v) if v.is_floating_point() else v + 1 for k, v in sd.items()}


def _wrong_size(sd: Dict[str, Any]) -> None:
    sd["2.weight"] = torch.ones(5, 4)  # the last entry: every other one would be copied before torch raises


def _missing(sd: Dict[str, Any]) -> None:
    del sd["2.weight"]


def _unexpected(sd: Dict[str, Any]) -> None:
    sd["3.weight"] = torch.ones(1)


def _not_a_tensor(sd: Dict[str, Any]) -> None:
    sd["2.weight"] = [[1.0] * 4] * 2


@pytest.mark.parametrize(
    "spoil, match",
    [
        (_wrong_size, "size mismatch for 2.weight"),  # the dict's key (was the internal _fpw_module.2.weight)
        (_missing, "Missing key"),
        (_unexpected, "Unexpected key"),
        (_not_a_tensor, "expected torch.Tensor or Tensor-like object"),
    ],
)
def test_failed_load_changes_nothing(spoil: Callable[[Dict[str, Any]], None], match: str) -> None:
    m = _wrapper()
    sd = _ones_like(m.state_dict())
    spoil(sd)
    before = _state(m)
    flat_param = m.flat_param
    with pytest.raises(RuntimeError, match=match) as raised:
        m.load_state_dict(sd)
    assert "_fpw_module" not in str(raised.value)
    after = _state(m)
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert m.flat_param is flat_param and m.is_flattened


def test_failed_flat_load_changes_nothing() -> None:
    m = _wrapper()
    sd = _ones_like(m.flat_state_dict())
    sd["flat_param_0"] = torch.ones(m.flat_param.numel() - 1)
    before = _state(m)
    with pytest.raises(RuntimeError, match="size mismatch for flat_param_0"):
        m.load_state_dict(sd)
    for key, value in _state(m).items():
        assert torch.equal(value, before[key]), key


def test_loads_that_fit_are_unchanged() -> None:
    """strict=False still loads what fits and reports the rest; a full dict loads every value, views included."""
    m = _wrapper()
    sd = _ones_like(m.state_dict())
    del sd["1.weight"]
    result = m.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["1.weight"] and result.unexpected_keys == []
    assert torch.equal(m.flat_param, torch.ones_like(m.flat_param))
    assert not torch.equal(m.module[1].weight, torch.ones(4))  # the missing entry kept its value
    assert torch.equal(m.module[1].running_mean, torch.ones(4))
    full = {k: v * 2 for k, v in _ones_like(m.state_dict()).items()}
    m.load_state_dict(full)
    assert torch.equal(m.module[0].weight, torch.full((4, 3), 2.0))  # the forward's view sees the flat parameter
    assert m.module[0].weight.data_ptr() == m.flat_param.data_ptr()
    out = m(torch.ones(8, 3))
    assert out.shape == (8, 2)
