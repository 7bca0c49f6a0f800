# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper cases the issue-3 checklist implies and test_flatten_params_wrapper.py did not cover (found by
the test audit): dtype changes after wrapping, a fully frozen module, and metadata of a second group."""

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from fairscale.nn.misc import FlattenParamsWrapper


def _seq() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


@pytest.mark.parametrize("forward_first", [False, True])
def test_dtype_change_after_wrapping(forward_first: bool) -> None:
    """``.double()`` converts the flat parameter; the next forward's views follow it (fresh views every forward)."""
    ref = _seq()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    if forward_first:
        fpw(torch.randn(1, 2))  # views of the fp32 flat parameter exist now
    fpw.double()
    ref.double()
    assert fpw.flat_param.dtype == torch.float64 and fpw.is_flattened
    x = torch.randn(4, 2, dtype=torch.float64)
    out = fpw(x)
    assert out.dtype == torch.float64 and torch.equal(out, ref(x))
    storage = fpw.flat_param.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in fpw.module._unflattened_param_views)
    out.sum().backward()
    ref(x).sum().backward()
    assert fpw.flat_param.grad is not None and fpw.flat_param.grad.dtype == torch.float64
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
    assert torch.equal(fpw.flat_param.grad, expected)
    sd = fpw.state_dict()
    assert list(sd) == list(ref.state_dict()) and all(v.dtype == torch.float64 for v in sd.values())


def test_fully_frozen_module() -> None:
    """All parameters frozen: the flat parameter does not require grad, the output neither, and it still loads."""
    ref = _seq().requires_grad_(False)
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    assert not fpw.flat_param.requires_grad
    x = torch.randn(3, 2)
    out = fpw(x)
    assert not out.requires_grad and torch.equal(out, ref(x))
    other = _seq()
    fpw.load_state_dict(other.state_dict())
    assert torch.equal(fpw(x), other(x)) and not fpw.flat_param.requires_grad


def test_metadata_of_the_second_group() -> None:
    m: Any = _seq()
    fpw: Any = FlattenParamsWrapper(m, param_list=[[m[0].weight, m[2].bias], [m[2].weight]])
    assert fpw.metadata(0) == (
        ["_fpw_module.0.weight", "_fpw_module.2.bias"],
        [torch.Size([3, 2]), torch.Size([1])],
        [6, 1],
    )
    assert fpw.metadata(1) == (["_fpw_module.2.weight"], [torch.Size([1, 3])], [3])
    # The second group's flat parameter holds exactly that weight, and its views alias it.
    assert torch.equal(fpw.flat_param_1.detach(), m[2].weight.detach().reshape(-1))
    fpw(torch.randn(1, 2))
    assert m[2].weight.untyped_storage().data_ptr() == fpw.flat_param_1.untyped_storage().data_ptr()
