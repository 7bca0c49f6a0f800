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
    _assert_grads_like_plain(nn.Sequential(_StashWithIds(), _Middle(), _PopWithIds()), balance, checkpoint)


def _assert_grads_like_plain(plain: nn.Sequential, balance: Any, checkpoint: str) -> None:
    """Pipe over a copy of ``plain`` on ``(ids, x)``: the parameters' gradients are the plain module's."""
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


@skippable(stash=["s"])
class _StashBesideRawInput(nn.Module):
    """Stashes a layer's output and passes its input on: nothing it returns requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp: Tuple[Tensor, Tensor]) -> Any:
        ids, x = inp
        yield stash("s", self.lin(x))
        return ids, x


@skippable(pop=["s"])
class _PopBesideRawInput(nn.Module):
    def forward(self, inp: Tuple[Tensor, Tensor]) -> Any:
        ids, x = inp
        s = yield pop("s")
        return x + s


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_skip_beside_an_integer_tensor_when_nothing_requires_grad(checkpoint: str) -> None:
    # With no tensor of the tuple requiring grad the portal's join fell back to the first one, the integer ids,
    # and was dropped with them: the stashing layer's gradient was wrong (except_last) or backward found no graph
    # ("never"), silently or not (found by a fuzz of Pipe, session 43). The first floating tensor carries it now.
    torch.manual_seed(0)
    _assert_grads_like_plain(nn.Sequential(_StashBesideRawInput(), _PopBesideRawInput()), [1, 1], checkpoint)


@skippable(stash=["s"])
class _StashEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: Tensor) -> Any:
        yield stash("s", self.emb(ids))
        return ids  # the whole activation is integer


@skippable(pop=["s"])
class _PopEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: Tensor) -> Any:
        s = yield pop("s")
        return self.emb(ids) + s


def test_skip_across_partitions_beside_integer_activations_only_is_refused() -> None:
    # Nothing can carry the skip's gradient back to the stash: its layer got no gradient (None), silently.
    torch.manual_seed(0)
    model = nn.Sequential(_StashEmbedding(), _PopEmbedding())
    pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    ids = torch.randint(0, 10, (4, 3))
    with pytest.raises(TypeError, match="skip 's' crosses partitions and needs a gradient.*floating-point tensor"):
        pipe(ids)
    with torch.no_grad():  # no gradient needed: fine
        assert pipe(ids).shape == (4, 3, 4)
    one_partition = Pipe(copy.deepcopy(model), [2], devices=["cpu"], chunks=2)
    one_partition(ids).sum().backward()
    assert one_partition[0].module.emb.weight.grad is not None


class _Nothing(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        return ()


def test_an_empty_tuple_between_partitions_is_refused_clearly() -> None:
    pipe = Pipe(nn.Sequential(_Nothing(), nn.Identity()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match="output of partition 0 is an empty tuple"):
        pipe(torch.randn(4, 2))  # a bare IndexError before
