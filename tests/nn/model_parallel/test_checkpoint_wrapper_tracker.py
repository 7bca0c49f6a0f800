# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""checkpoint_wrapper around tensor-parallel blocks whose dropout runs under the model-parallel RNG tracker's fork():
the recomputation draws the forward's masks (it drew new ones: silently wrong gradients), as
``model_parallel.random.checkpoint`` does, and leaves the tracker's streams where the training loop has them."""

import copy
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.checkpoint.checkpoint_activations import CheckpointFunction
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from fairscale.internal.containers import pack_kwargs


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(4, 8, gather_output=False)
        self.down = RowParallelLinear(8, 4, input_is_parallel=True)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.up(x))
        with get_cuda_rng_tracker().fork():
            h = F.dropout(h, 0.5, self.training)
        return self.down(h)


def _grads_and_tracker(model: nn.Module, how: str) -> tuple:
    model_parallel_cuda_manual_seed(123)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    if how == "function":
        kwarg_keys, flat_args = pack_kwargs(model, x)
        dummy = torch.tensor([], requires_grad=True)
        out = CheckpointFunction.apply(dummy, type(model).forward, {"offload": False}, kwarg_keys, *flat_args)
    else:
        out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def _case(how: str) -> None:
    torch.manual_seed(0)
    plain = _Block()
    other = copy.deepcopy(plain)
    wrapped = checkpoint_wrapper(other) if how == "wrapper" else other
    want, want_tracker = _grads_and_tracker(plain, "plain")
    got, got_tracker = _grads_and_tracker(wrapped, how)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{how} {name}: {m}")
    # After the step the streams are where the unwrapped block left them (one fork's draw, not two).
    assert want_tracker.keys() == got_tracker.keys()
    for key in want_tracker:
        assert torch.equal(got_tracker[key], want_tracker[key]), f"{how}: tracker stream {key} moved differently"


def _body(rank: int, world_size: int) -> None:
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(world_size)
    try:
        run_cases((how, functools.partial(_case, how)) for how in ("wrapper", "function"))
    finally:
        mpu.destroy_model_parallel()


def test_checkpoint_wrapper_replays_the_tracker_one_rank() -> None:
    run_distributed(_body, 1)


def test_checkpoint_wrapper_replays_the_tracker_two_model_parallel_ranks() -> None:
    run_distributed(_body, 2)
