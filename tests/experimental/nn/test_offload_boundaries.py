# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel at slice boundaries (a fuzz of experimental modules, session 45).

* With checkpointing and micro-batches, a slice that changes the number of rows (``x.reshape(-1, 4)`` of a
  ``(b, 8)`` batch) got its output gradient split by its input's rows: uneven micro-batches failed in torch's shape
  check. Compared with the plain model.
* Without checkpointing, a slice returning a list (or dict) of tensors passed them to the boundary's autograd
  Function as one non-tensor: its backward (reload the slice before its backward, drop the later one after) never
  ran. On CPU the moves are no-ops, so the calls are recorded. A tuple is handed to the next slice as one argument,
  as nn.Sequential does (spread, it failed in Sequential.forward).
"""

import copy
from collections import namedtuple
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn import OffloadModel
from fairscale.experimental.nn.offload import ModelShard

CPU = torch.device("cpu")


class RowSplit(nn.Module):
    """Row by row: ``(b, 8)`` to ``(2b, 4)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 4)


@pytest.mark.parametrize("batch", [8, 7])
def test_slice_changing_rows_with_micro_batches(batch: int) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), RowSplit(), nn.Linear(4, 3))
    model = OffloadModel(copy.deepcopy(reference), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=2)
    x = torch.randn(batch, 6)
    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


Halves = namedtuple("Halves", ["a", "b"])


class Pair(nn.Module):
    def __init__(self, container: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.container = container

    def forward(self, x: torch.Tensor) -> Any:
        y = self.fc(x)
        if self.container == "tuple":
            return y, 2 * y
        if self.container == "namedtuple":
            return Halves(y, 2 * y)
        return {"a": y, "b": 2 * y} if self.container == "dict" else [y, 2 * y]


class TakesPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, pair: Any) -> torch.Tensor:
        if isinstance(pair, Halves):
            return self.fc(pair.a + pair.b)  # by name: the type must survive the boundary
        a, b = pair.values() if isinstance(pair, dict) else pair
        return self.fc(a + b)


# A tuple was spread into the next slice's arguments (as upstream): Sequential.forward refused the pair.
@pytest.mark.parametrize("container", ["list", "dict", "tuple", "namedtuple"])
def test_container_output_crosses_the_boundary(container: str, monkeypatch: pytest.MonkeyPatch) -> None:
    moves: List[Tuple[str, int]] = []
    load, drop = ModelShard.backward_load, ModelShard.backward_drop

    def recording_load(shard: ModelShard, non_blocking: bool = True) -> None:
        moves.append(("load", shard.index))
        load(shard, non_blocking)

    def recording_drop(shard: ModelShard, non_blocking: bool = True) -> None:
        moves.append(("drop", shard.index))
        drop(shard, non_blocking)

    monkeypatch.setattr(ModelShard, "backward_load", recording_load)
    monkeypatch.setattr(ModelShard, "backward_drop", recording_drop)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), Pair(container), TakesPair())
    model = OffloadModel(copy.deepcopy(reference), CPU, num_slices=3)
    x = torch.randn(5, 4)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert moves == [("load", 2), ("drop", 2), ("load", 1), ("drop", 1), ("load", 0), ("drop", 0)], moves
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
