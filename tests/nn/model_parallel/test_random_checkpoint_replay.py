# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``model_parallel.random.checkpoint`` against the plain call (a fuzz of model parallel and checkpointing, session 45).

* a second backward through a retained graph recomputed dropout under the tracker's ``fork()`` with another mask;
* batch-norm running statistics were updated by the forward and again by each recomputation;
* with no input requiring grad, the parameters inside silently got no gradient.
"""

import contextlib
import functools
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairscale.nn.model_parallel.random import checkpoint, get_cuda_rng_tracker

_STREAM = "replay-test-rng"


@contextlib.contextmanager
def _tracker_stream() -> Iterator[None]:
    """A tracker stream of this test's own; the process's generators and the tracker are left as they were."""
    tracker = get_cuda_rng_tracker()
    cpu_state, states, seeds = torch.get_rng_state(), tracker.get_states(), set(tracker.seeds_)
    tracker.add(_STREAM, 4545)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        tracker.reset()
        tracker.set_states(states)
        tracker.seeds_ = seeds


class _ForkedDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork(_STREAM):
            return F.dropout(self.linear(x), 0.5, training=True)


def _grads(module: nn.Module, x: torch.Tensor) -> "list[torch.Tensor]":
    return [t.grad.clone() for t in [x, *module.parameters()]]


def test_second_backward_through_retained_graph_replays_the_tracker_dropout() -> None:
    torch.manual_seed(0)
    module = _ForkedDropout()
    x = torch.randn(4, 8, requires_grad=True)
    with _tracker_stream():
        streams = get_cuda_rng_tracker().get_states()
        plain = module(x)
        plain.sum().backward(retain_graph=True)
        plain_first = _grads(module, x)
        plain.sum().backward()
        plain_second = _grads(module, x)  # accumulated over both backward passes
        x.grad = None
        module.zero_grad(set_to_none=True)
        get_cuda_rng_tracker().set_states(streams)
        out = checkpoint(module, x)
        assert torch.equal(out, plain)
        out.sum().backward(retain_graph=True)
        assert all(torch.allclose(a, b) for a, b in zip(_grads(module, x), plain_first))
        # The second recomputation replayed a tracker stream the first one had advanced: another mask.
        out.sum().backward()
        assert all(torch.allclose(a, b) for a, b in zip(_grads(module, x), plain_second))


def test_batch_norm_running_stats_are_updated_once_as_by_the_plain_call() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    checkpointed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    checkpointed.load_state_dict(plain.state_dict())
    x = torch.randn(8, 4, requires_grad=True)
    for _ in range(2):
        plain_out = plain(x)
        plain_out.sum().backward(retain_graph=True)
        plain_out.sum().backward()
        out = checkpoint(checkpointed, x)
        # Two backward passes, so two recomputations, besides the forward: each updated the statistics once more.
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    bn, ref = checkpointed[1], plain[1]
    assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 2
    assert torch.allclose(bn.running_mean, ref.running_mean) and torch.allclose(bn.running_var, ref.running_var)
    assert torch.allclose(checkpointed[0].weight.grad, plain[0].weight.grad)


def _linear_then_tanh(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x).tanh()


def test_parameters_get_gradients_when_no_input_requires_grad() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)  # e.g. features from a frozen stem
    _linear_then_tanh(layer, x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    # A module, and a callable that is not one (its parameters cannot be listed).
    for function in (layer, functools.partial(_linear_then_tanh, layer)):
        layer.zero_grad(set_to_none=True)
        out = checkpoint(function, x)
        if function is layer:
            out = out.tanh()
        assert out.requires_grad
        out.square().sum().backward()
        assert all(p.grad is not None and torch.allclose(p.grad, e) for p, e in zip(layer.parameters(), expected))
    assert x.grad is None


def test_non_tensor_argument_is_refused_clearly() -> None:
    # save_for_backward's error named neither checkpoint nor the argument (a fuzz, session 45).
    layer = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"argument 1 is a int; the checkpointed function's arguments must be tensors"):
        checkpoint(lambda x, k: layer(x) * k, torch.randn(2, 4), 3)
    out = checkpoint(lambda x, none: layer(x), torch.randn(2, 4, requires_grad=True), None)  # None is kept
    out.sum().backward()
