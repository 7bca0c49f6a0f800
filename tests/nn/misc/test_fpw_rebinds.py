# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper: what users do to the unflattened parameters is kept or refused, never dropped silently.

Found by probing (session 9): a parameter rebound inside ``unflatten_params()`` (``m.weight.data = t`` or
``m.weight = nn.Parameter(t)``) was dropped when the views came back, a forward with autograd inside the context lost
its gradients to temporary parameters, and a parameter registered again after wrapping failed at the next forward
with "cannot assign 'torch.FloatTensor' as parameter 'weight'".
"""

import pytest
import torch
from torch import nn

from fairscale.nn.misc import FlattenParamsWrapper


def _wrapped() -> FlattenParamsWrapper:
    torch.manual_seed(0)
    return FlattenParamsWrapper(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))


def _values(fpw: FlattenParamsWrapper) -> dict:
    with fpw.unflatten_params():
        return {n: p.detach().clone() for n, p in fpw.module.named_parameters()}


def test_rebinds_inside_unflatten_params_are_written_back() -> None:
    fpw = _wrapped()
    before = _values(fpw)
    with fpw.unflatten_params():
        fpw.module[0].weight.data = torch.full((3, 4), 2.0)  # .data rebound
        fpw.module[1].bias = nn.Parameter(torch.full((2,), 3.0))  # Parameter replaced
        with torch.no_grad():
            fpw.module[1].weight.mul_(0)  # in place, as before
    after = _values(fpw)
    assert torch.equal(after["0.weight"], torch.full((3, 4), 2.0))
    assert torch.equal(after["1.bias"], torch.full((2,), 3.0))
    assert torch.equal(after["1.weight"], torch.zeros(2, 3))
    assert torch.equal(after["0.bias"], before["0.bias"])
    # The forward reads the flat parameter: the rebound values are what it computes with.
    x = torch.randn(5, 4)
    expected = nn.functional.linear(nn.functional.linear(x, after["0.weight"], after["0.bias"]), after["1.weight"])
    torch.testing.assert_close(fpw(x), expected + after["1.bias"])


def test_a_value_that_cannot_be_written_back_raises() -> None:
    fpw = _wrapped()
    before = _values(fpw)
    with pytest.raises(ValueError, match=r"1\.bias: NoneType where \(2,\) was expected"):
        with fpw.unflatten_params():
            fpw.module[1].bias = None
    with pytest.raises(ValueError, match=r"0\.weight: \(4, 4\) where \(3, 4\) was expected"):
        with fpw.unflatten_params():
            fpw.module[0].weight = nn.Parameter(torch.zeros(4, 4))
    after = _values(fpw)  # the wrapper is flattened again, with its values
    assert all(torch.equal(before[n], after[n]) for n in before)
    fpw(torch.randn(2, 4)).sum().backward()
    assert fpw.flat_param.grad is not None


def test_forward_with_autograd_inside_unflatten_params_raises() -> None:
    fpw = _wrapped()
    with fpw.unflatten_params():
        with pytest.raises(RuntimeError, match="inside unflatten_params"):
            fpw(torch.randn(2, 4))
        with torch.no_grad():
            out = fpw(torch.randn(2, 4))  # reading is fine
    assert out.shape == (2, 2)
    fpw(torch.randn(2, 4)).sum().backward()
    assert fpw.flat_param.grad is not None


def test_a_parameter_registered_again_after_wrapping_raises_clearly() -> None:
    fpw = _wrapped()
    fpw.module[0].weight = nn.Parameter(torch.ones(3, 4))
    with pytest.raises(ValueError, match="registered as a parameter again after FlattenParamsWrapper flattened it"):
        fpw(torch.randn(2, 4))
