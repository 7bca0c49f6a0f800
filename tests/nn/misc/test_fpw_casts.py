# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper after ``.double()`` / ``.to(dtype)``, outside and inside ``unflatten_params()``, against the
plain module.

Found by the sequence review (findings 2 and 5): after a cast the modules kept views of the old flat storage (stale
reads, in-place writes such as ``reset_parameters()`` lost, old storage kept alive), and a cast made inside
``unflatten_params()`` was undone on exit for the parameters while the buffers kept it.
"""

import copy
from typing import Any

import torch
import torch.nn as nn

from fairscale.nn.misc import FlattenParamsWrapper


def _mlp() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


def test_module_reads_and_writes_follow_a_cast() -> None:
    ref = _mlp()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    fpw.double()
    ref.double()
    # Reads through the module see the converted parameters...
    assert fpw.module[0].weight.dtype == torch.float64
    assert torch.equal(fpw.module[0].weight, ref[0].weight)
    storage = fpw.flat_param.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in fpw.module._unflattened_param_views)
    # ... and an in-place edit through the module reaches the flat parameter, as it reaches the plain parameter.
    with torch.no_grad():
        fpw.module[3].weight.fill_(0.5)
        ref[3].weight.fill_(0.5)
    torch.manual_seed(1)
    fpw.module[0].reset_parameters()
    torch.manual_seed(1)
    ref[0].reset_parameters()
    sd, ref_sd = fpw.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    ref.eval()
    fpw.eval()
    x = torch.randn(5, 3, dtype=torch.float64)
    assert torch.equal(fpw(x), ref(x))


def test_a_cast_to_bfloat16_keeps_edits_made_through_the_module() -> None:
    ref = _mlp()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    fpw(torch.randn(2, 3))  # views of a forward exist
    fpw.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    with torch.no_grad():
        fpw.module[3].weight.mul_(2)
        ref[3].weight.mul_(2)
    assert torch.equal(fpw.state_dict()["3.weight"], ref.state_dict()["3.weight"])


def test_a_cast_inside_unflatten_params_outlives_the_context() -> None:
    ref = _mlp()
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    with fpw.unflatten_params():
        fpw.double()
        assert fpw.module[0].weight.dtype == torch.float64
        with torch.no_grad():
            fpw.module[0].weight.add_(1.0)  # an edit after the cast is kept too
    ref.double()
    with torch.no_grad():
        ref[0].weight.add_(1.0)
    assert fpw.is_flattened and fpw.flat_param.dtype == torch.float64
    x = torch.randn(5, 3, dtype=torch.float64)
    out = fpw(x)
    expected = ref(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.equal(fpw.flat_param.grad, grads)
    sd, ref_sd = fpw.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(sd[k].dtype == ref_sd[k].dtype and torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
