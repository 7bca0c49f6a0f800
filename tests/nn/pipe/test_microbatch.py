# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
from typing import Tuple

import pytest
import torch
import torch.nn as nn

from fairscale.nn.pipe import Pipe
from fairscale.nn.pipe.microbatch import Batch, check, gather, scatter


def test_batch_atomic():
    x = torch.tensor(42)
    b = Batch(x, 0)
    assert b.atomic
    assert b.tensor is x
    with pytest.raises(AttributeError, match="batch is atomic"):
        b.tensors
    assert list(b) == [x]
    assert len(b) == 1
    assert b[0] is x
    with pytest.raises(IndexError, match="atomic batch allows index 0 only"):
        b[1]
    assert repr(b) == "Batch[atomic=True](tensor(42))"
    assert b.index == 0
    with pytest.raises(AttributeError):
        b.index = 1


def test_batch_non_atomic():
    x, y = torch.tensor(42), torch.tensor(21)
    b = Batch((x, y), 3)
    assert not b.atomic
    with pytest.raises(AttributeError, match="not atomic batch"):
        b.tensor
    assert b.tensors == (x, y)
    assert list(b) == [x, y]
    assert len(b) == 2
    assert b[0] is x and b[1] is y
    assert b.tensor_or_tensors == (x, y)
    assert b.index == 3


def test_batch_call():
    a = Batch(torch.tensor(42), 0)
    b = Batch((torch.tensor(42), torch.tensor(21)), 0)

    def f(x):
        return x

    assert a.call(f).atomic
    assert not b.call(f).atomic


def test_batch_setitem_by_index():
    a = Batch(torch.tensor(42), 0)
    b = Batch((torch.tensor(42), torch.tensor(21)), 0)
    a[0] = torch.tensor(0)
    b[0] = torch.tensor(0)
    assert a.atomic and a[0].item() == 0
    assert not b.atomic and len(b) == 2 and b[0].item() == 0 and b[1].item() == 21
    with pytest.raises(IndexError, match="atomic batch allows index 0 only"):
        a[1] = torch.tensor(1)


def test_batch_setitem_by_slice():
    a = Batch(torch.tensor(42), 0)
    b = Batch((torch.tensor(42), torch.tensor(21)), 0)
    a[:] = (torch.tensor(0),)
    b[:] = (torch.tensor(0),)
    assert a.atomic and a[0].item() == 0
    assert not b.atomic and len(b) == 1 and b[0].item() == 0
    with pytest.raises(IndexError, match="atomic batch cannot be replaced with multiple tensors"):
        a[:] = (torch.tensor(0), torch.tensor(1))
    with pytest.raises(NotImplementedError, match=r"only slice \[:\] supported"):
        b[1:] = (torch.tensor(0),)


def test_check():
    check(torch.tensor(42))
    check((torch.tensor(4), torch.tensor(2)))
    check((torch.tensor(4), (torch.tensor(2),)))  # nested tuples pass the check (upstream behaviour)
    with pytest.raises(TypeError, match="expected Tensor, but got int"):
        check(42)
    with pytest.raises(TypeError, match="expected Tensor, but got str"):
        check("str")
    with pytest.raises(TypeError):
        check((torch.tensor(4), 2))
    with pytest.raises(TypeError, match="expected Tensor, but got list"):
        check([torch.tensor(1)])


def test_gather_tensors():
    a = torch.zeros(1, 1)
    b = torch.zeros(1, 1)
    ab = gather([Batch(a, 0), Batch(b, 1)])
    assert ab.size() == (2, 1)


def test_gather_tuples():
    a = (torch.zeros(1, 1), torch.zeros(2, 2))
    b = (torch.zeros(1, 1), torch.zeros(2, 2))
    ab = gather([Batch(a, 0), Batch(b, 1)])
    assert isinstance(ab, tuple)
    assert ab[0].size() == (2, 1)
    assert ab[1].size() == (4, 2)


def test_scatter_tensor():
    a, b = scatter(torch.zeros(2, 1), chunks=2)
    assert a.tensor.size() == (1, 1) and b.tensor.size() == (1, 1)
    assert (a.index, b.index) == (0, 1)


def test_scatter_tuple():
    ab = (torch.zeros(2, 1), torch.zeros(4, 2))
    a, b = scatter(ab, chunks=2)
    assert a.tensors[0].size() == (1, 1) and b.tensors[0].size() == (1, 1)
    assert a.tensors[1].size() == (2, 2) and b.tensors[1].size() == (2, 2)


def test_scatter_sizes_and_truncation():
    assert [b.tensor.size(0) for b in scatter(torch.zeros(7, 1), 4)] == [2, 2, 2, 1]
    assert [b.tensor.size(0) for b in scatter(torch.zeros(5, 1), 4)] == [2, 2, 1]
    assert len(scatter(torch.zeros(2, 1), 4)) == 2
    # Tuples are zipped: tensors that split into other numbers of chunks are refused (upstream truncated to the
    # fewest, silently dropping rows); other batch sizes with as many chunks still work (test_scatter_tuple).
    with pytest.raises(ValueError, match=r"\[8, 2\] rows and split into \[4, 2\] micro-batches at chunks=4"):
        scatter((torch.zeros(8, 1), torch.zeros(2, 1)), 4)


class _Pair(nn.Module):
    def forward(self, a_and_b: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        return a_and_b


def test_pipe_refuses_inputs_it_cannot_split_whole() -> None:
    """An 8-row and a 2-row input at chunks=4: nn.Sequential returns both whole, upstream's Pipe 4 and 2 rows."""
    pipe = Pipe(nn.Sequential(_Pair(), _Pair()), balance=[1, 1], devices=["cpu", "cpu"], chunks=4)
    with pytest.raises(ValueError, match="rows past the shortest would be dropped"):
        pipe((torch.ones(8, 1), torch.ones(2, 1)))
    a, b = pipe((torch.ones(8, 1), torch.ones(4, 2)))  # other batch sizes splitting alike still run, as upstream
    assert a.shape == (8, 1) and b.shape == (4, 2)
    with pytest.raises(ValueError, match="empty tuple"):  # IndexError in gather before
        pipe(())
    with pytest.raises(ValueError, match="0-d"):  # torch's chunk error before
        pipe(torch.tensor(3.0))
