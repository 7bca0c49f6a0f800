# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The model-parallel RNG tracker on the device RNG (the CPU generator here): upstream's checks, on CPU.

Without an accelerator the tracker, ``model_parallel_cuda_manual_seed`` and the checkpoint work on the CPU
generator (upstream raised or did nothing there). A 4-rank world at model-parallel size 2 checks that dropout
inside ``fork()`` agrees across data-parallel replicas and differs across the model-parallel group, and that the
checkpoint replays the same masks.
"""

import contextlib
from typing import Any, Iterator, List

import pytest
import torch
import torch.nn.functional as F

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.device import rng_device, rng_get_state, rng_set_state
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel import random
from fairscale.nn.model_parallel.random import (
    CheckpointFunction,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)


@contextlib.contextmanager
def _fresh_rng() -> Iterator[None]:
    """Leave the process's generators and the tracker as they were (these tests run in the pytest process)."""
    state, device_state = torch.get_rng_state(), rng_get_state()
    tracker_states = get_cuda_rng_tracker().get_states()
    try:
        yield
    finally:
        torch.set_rng_state(state)
        rng_set_state(device_state)
        get_cuda_rng_tracker().reset()
        get_cuda_rng_tracker().set_states(tracker_states)


def test_set_cuda_rng_state() -> None:
    # The tracker's generator is the accelerator's where there is one (.ci/cuda-checks runs this next to a GPU with
    # FAIRSCALE_CPU_ONLY=0), else the CPU's: draw where it draws.
    device = rng_device()
    with _fresh_rng():
        saved = random._get_rng_state()
        saved_copy = saved.clone()
        first = [torch.randn(123, device=device) for _ in range(5)]
        assert not torch.equal(random._get_rng_state(), saved)
        for _ in range(2):
            random._set_cuda_rng_state(saved)
            again = [torch.randn(123, device=device) for _ in range(5)]
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert torch.equal(saved, saved_copy)  # the caller's state is not modified


def test_cuda_rng_tracker() -> None:
    seed_1, seed_2, size, device = 1234, 4321, (12, 21), rng_device()
    with _fresh_rng():
        torch.manual_seed(seed_1)
        stream_1 = [torch.randn(size, device=device) for _ in range(3)]
        torch.manual_seed(seed_2)
        stream_2 = [torch.randn(size, device=device) for _ in range(3)]
        torch.manual_seed(seed_1)
        tracker = get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("test", seed_2)
        interleaved_1, interleaved_2 = [], []
        for _ in range(3):
            interleaved_1.append(torch.randn(size, device=device))
            with tracker.fork("test"):
                interleaved_2.append(torch.randn(size, device=device))
        assert all(torch.equal(a, b) for a, b in zip(stream_1, interleaved_1))
        assert all(torch.equal(a, b) for a, b in zip(stream_2, interleaved_2))
        assert not torch.equal(stream_1[0], stream_2[0])
        with pytest.raises(Exception, match="seed 4321 already exists"):
            tracker.add("other", seed_2)
        with pytest.raises(Exception, match="cuda rng state test already exists"):
            tracker.add("test", 99)
        with pytest.raises(Exception, match="cuda rng state nope is not added"):
            with tracker.fork("nope"):
                pass
        states = tracker.get_states()
        assert set(states) == {"test"} and states is not tracker.states_


def test_manual_seed_needs_model_parallel() -> None:
    with pytest.raises(AssertionError, match="model parallel group is not initialized"):
        model_parallel_cuda_manual_seed(1)


def _gather(t: torch.Tensor) -> List[torch.Tensor]:
    return collectives.all_gather_object(t)


def _seeds_and_dropout(rank: int) -> None:
    model_parallel_cuda_manual_seed(12345)
    assert torch.initial_seed() == 12345
    with get_cuda_rng_tracker().fork():
        assert torch.initial_seed() == 12345 + 2718 + mpu.get_model_parallel_rank()
        inside = F.dropout(torch.ones(64), 0.5)
    outside = F.dropout(torch.ones(64), 0.5)
    masks_in, masks_out = _gather(inside), _gather(outside)
    assert all(torch.equal(m, masks_out[0]) for m in masks_out)  # default stream: same everywhere
    # ranks (0, 2) and (1, 3) are data-parallel replicas of model-parallel ranks 0 and 1
    assert torch.equal(masks_in[0], masks_in[2]) and torch.equal(masks_in[1], masks_in[3])
    assert not torch.equal(masks_in[0], masks_in[1])


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with get_cuda_rng_tracker().fork():
        h = F.dropout(x * w, 0.5)
    return F.dropout(h.tanh(), 0.3)


def _checkpoint_replays_rng() -> None:
    model_parallel_cuda_manual_seed(7)
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    cpu_state, tracker_states = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    plain = _block(x, w)
    plain.square().sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    after_plain = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    x.grad, w.grad = None, None
    torch.set_rng_state(cpu_state)
    get_cuda_rng_tracker().set_states(tracker_states)
    out = checkpoint(_block, x, w)
    assert torch.equal(out, plain)
    torch.randn(3)  # draws between forward and backward must not change the replay
    out.square().sum().backward()
    assert torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])
    torch.set_rng_state(after_plain[0])
    with pytest.raises(RuntimeError, match="Checkpointing is not compatible with .grad()"):
        torch.autograd.grad(checkpoint(_block, x, w).sum(), [x])


def _block_and_mask(x: torch.Tensor, w: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    h = (x * w).tanh()
    return h, (h > 0).float()


def test_checkpoint_of_a_function_that_also_returns_a_tensor_without_grad() -> None:
    # The mask's recomputation needs no grad; backward went through every output and failed ("element 1 of tensors
    # does not require grad and does not have a grad_fn"), where torch's own checkpoint takes the others only.
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    h, mask = _block_and_mask(x, w)
    (h * mask).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad, w.grad = None, None
    h, mask = checkpoint(_block_and_mask, x, w)
    (h * mask).sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
    with pytest.raises(RuntimeError, match="none of the checkpointed function's outputs requires grad"):
        CheckpointFunction.backward(_FakeContext(x.detach(), w.detach()), torch.ones(5, 6), torch.ones(5, 6))


class _FakeContext:
    """What CheckpointFunction.backward reads from its context, for a function whose outputs need no grad."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        from fairscale.nn.model_parallel.random import _RNGSnapshot

        self.saved_tensors = inputs
        self.fwd_rng = _RNGSnapshot()
        self.run_function = lambda a, b: ((a * b).detach(), (a > 0).float())


def _rng_body(rank: int, world_size: int) -> None:
    with pytest.raises(AssertionError, match="model parallel group is not initialized"):
        model_parallel_cuda_manual_seed(1)
    mpu.initialize_model_parallel(2)
    run_cases(
        [
            ("seeds_and_dropout", lambda: _seeds_and_dropout(rank)),
            ("checkpoint_replays_rng", _checkpoint_replays_rng),
        ]
    )
    mpu.destroy_model_parallel()


def test_model_parallel_rng() -> None:
    run_distributed(_rng_body, 4)
