# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A popped skip whose use reaches nothing gives the layers before its stash no gradient (None), as nn.Sequential.

Its portal materialised the missing gradient as zeros, and the layers feeding the skip got a zero ``.grad`` (found
by a fuzz of Pipe, session 44).
"""

import copy

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe
from fairscale.nn.pipe.skip import Namespace, pop, skippable

from .._util import PopAdd, StashInput


@skippable(pop=["s"])
class PopIgnoringInput(nn.Module):
    def forward(self, x):
        s = yield pop("s")
        return s  # noqa: B901


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_layers_feeding_an_ignored_pop_get_none(checkpoint):
    a, b = Namespace(), Namespace()
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(4, 4),
        StashInput().isolate(a),
        nn.Linear(4, 4),  # reaches the output only through PopAdd(b)'s result, which PopIgnoringInput(a) drops
        StashInput().isolate(b),
        PopAdd().isolate(b),
        PopIgnoringInput().isolate(a),
    )
    x = torch.randn(4, 4)
    ref(x).sum().backward()
    assert ref[2].weight.grad is None
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    Pipe(model, [4, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)(x).sum().backward()
    assert model[2].weight.grad is None and model[2].bias.grad is None
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
