# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pipe frees what nn.Sequential frees (found by a fuzz of Pipe, session 44).

* A worker thread kept its last micro-batch (and, without a backward, that micro-batch's whole graph) in its loop's
  locals until the next forward.
* With checkpointing decided per partition, a skip's portal kept a hand-out for a recomputation that never came:
  the skip tensor stayed alive as long as the output.
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe
from fairscale.nn.pipe.skip import skippable, stash

from ._util import PopAdd

ALIVE: list = []


class Probe(nn.Module):
    """Records a weak reference to each activation it makes (the next Linear saves it for backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        ALIVE.append(weakref.ref(y))
        return y


def _alive() -> int:
    gc.collect()
    return sum(ref() is not None for ref in ALIVE)


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_activations_are_freed_with_the_output(checkpoint, backward):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 4), Probe(), nn.Linear(4, 4), Probe())
    pipe = Pipe(model, [2, 4], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    ALIVE.clear()
    out = pipe(torch.randn(4, 4))
    if backward:
        out.sum().backward()
    del out
    assert _alive() == 0


@skippable(stash=["s"])
class StashDouble(nn.Module):
    def forward(self, x):
        s = x * 2
        ALIVE.append(weakref.ref(s))
        yield stash("s", s)
        return x  # noqa: B901


def test_skip_of_frozen_partitions_is_freed_after_backward():
    # Stash and pop in frozen partitions (run without checkpointing), then a trainable checkpointed one.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), StashDouble(), nn.Linear(4, 4), PopAdd(), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 2, 1], devices=["cpu"] * 3, chunks=2, checkpoint="except_last")
    ALIVE.clear()
    out = pipe(torch.randn(6, 4))
    out.sum().backward()
    assert _alive() == 0  # as nn.Sequential: the output is still referenced, the skips are not
    x = torch.randn(6, 4)
    reference(x).sum().backward()
    model.zero_grad()
    pipe(x).sum().backward()
    torch.testing.assert_close(model[4].weight.grad, reference[4].weight.grad)


def _async_pipe_last_stage_frees_each_step(rank: int, world_size: int, checkpoint: str) -> None:
    import torch.distributed as dist

    from fairscale.nn.pipe import AsyncPipe

    torch.manual_seed(0)
    # The last Probe's output is the stage's output: what the event loop kept.
    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 4), nn.Linear(4, 4), Probe())
    pipe = AsyncPipe(model, [2, 3], group=dist.group.WORLD, chunks=2, checkpoint=checkpoint)
    for _ in range(3):
        ALIVE.clear()
        out = pipe(torch.randn(4, 4))
        if pipe.final_stage:
            out.sum().backward()
        else:
            pipe.back_helper(out)
        del out
        assert _alive() == 0, f"stage {rank} keeps {_alive()} activations of a finished step"
    dist.barrier()


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_async_pipe_last_stage_frees_each_step(checkpoint):
    """AsyncPipe's last stage kept every step's outputs (and their graph) in its event loop, in a reference cycle
    through the autograd graph that the garbage collector cannot see: memory grew by one output per step (a leak
    fuzz, session 49)."""
    from fairscale.fair_dev.testing.engine import run_distributed

    run_distributed(_async_pipe_last_stage_frees_each_step, 2, checkpoint, timeout=120.0)
