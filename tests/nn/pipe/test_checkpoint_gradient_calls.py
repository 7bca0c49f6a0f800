# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which gradient calls a checkpointed Pipe serves, against the plain nn.Sequential.

A checkpointed micro-batch back-propagates its recomputed graph into ``.grad`` from inside the outer backward.
``torch.autograd.grad`` and ``backward(inputs=...)`` run only the nodes on a path to the requested tensors, and the
checkpointed micro-batches' parameters (used under ``no_grad``) are on none: their share went missing, silently
(off by up to 2.0 here). Those calls, and double backward, now raise; a second backward through a retained graph
works (it failed with ``IndexError: pop from an empty deque``).
"""

import copy
from typing import List, Tuple

import pytest
import torch
from torch import nn

from fairscale.nn.pipe import Pipe


def _models(checkpoint: str) -> Tuple[Pipe, nn.Sequential]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    return Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint), reference


def _input() -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


def _grads(module: nn.Module) -> List[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_autograd_grad_raises(checkpoint: str) -> None:
    pipe, _ = _models(checkpoint)
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad\(\) or backward\(inputs=...\) would silently miss"):
        torch.autograd.grad(pipe(_input()).sum(), list(pipe.parameters()))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_backward_with_inputs_raises(checkpoint: str) -> None:
    pipe, _ = _models(checkpoint)
    with pytest.raises(RuntimeError, match="checkpoint='never'"):
        pipe(_input()).sum().backward(inputs=list(pipe.parameters()))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_double_backward_raises(checkpoint: str) -> None:
    pipe, _ = _models(checkpoint)
    x = _input().requires_grad_()
    out = pipe(x).pow(2).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True \(double backward\)"):
        torch.autograd.backward(out, create_graph=True)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_retain_graph_twice_adds_up(checkpoint: str) -> None:
    pipe, reference = _models(checkpoint)
    x = _input()
    out, ref_out = pipe(x).pow(2).sum(), reference(x).pow(2).sum()
    out.backward(retain_graph=True)
    out.backward()
    ref_out.backward(retain_graph=True)
    ref_out.backward()
    for mine, expected in zip(_grads(pipe), _grads(reference)):
        torch.testing.assert_close(mine, expected)


def test_without_checkpointed_micro_batches_autograd_grad_works() -> None:
    """'never', an eval-mode forward and chunks=1 with 'except_last' checkpoint nothing: nothing is refused."""
    for checkpoint, chunks, train in (("never", 2, True), ("always", 2, False), ("except_last", 1, True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
        reference = copy.deepcopy(model)
        pipe = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint).train(train)
        reference.train(train)
        x = _input().requires_grad_()
        got = torch.autograd.grad(pipe(x).sum(), [x] + list(pipe.parameters()))
        expected = torch.autograd.grad(reference(x).sum(), [x] + list(reference.parameters()))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
