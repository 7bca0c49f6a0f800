# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper: what leaving ``unflatten_params()`` keeps, against the plain module.

Found by the sequence review (findings 1, 3, 5 and 7): ``state_dict()`` under ``no_grad`` between a forward and its
backward left a checkpointed layer grad-less views (its gradients were lost); a rebind of a tied weight's second name
was dropped silently (``None`` too); ``requires_grad_(False)`` inside the context was thrown away; and a copy or
pickle made inside the context stayed unflattened for good (no forward with autograd ever worked on it).
"""

import copy
import pickle
from typing import Any, List

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.nn import checkpoint_wrapper
from fairscale.nn.misc import FlattenParamsWrapper


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(torch.tanh(self.a(x)))
        return out


def _checkpointed(first: bool) -> nn.Module:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(3, 3), checkpoint_wrapper(nn.Linear(3, 3)), nn.Tanh(), nn.Linear(3, 1)]
    if first:  # the checkpointed layer's input does not require grad
        layers = [checkpoint_wrapper(nn.Linear(3, 3)), nn.Tanh(), nn.Linear(3, 1)]
    return nn.Sequential(*layers)


def _mlp() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("between", ["state_dict", "unflatten_params"])
def test_no_grad_context_between_forward_and_backward_keeps_checkpointed_gradients(first: bool, between: str) -> None:
    ref = _checkpointed(first)
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    out = fpw(x)
    with torch.no_grad():
        if between == "state_dict":
            fpw.state_dict()
        else:
            with fpw.unflatten_params():
                pass
    out.sum().backward()
    ref(x).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(fpw.flat_param.grad, expected)


def test_a_rebind_of_a_tied_second_name_is_written_back() -> None:
    torch.manual_seed(0)
    ref = _Tied()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    with fpw.unflatten_params():
        fpw.module.b.weight = nn.Parameter(torch.full((2, 2), 7.0))
    with torch.no_grad():
        ref.b.weight.fill_(7.0)  # the tie holds one value: both names have it
    sd = fpw.state_dict()
    assert torch.equal(sd["a.weight"], torch.full((2, 2), 7.0)) and torch.equal(sd["b.weight"], sd["a.weight"])
    x = torch.randn(3, 2)
    assert torch.equal(fpw(x), ref(x))
    # Both names rebound to one tensor is fine as well.
    with fpw.unflatten_params():
        shared = nn.Parameter(torch.full((2, 2), 3.0))
        fpw.module.a.weight = shared
        fpw.module.b.weight = shared
    assert torch.equal(fpw.state_dict()["b.weight"], torch.full((2, 2), 3.0))


def test_a_tied_second_name_that_cannot_be_written_back_raises() -> None:
    torch.manual_seed(0)
    fpw: Any = FlattenParamsWrapper(_Tied())
    before = fpw.flat_param.detach().clone()
    with pytest.raises(ValueError, match=r"b\.weight: NoneType where \(2, 2\) was expected"):
        with fpw.unflatten_params():
            fpw.module.b.weight = None
    with pytest.raises(ValueError, match=r"a\.weight and b\.weight: one tied parameter, rebound to two different"):
        with fpw.unflatten_params():
            fpw.module.a.weight = nn.Parameter(torch.ones(2, 2))
            fpw.module.b.weight = nn.Parameter(torch.zeros(2, 2))
    assert fpw.is_flattened and torch.equal(fpw.flat_param.detach(), before)
    fpw(torch.randn(3, 2)).sum().backward()
    assert fpw.flat_param.grad is not None


def test_requires_grad_changed_inside_the_context_is_kept() -> None:
    ref = _mlp()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    with fpw.unflatten_params():
        fpw.requires_grad_(False)
    ref.requires_grad_(False)
    x = torch.randn(4, 2)
    assert not fpw.flat_param.requires_grad
    assert fpw(x).requires_grad == ref(x).requires_grad == False  # noqa: E712
    with fpw.unflatten_params():
        fpw.module.requires_grad_(True)
    assert fpw.flat_param.requires_grad and fpw(x).requires_grad


def test_requires_grad_changed_for_part_of_a_flat_parameter_raises() -> None:
    fpw: Any = FlattenParamsWrapper(_mlp())
    before = fpw.flat_param.detach().clone()
    with pytest.raises(ValueError, match=r"requires_grad of part of flat parameter flat_param_0 changed"):
        with fpw.unflatten_params():
            fpw.module[0].requires_grad_(False)
            fpw.module[2].weight.data = torch.zeros(1, 3)  # not written back either: all or nothing
    assert fpw.flat_param.requires_grad and torch.equal(fpw.flat_param.detach(), before)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_inside_the_context_is_flattened_and_trains(how: str) -> None:
    ref = _mlp()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    with fpw.unflatten_params():
        fpw.module[2].bias = nn.Parameter(torch.full((1,), 4.0))  # a rebind the exit writes back
        clone = copy.deepcopy(fpw) if how == "deepcopy" else pickle.loads(pickle.dumps(fpw))
    with torch.no_grad():
        ref[2].bias.fill_(4.0)
    assert clone.is_flattened and [n for n, _ in clone.named_parameters()] == ["flat_param_0"]
    assert clone.flat_param.untyped_storage().data_ptr() != fpw.flat_param.untyped_storage().data_ptr()
    x = torch.randn(5, 2)
    out, expected = clone(x), ref(x)
    assert torch.equal(out, expected) and torch.equal(fpw(x), expected)
    out.sum().backward()
    expected.sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.equal(clone.flat_param.grad, grads)
    assert fpw.flat_param.grad is None  # the original is untouched by the copy's backward


def test_a_copy_inside_the_context_with_an_unwritable_rebind_raises() -> None:
    fpw: Any = FlattenParamsWrapper(_mlp())
    with pytest.raises(ValueError, match="undo that first"):
        with fpw.unflatten_params():
            fpw.module[0].weight = nn.Parameter(torch.zeros(5, 5))
            try:
                copy.deepcopy(fpw)
            finally:
                fpw.module[0].weight = nn.Parameter(torch.zeros(3, 2))
    assert fpw.is_flattened
