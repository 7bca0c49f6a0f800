# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``copy.deepcopy(pipe)``, ``torch.save(pipe)`` and pickle give a Pipe with worker threads of its own.

Both failed with "cannot pickle '_thread.lock' object" (the pipeline's worker queues).
"""

import gc
import io
import pickle
from copy import deepcopy

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe

CHUNKS = 2


def make_pipe(checkpoint: str, deferred_batch_norm: bool) -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    return Pipe(
        model,
        balance=[2, 2],
        devices=["cpu", "cpu"],
        chunks=CHUNKS,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
    )


def through_torch_save(pipe: Pipe) -> Pipe:
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def through_pickle(pipe: Pipe) -> Pipe:
    return pickle.loads(pickle.dumps(pipe))


COPIES = {"deepcopy": deepcopy, "torch.save": through_torch_save, "pickle": through_pickle}


def train_step(pipe: Pipe, x: torch.Tensor) -> torch.Tensor:
    pipe.zero_grad()
    y = pipe(x)
    y.pow(2).sum().backward()
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.1 * p.grad
    return y.detach()


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
@pytest.mark.parametrize("deferred_batch_norm", [False, True])
def test_copy_trains_as_the_original_and_on_its_own(how, checkpoint, deferred_batch_norm):
    pipe = make_pipe(checkpoint, deferred_batch_norm)
    x = torch.randn(6, 4)
    train_step(pipe, x)  # the copy starts from a pipe that has trained (statistics, partial sums)
    copied = COPIES[how](pipe)

    assert copied.pipeline.partitions == list(copied.partitions)
    assert not {id(p) for p in copied.parameters()} & {id(p) for p in pipe.parameters()}
    assert not set(map(id, copied.pipeline.in_queues)) & set(map(id, pipe.pipeline.in_queues))
    assert copied._copy_streams is copied.pipeline.copy_streams

    for _ in range(2):
        x = torch.randn(6, 4)
        y_original = train_step(pipe, x)
        y_copy = train_step(copied, x)
        assert torch.allclose(y_copy, y_original, atol=1e-6)
    for (name, a), b in zip(copied.state_dict().items(), pipe.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), name

    # A step of the copy alone leaves the original as it was.
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    train_step(copied, torch.randn(6, 4))
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not torch.equal(copied[0].weight, pipe[0].weight)


def test_copy_outlives_the_original():
    pipe = make_pipe("except_last", deferred_batch_norm=False)
    copied = deepcopy(pipe)
    x = torch.randn(6, 4)
    expected = copied(x).detach()
    del pipe
    gc.collect()
    assert torch.allclose(copied(x), expected)


def test_copy_matches_the_plain_layers_per_micro_batch():
    pipe = make_pipe("always", deferred_batch_norm=False)
    copied = deepcopy(pipe)
    plain = nn.Sequential(*[deepcopy(layer) for layer in pipe])
    x = torch.randn(6, 4)
    y = copied(x)
    y_plain = torch.cat([plain(c) for c in x.chunk(CHUNKS)])
    assert torch.allclose(y, y_plain, atol=1e-6)
    y.sum().backward()
    y_plain.sum().backward()
    for (name, p), q in zip(copied.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert all(p.grad is None for p in pipe.parameters())
    for (name, b), c in zip(copied.named_buffers(), plain.buffers()):
        assert torch.allclose(b.float(), c.float(), atol=1e-6), name
