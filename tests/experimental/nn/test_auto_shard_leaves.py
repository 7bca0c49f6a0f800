# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""shard_model: a sub-module that fx cannot trace becomes a leaf whatever error its trace raises (``len(x)`` raises
RuntimeError, which upstream did not catch, so the whole call failed); an untraceable root still fails."""

from typing import Callable, List

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn.auto_shard import shard_model


class _Sub(nn.Module):
    def __init__(self, op: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return self.op(self.linear(x))


class _Net(nn.Module):
    def __init__(self, op: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), _Sub(op), nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _divide_by_len(x: Tensor) -> Tensor:
    return x / len(x)


class _UntraceableRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) / len(x)


def test_len_in_a_sub_module_makes_it_a_leaf() -> None:
    torch.manual_seed(0)
    net = _Net(_divide_by_len)
    shards = shard_model(net, 2)
    assert len(shards) == 2
    # The sub-module is called as a whole (a leaf), not inlined.
    called = [n.target for s in shards for n in s.graph.nodes if n.op == "call_module"]
    assert "layers.1" in called
    x = torch.randn(3, 8)
    out = x
    for shard in shards:
        out = shard(out)
    torch.testing.assert_close(out, net(x))
    # Catching every error of the probe traces does not hide a root that cannot be traced: fx's error comes out.
    root: List[torch.fx.GraphModule] = []
    with pytest.raises(RuntimeError, match="'len' is not supported in symbolic tracing"):
        root = shard_model(_UntraceableRoot(), 2)
    assert not root
