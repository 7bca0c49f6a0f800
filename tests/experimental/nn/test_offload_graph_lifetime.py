# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel and the autograd graph: the model keeps nothing of a forward (deepcopy failed after a training
forward), a fully frozen model's output does not require grad (as the plain model's), and with checkpointing the
requests its recomputation cannot serve (``autograd.grad``, ``backward(inputs=...)``, ``create_graph``) say so."""

import copy
import gc
import weakref
from typing import List

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import OffloadModel
from fairscale.internal.errors import FairscaleRuntimeError


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


class _Counter(nn.Module):
    """Identity that counts its calls (to see whether backward recomputes a slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_deepcopy_after_training_forward_matches_plain(checkpoint_activation: bool) -> None:
    seq = _seq()
    plain = copy.deepcopy(seq)
    model = OffloadModel(seq, torch.device("cpu"), num_slices=2, checkpoint_activation=checkpoint_activation)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    model(x)  # a forward whose backward never runs
    snapshot = copy.deepcopy(model)  # failed on the kept non-leaf activations
    torch.testing.assert_close(snapshot(x), plain(x))


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_module_keeps_no_reference_to_the_forward(checkpoint_activation: bool) -> None:
    model = OffloadModel(_seq(), torch.device("cpu"), num_slices=2, checkpoint_activation=checkpoint_activation)
    out = model(torch.randn(6, 4))
    ref = weakref.ref(out)
    out.sum().backward()
    del out
    gc.collect()
    assert ref() is None  # the model held the last output (and its graph) until the next forward
    assert not model._activations


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_frozen_model_output_matches_plain_requires_grad(checkpoint_activation: bool) -> None:
    counter = _Counter()
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 4), counter, nn.ReLU(), nn.Linear(4, 4)).requires_grad_(False)
    plain = copy.deepcopy(backbone)
    model = OffloadModel(backbone, torch.device("cpu"), num_slices=2, checkpoint_activation=checkpoint_activation)
    torch.manual_seed(1)
    head = nn.Linear(4, 2)
    plain_head = copy.deepcopy(head)
    x = torch.randn(8, 4)
    feats = model(x)
    assert feats.requires_grad == plain(x).requires_grad == False  # noqa: E712
    counter.calls = 0
    head(feats).sum().backward()
    plain_head(plain(x)).sum().backward()
    assert counter.calls == 0  # no slice reloaded or recomputed for a frozen model
    for p, q in zip(head.parameters(), plain_head.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(x).sum().backward()  # as the plain model: nothing to differentiate


def _grad_requests(model: nn.Module, x: Tensor) -> List[str]:
    errors = []
    xg = x.clone().requires_grad_(True)
    for request in ("inputs", "grad"):
        with pytest.raises(FairscaleRuntimeError, match="checkpoint_activation=True supports loss.backward"):
            out = model(xg).sum()
            if request == "inputs":
                out.backward(inputs=[xg])
            else:
                torch.autograd.grad(out, xg)
        errors.append(request)
    return errors


def test_checkpointed_partial_gradient_requests_raise_a_clear_error() -> None:
    model = OffloadModel(_seq(), torch.device("cpu"), num_slices=2, checkpoint_activation=True)
    assert _grad_requests(model, torch.randn(5, 4)) == ["inputs", "grad"]
    assert all(p.grad is None for p in model.parameters())  # refused before any gradient was written


def test_checkpointed_create_graph_warns() -> None:
    model = OffloadModel(_seq(), torch.device("cpu"), num_slices=2, checkpoint_activation=True)
    out = model(torch.randn(5, 4)).sum()
    with pytest.warns(UserWarning, match="create_graph=True back-propagates the recomputed slices"):
        torch.autograd.backward(out, create_graph=True)
    for p in model.parameters():
        p.grad = None  # breaks the parameter-gradient cycle that create_graph makes
