# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gradient accumulation through a flat parameter's views: added in place into ``flat.grad``, no concatenation.

Reference everywhere: upstream's split views (``flat.get_param_views()``), whose ``SplitWithSizesBackward``
concatenates the view gradients in every backward; the comparison is bitwise (integer views, so signed zeros count).
"""

import copy
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.nn.misc import FlatParameter, FlattenParamsWrapper


class _Net(nn.Module):
    """A linear, a parameter whose gradient is ``-0.0`` (it is multiplied by ``-0.0``), and one left unused."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.signed = nn.Parameter(torch.ones(2))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        # The extra column is 1 + (signed * -0.0).sum(): its upstream gradient is positive in every backward, so the
        # gradient of `signed` is -0.0 each time (and -0.0 + -0.0 stays -0.0 when accumulated).
        extra = (self.signed * -0.0).sum().expand(x.shape[0], 1) + 1.0
        return torch.cat([self.lin(x), extra], dim=1)


def _split_views(flat: FlatParameter) -> List[Tensor]:
    return list(flat.get_param_views())


def _pair() -> "tuple[Any, Any]":
    torch.manual_seed(0)
    net = _Net()
    ours: Any = FlattenParamsWrapper(copy.deepcopy(net))
    theirs: Any = FlattenParamsWrapper(net)
    theirs._view_builder = _split_views  # upstream's split views
    return ours, theirs


def _loss(fpw: Any, mb: int, requires_grad: bool = False) -> Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(mb), requires_grad=requires_grad)
    return fpw(x).pow(2).sum()


def _bits(t: Tensor) -> Tensor:
    return t.detach().view(torch.int32)


def _cats(step: Callable[[], None]) -> int:
    with torch.autograd.profiler.profile() as prof:
        step()
    return sum(e.name == "aten::cat" for e in prof.function_events)


def test_accumulation_adds_in_place_with_no_concat_after_the_first_backward() -> None:
    ours, theirs = _pair()
    cats, grads = [], []
    for mb in range(4):
        cats.append(_cats(_loss(ours, mb).backward))
        _loss(theirs, mb).backward()
        grads.append(ours.flat_param.grad)
        assert torch.equal(_bits(ours.flat_param.grad), _bits(theirs.flat_param.grad)), f"microbatch {mb}"
    assert cats == [1, 0, 0, 0], cats  # the first backward makes .grad (as AccumulateGrad always did)
    assert all(g is grads[0] for g in grads), "the accumulated gradient must stay the same tensor"
    g = ours.flat_param.grad
    assert int(((g == 0) & g.signbit()).sum()) == 2, "the two -0.0 gradients keep their sign"
    assert int(((g == 0) & ~g.signbit()).sum()) >= 3, "the unused parameter's slice stays +0.0"


def test_post_accumulate_hooks_run_every_backward_and_see_the_sum() -> None:
    """FSDP's post-backward point is such a hook on the flat parameter: it must run in every microbatch."""
    ours, theirs = _pair()
    seen: List[Tensor] = []
    ours.flat_param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for mb in range(3):
        _loss(ours, mb).backward()
        _loss(theirs, mb).backward()
        assert len(seen) == mb + 1 and torch.equal(_bits(seen[-1]), _bits(theirs.flat_param.grad))


def test_tensor_hook_keeps_the_concatenated_gradient_of_each_backward() -> None:
    """A ``register_hook`` hook sees (and may replace) one backward's gradient before accumulation, as before."""
    ours, theirs = _pair()
    seen: List[Tensor] = []
    ours.flat_param.register_hook(lambda g: seen.append(g.clone()))
    single: List[Optional[Tensor]] = []
    for mb in range(3):
        _loss(ours, mb).backward()
        theirs.flat_param.grad = None
        _loss(theirs, mb).backward()
        single.append(theirs.flat_param.grad)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(seen, single))  # type: ignore[arg-type]


def test_autograd_grad_returns_one_backward_and_leaves_the_accumulated_gradient_alone() -> None:
    ours, theirs = _pair()
    _loss(ours, 0).backward()
    before = ours.flat_param.grad.clone()
    (g,) = torch.autograd.grad(_loss(ours, 1), [ours.flat_param])
    (expected,) = torch.autograd.grad(_loss(theirs, 1), [theirs.flat_param])
    assert torch.equal(_bits(g), _bits(expected))
    assert torch.equal(_bits(ours.flat_param.grad), _bits(before))


def test_partial_backward_without_the_flat_parameter_does_not_touch_its_gradient() -> None:
    ours, _ = _pair()
    _loss(ours, 0).backward()
    before = ours.flat_param.grad.clone()
    x = torch.randn(5, 4, requires_grad=True)
    ours(x).pow(2).sum().backward(inputs=[x])
    assert torch.equal(_bits(ours.flat_param.grad), _bits(before))
    assert x.grad is not None


def test_double_backward_into_an_accumulated_gradient_matches_split_views() -> None:
    ours, theirs = _pair()
    for fpw in (ours, theirs):
        for mb in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(mb), requires_grad=True)
            loss = fpw(x).pow(2).sum()
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)  # a gradient penalty
            (loss + gx.pow(2).sum()).backward()
    assert torch.equal(_bits(ours.flat_param.grad), _bits(theirs.flat_param.grad))
