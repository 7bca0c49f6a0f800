# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A checkpointed micro-batch is recomputed with the ``training`` flags its forward ran with.

The sequence is a training forward, ``eval()`` (and a validation pass), then the backward of the training forward:
the gradients must be those of the forward that was recorded, as with ``checkpoint="never"`` and as with the plain
layers run per micro-batch.
"""

from copy import deepcopy

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe

CHUNKS = 2


def make_model(dropout: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5) if dropout else nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def train_forward_eval_backward(module: nn.Module, x: torch.Tensor, forward_per_micro_batch: bool) -> None:
    """Forward in training mode, validate in eval mode, run the training forward's backward, train again."""
    torch.manual_seed(1)
    if forward_per_micro_batch:
        y = torch.cat([module(c) for c in x.chunk(CHUNKS)])
    else:
        y = module(x)
    module.eval()
    with torch.no_grad():
        module(x)  # the validation pass
    (y * torch.arange(1.0, 4.0)).sum().backward()
    assert not any(m.training for m in module.modules()), "the recomputation left a module in training mode"
    module.train()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_backward_after_eval_matches_the_plain_layers(checkpoint):
    plain = make_model(dropout=False)
    pipe = Pipe(deepcopy(plain), balance=[2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint=checkpoint)
    x = torch.randn(8, 4)
    train_forward_eval_backward(pipe, x, forward_per_micro_batch=False)
    train_forward_eval_backward(plain, x, forward_per_micro_batch=True)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    bn, plain_bn = pipe[1], plain[1]
    assert int(bn.num_batches_tracked) == int(plain_bn.num_batches_tracked) == CHUNKS
    assert torch.allclose(bn.running_mean, plain_bn.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, plain_bn.running_var, atol=1e-6)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("deferred_batch_norm", [False, True])
def test_backward_after_eval_matches_checkpoint_never(checkpoint, deferred_batch_norm):
    x = torch.randn(8, 4)
    pipes = {}
    for mode in (checkpoint, "never"):
        pipes[mode] = Pipe(
            make_model(dropout=True),
            balance=[3, 1],
            devices=["cpu", "cpu"],
            chunks=CHUNKS,
            checkpoint=mode,
            deferred_batch_norm=deferred_batch_norm,
        )
        train_forward_eval_backward(pipes[mode], x, forward_per_micro_batch=False)
    for (name, p), q in zip(pipes[checkpoint].named_parameters(), pipes["never"].parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    for (name, b), c in zip(pipes[checkpoint].named_buffers(), pipes["never"].buffers()):
        assert torch.allclose(b.float(), c.float(), atol=1e-6), name


def test_a_layer_switched_to_eval_alone_is_recomputed_in_training_mode():
    # Freezing a batch norm (bn.eval()) between a forward and its backward: the layer's own flag is replayed, the
    # others are left alone, and the layer is in eval mode again afterwards.
    plain = make_model(dropout=False)
    pipe = Pipe(deepcopy(plain), balance=[2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint="always")
    x = torch.randn(8, 4)
    y = pipe(x)
    pipe[1].eval()
    y.sum().backward()
    assert not pipe[1].training and pipe[0].training and pipe.partitions[0].training
    torch.cat([plain(c) for c in x.chunk(CHUNKS)]).sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_backward_inside_autocast_recomputes_as_the_forward_ran(checkpoint):
    """The partitions run on worker threads, which an autocast entered by the caller does not reach (fp32 forward);
    the backward runs with the caller's autocast state, so a backward inside the block recomputed the checkpointed
    micro-batches in bfloat16, and their gradients were not those of the fp32 forward."""
    x = torch.randn(8, 4)
    grads = {}
    for mode in ("never", checkpoint):
        pipe = Pipe(make_model(dropout=False), balance=[2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint=mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = pipe(x)
            assert y.dtype == torch.float32  # the forward ignored the caller's autocast (as upstream)
            (y * torch.arange(1.0, 4.0)).sum().backward()
        grads[mode] = [p.grad.clone() for p in pipe.parameters()]
    for got, want in zip(grads[checkpoint], grads["never"]):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
