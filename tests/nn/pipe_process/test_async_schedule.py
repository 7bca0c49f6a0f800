# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The building blocks of AsyncEventLoop (upstream's method names), on a one-stage gloo world.

The multi-stage protocol itself is covered by test_pipe.py: the head, middle and tail loops run through these.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.pipe.async_schedule import AsyncEventLoop, Invocation, Location, ModuleWrapper
from fairscale.nn.pipe.messages import MakeTransport
from fairscale.nn.pipe.microbatch import Batch
from fairscale.nn.pipe.skip.layout import SkipLayout
from fairscale.nn.pipe.skip.tracker import SkipTrackerThroughPotals


def _one_stage_blocks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    invocation = Invocation(order=0, this=Location(0, 0), source=None, dest=None)
    group = dist.new_group([0])
    transport = MakeTransport(use_rpc=False, worker_map=None, input_device=None, group=group)
    loop = AsyncEventLoop([ModuleWrapper(model, Location(0, 0), [invocation])], group, transport, True, 0)

    invocations, activations = loop.get_invocations_and_activations()
    assert invocations == {0: invocation}
    assert activations == {0: {0: {}}}

    trackers = [SkipTrackerThroughPotals(SkipLayout(1, {}), i) for i in range(2)]
    x = torch.rand(2, 3)
    assert loop.run_invocations_on_batch(Batch(x, 1), invocations, 0, trackers, activations) == (1, 0)
    torch.testing.assert_close(activations[0][0][1].tensor, model(x))

    # A tail without layer reuse gets no gradients back: nothing to prepare. Layer reuse is rejected clearly.
    out = activations[0][0][1]
    AsyncEventLoop.prepare_tail_backward(out, activations, invocations, {0: 1}, 0)
    with pytest.raises(NotImplementedError, match="layer reuse"):
        AsyncEventLoop.prepare_tail_backward(out, activations, invocations, {0: 1}, 2)

    # The single-stage tail computes locally and writes each micro-batch's output in place.
    batches = [Batch(torch.rand(1, 3), 0), Batch(torch.rand(1, 3), 1)]
    inputs = [b.tensor for b in batches]
    loop.event_loop_tail(batches, trackers)
    for batch, inp in zip(batches, inputs):
        torch.testing.assert_close(batch.tensor, model(inp))


def test_event_loop_blocks() -> None:
    run_distributed(_one_stage_blocks, 1)
