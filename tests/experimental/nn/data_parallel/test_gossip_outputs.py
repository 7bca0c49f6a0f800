# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's end-of-backward work (the gradient averaging inside a node) runs whatever container the module returns.

Before, the hooks that queue it were put only on tensors directly in lists, tuples and dicts: a dataclass output (a
model-output record) or any other object left it unhooked, and each rank kept its own gradients (the weights
drifted apart, silently). Now dataclasses and every container ``torch.utils._pytree`` knows are walked, and an
output with no tensor to hook raises in training instead.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import collections
import dataclasses
from typing import Any, List, NamedTuple, Optional

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip._backward_callback import output_tensors
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.errors import FairscaleTypeError

TIMEOUT = 60.0


@dataclasses.dataclass
class Record:
    logits: torch.Tensor
    extra: Optional[Any] = None


class Pair(NamedTuple):
    first: Any
    second: Any


class Holder:
    """An object pytree does not know, holding the output tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class TensorList(list):
    """A list subclass: pytree leaves it whole."""


def _wrap(kind: str, y: torch.Tensor) -> Any:
    if kind == "dataclass":
        return Record(y)
    if kind == "nested":  # a dataclass inside pytree containers, inside a dataclass
        return Record(y.detach(), extra=[{"aux": Pair(1, Record(y))}])
    if kind == "ordered_dict":
        return collections.OrderedDict(out=collections.deque([y]))
    if kind == "object":
        return Holder(y)
    if kind == "detached":
        return (y.detach(), Holder(y))
    if kind == "predictions":  # no tensor that needs grad, nothing hidden: a prediction call in training mode
        return {"label": y.argmax(-1), "name": "fc", "n": 1, "none": None}
    raise ValueError(kind)


def _unwrap(kind: str, out: Any) -> torch.Tensor:
    if kind == "dataclass":
        return out.logits
    if kind == "nested":
        return out.extra[0]["aux"].second.logits
    if kind == "ordered_dict":
        return out["out"][0]
    if kind == "object":
        return out.t
    return out[1].t


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1, bias=False)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return _wrap(self.kind, self.fc(x))


def _data(rank: int) -> torch.Tensor:
    return torch.randn(3, 2, generator=torch.Generator().manual_seed(10 + rank))


def _averaged_world(rank: int, world_size: int, kinds: List[str]) -> None:
    """One node of ``world_size`` processes: each rank's gradient must be the mean of the ranks' plain gradients."""
    for kind in kinds:
        torch.manual_seed(0)
        net = Net(kind)
        reference = [p.detach().clone() for p in net.parameters()]
        model = gossip.SlowMoDistributedDataParallel(net, nprocs_per_node=world_size)
        _unwrap(kind, model(_data(rank))).pow(2).sum().backward()
        # The plain-PyTorch reference: every rank's gradient, computed here, averaged.
        expected = torch.zeros_like(reference[0])
        for r in range(world_size):
            w = reference[0].clone().requires_grad_(True)
            (_data(r) @ w.t()).pow(2).sum().backward()
            assert w.grad is not None
            expected += w.grad / world_size
        grad = net.fc.weight.grad
        assert grad is not None
        if not torch.allclose(grad, expected):
            raise AssertionError(f"{kind}: rank {rank} gradient {grad.tolist()}, expected {expected.tolist()}")


@pytest.mark.parametrize("kind", ["dataclass", "nested", "ordered_dict"])
def test_gradients_are_averaged_for_container_outputs(kind: str) -> None:
    run_distributed(_averaged_world, 2, [kind], timeout=TIMEOUT)


def _unhookable_world(rank: int, world_size: int, kind: str) -> None:
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(Net(kind), nprocs_per_node=world_size)
    with pytest.raises(FairscaleTypeError, match=r"output \((Holder|tuple)\) holds no tensor that requires grad"):
        model(_data(rank))
    # Forwards that no backward follows are fine: in eval mode, or without autograd.
    model.eval()
    model(_data(rank))
    model.train()
    with torch.no_grad():
        model(_data(rank))


@pytest.mark.parametrize("kind", ["object", "detached"])
def test_output_without_hookable_tensor_raises_in_training(kind: str) -> None:
    run_distributed(_unhookable_world, 2, kind, timeout=TIMEOUT)


def test_output_tensors_walks_each_tensor_once() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    record = Record(a)
    record.extra = {"self": record, "again": [a, b], "pair": Pair(b, "text")}  # a cycle, and repeats
    found = output_tensors([record, (a,), {"k": Record(b)}])
    assert len(found) == 2 and found[0] is a and found[1] is b
    c = torch.ones(3)
    found = output_tensors(TensorList([Record(c)]))  # a list subclass, which pytree leaves whole
    assert len(found) == 1 and found[0] is c


def _predictions_world(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = gossip.SlowMoDistributedDataParallel(Net("predictions"), nprocs_per_node=world_size)
    out = model(_data(rank))  # returned, as upstream (no backward can follow it)
    assert out["label"].dtype == torch.int64 and out["name"] == "fc"


def test_an_output_that_needs_no_gradient_is_returned() -> None:
    run_distributed(_predictions_world, 2, timeout=TIMEOUT)
