# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Skip connections and partitions under faults found by a review: integer tensors first in a tuple, a popped tensor
used without autograd, a partition raising a ``BaseException``, a nested tuple input. Compared with the plain
``nn.Sequential``."""

import copy
from typing import Any, Tuple

import pytest
import torch
from torch import Tensor, nn

from fairscale.nn import Pipe
from fairscale.nn.pipe.skip import pop, skippable, stash


@skippable(stash=["s"])
class _StashWithIds(nn.Module):
    """Returns ``(ids, activations)``: an integer tensor first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp: Tuple[Tensor, Tensor]) -> Any:
        ids, x = inp
        h = self.lin(x)
        yield stash("s", h)
        return ids, h * 2


class _Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        ids, x = inp
        return ids, self.lin(x)


@skippable(pop=["s"])
class _PopWithIds(nn.Module):
    def forward(self, inp: Tuple[Tensor, Tensor]) -> Any:
        ids, x = inp
        s = yield pop("s")
        return x + s


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("balance", [[1, 1, 1], [1, 2], [2, 1]])
def test_skip_across_partitions_beside_an_integer_tensor(checkpoint: str, balance: Any) -> None:
    # The portal's fork/join sat on the tuple's first tensor: an integer one carries no autograd edge, so the skip
    # path's gradient was lost silently at the stash (2.45 off) or backward failed at the pop ("grad in portal has
    # been removed or never set", or a bare AssertionError).
    torch.manual_seed(0)
    plain = nn.Sequential(_StashWithIds(), _Middle(), _PopWithIds())
    pipe = Pipe(copy.deepcopy(plain), balance, devices=["cpu"] * len(balance), chunks=2, checkpoint=checkpoint)
    ids, x = torch.arange(4), torch.randn(4, 4)
    plain((ids, x)).pow(2).sum().backward()
    pipe((ids, x)).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")


@skippable(stash=["s"])
class _Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("s", h)
        return torch.tanh(h)


@skippable(pop=["s"])
class _PopAsMask(nn.Module):
    def forward(self, x: Tensor) -> Any:
        s = yield pop("s")
        return x * (s > 0).float()  # the skip is used, but not differentiably


@pytest.mark.parametrize("balance", [[1, 2], [2, 1], [1, 1, 1]])
def test_a_popped_tensor_without_gradient(balance: Any) -> None:
    # The portals' backward took the skip's gradient for granted: a bare AssertionError (an AttributeError under
    # python -O) or "grad in portal has been removed or never set", where the plain module runs backward.
    torch.manual_seed(0)
    plain = nn.Sequential(_Stash(), nn.Linear(4, 4), _PopAsMask())
    pipe = Pipe(copy.deepcopy(plain), balance, devices=["cpu"] * len(balance), chunks=2)
    x = torch.randn(4, 4)
    plain(x).sum().backward()
    pipe(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")


class _Stop(BaseException):
    """Not an Exception: as SystemExit, or a test framework's failure."""


class _FailsOnce(nn.Module):
    failed = False

    def forward(self, x: Tensor) -> Tensor:
        if not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise _Stop("stop here")
        return x


def test_a_partition_raising_a_base_exception() -> None:
    # The worker thread caught Exception only: it died, the caller got "the worker thread ... stopped unexpectedly"
    # without the error, and the next forward waited forever on the dead thread's queue.
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), _FailsOnce()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 2)
    with pytest.raises(_Stop, match="stop here"):
        pipe(x)
    assert pipe(x).shape == (4, 2)


def test_a_nested_tuple_input_is_refused_clearly() -> None:
    pipe = Pipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=2)
    t = torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"element\(s\) \[0\] are tuples, not tensors"):
        pipe(((t,), t))  # AttributeError: 'tuple' object has no attribute 'dim' before
