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


def test_replaced_flat_parameter_is_refused() -> None:
    """A flat parameter replaced on the wrapper (functional_call with its name, an assignment, a parametrization) was
    ignored by the forward, which computed with the wrapper's own, silently; the substitute got no gradient."""
    fpw: Any = FlattenParamsWrapper(_seq())
    x = torch.randn(4, 2)
    zeros = {"flat_param_0": torch.zeros_like(fpw.flat_param)}
    with pytest.raises(ValueError, match="flat_param_0 is not the flat parameter the wrapper made"):
        torch.func.functional_call(fpw, zeros, (x,))
    assert fpw._parameters["flat_param_0"] is fpw.flat_params[0]  # functional_call put the wrapper's back
    fpw(x).sum().backward()  # and the wrapper still trains
    assert fpw.flat_param.grad is not None
    fpw.flat_param_0 = nn.Parameter(torch.zeros_like(fpw.flat_param))
    with pytest.raises(ValueError, match="copy them into the flat parameter in place"):
        fpw(x)


def test_sparse_embedding_is_refused_unless_left_out() -> None:
    """A flat parameter's gradient is dense: the first backward failed with "reshape is not implemented for sparse
    tensors". The wrapper refuses it at construction, naming the layer; left out of param_list, it trains."""
    net = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    with pytest.raises(ValueError, match="weight of 0, an Embedding with sparse=True"):
        FlattenParamsWrapper(net)
    fpw: Any = FlattenParamsWrapper(net, param_list=list(net[1].parameters()))
    fpw(torch.tensor([[1, 2]])).sum().backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.is_sparse


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "jvp"])
def test_torch_func_transforms(transform: str) -> None:
    """vmap, jacrev and jvp over the wrapper give the unwrapped module's results (they raised: the views' autograd
    function has no setup_context; inside a transform the views are upstream's split views)."""
    ref = _seq()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    x = torch.randn(4, 2)
    run = {
        "vmap": lambda m: torch.func.vmap(m)(x),
        "jacrev": lambda m: torch.func.jacrev(m)(x[0]),
        "jvp": lambda m: torch.func.jvp(m, (x,), (torch.ones_like(x),))[1],
    }[transform]
    torch.testing.assert_close(run(fpw), run(ref))
