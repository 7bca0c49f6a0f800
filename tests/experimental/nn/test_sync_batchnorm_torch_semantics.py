# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SyncBatchNorm follows torch's batch norm where the two could differ: ``track_running_stats`` turned off at run
time freezes the running statistics, ``convert_sync_batchnorm`` keeps a layer's eval mode, and fp16/bf16 inputs
next to fp32 parameters give outputs in the input's dtype, normalised with fp32 statistics (as accurate as torch's
own batch norm on the same global batch, also for inputs far from zero)."""

import copy
from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import SyncBatchNorm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import all_gather_into_flat

WORLD = 2


def _global_batch(x: Tensor, world_size: int) -> Tensor:
    out = torch.empty((world_size,) + tuple(x.shape), dtype=x.dtype)
    all_gather_into_flat(out, x.contiguous())
    return out.flatten(0, 1)


def _frozen_flag_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3)
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    # Statistics frozen while training (a common fine-tuning setting): batch statistics normalise, buffers stay.
    ref.track_running_stats = False
    layer.track_running_stats = False
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(rank)) * 3 + 1
    y = layer(x)
    y_ref = ref(_global_batch(x, world_size))
    torch.testing.assert_close(y, y_ref.unflatten(0, (world_size, -1))[rank])
    torch.testing.assert_close(layer.running_mean, torch.zeros(3))
    torch.testing.assert_close(layer.running_var, torch.ones(3))
    # Turned back on, the next step updates them as torch's layer does.
    ref.track_running_stats = True
    layer.track_running_stats = True
    layer(x)
    ref(_global_batch(x, world_size))
    torch.testing.assert_close(layer.running_mean, ref.running_mean)
    torch.testing.assert_close(layer.running_var, ref.running_var)


def test_track_running_stats_off_at_run_time_freezes_the_statistics() -> None:
    run_distributed(_frozen_flag_body, WORLD, timeout=60)


def test_convert_keeps_eval_mode() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    model[1].eval()  # a frozen backbone layer
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm)
    assert converted.training and not converted[1].training
    assert SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(2).eval()).training is False


def _errors(layer: nn.Module, ref: nn.Module, x: Tensor, rank: int, world_size: int) -> Tuple[float, float]:
    """Max error of SyncBatchNorm's and of torch's output vs a float64 batch norm of the same (rounded) inputs."""
    x_global = _global_batch(x, world_size)
    exact = nn.functional.batch_norm(x_global.double(), None, None, training=True).unflatten(0, (world_size, -1))
    y = layer(x.clone().requires_grad_())
    assert y.dtype == x.dtype
    y_ref = ref(x_global).unflatten(0, (world_size, -1))
    assert y_ref.dtype == x.dtype
    return (y.double() - exact[rank]).abs().max().item(), (y_ref[rank].double() - exact[rank]).abs().max().item()


def _cpu_supports(dtype: torch.dtype) -> bool:
    """Whether torch's CPU batch norm and convolution (the references here) take ``dtype`` (fp16 from torch 2.2)."""
    try:
        x = torch.ones(2, 2, 3, dtype=dtype)
        nn.functional.batch_norm(x, None, None, training=True)
        nn.functional.conv1d(x, torch.ones(2, 2, 1, dtype=dtype))
        return True
    except RuntimeError:
        return False


def _half_precision_body(rank: int, world_size: int) -> None:
    dtypes = [dtype for dtype in (torch.float16, torch.bfloat16) if _cpu_supports(dtype)]
    assert torch.bfloat16 in dtypes
    for dtype in dtypes:
        for offset in (0.0, 100.0, 300.0):
            ref = nn.BatchNorm1d(4)  # fp32 parameters and buffers, half-precision activations
            layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
            g = torch.Generator().manual_seed(rank)
            x = (torch.randn(64, 4, 8, generator=g) + offset).to(dtype)
            err, err_ref = _errors(layer, ref, x, rank, world_size)
            # The mean was rounded to the input dtype before: 5-50x torch's error at offset 100-300.
            assert err <= 1.5 * err_ref + 1e-3, (dtype, offset, err, err_ref)
            torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=1e-3, atol=1e-3)
        # The bias gradient sums the output gradient in fp32, as torch's kernel does (it was summed in the input's
        # half precision and then cast: 1e-3 relative off for bf16; found by a fuzz of experimental.nn, session 40).
        ref, layer = nn.BatchNorm1d(4), SyncBatchNorm(4)
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(64, 4, 8, generator=g).to(dtype) for _ in range(world_size)]
        grads = [torch.randn(64, 4, 8, generator=g).to(dtype) for _ in range(world_size)]
        (ref(torch.cat(xs)) * torch.cat(grads)).sum().backward()
        (layer(xs[rank]) * grads[rank]).sum().backward()
        exact = torch.cat(grads).double().sum(dim=(0, 2))
        summed = layer.bias.grad.clone()
        dist.all_reduce(summed)
        err = ((summed.double() - exact).abs().max() / exact.abs().max()).item()
        err_ref = ((ref.bias.grad.double() - exact).abs().max() / exact.abs().max()).item()
        assert err <= 10 * err_ref + 1e-6, (dtype, err, err_ref)
    # The next half-precision layer takes the output (an fp32 output crashed it), and backward gives each tensor a
    # gradient in its own dtype, for fp32 and for fp16 parameters.
    half = dtypes[0]
    for param_dtype in (torch.float32, half):
        bn = SyncBatchNorm(4).to(param_dtype)
        conv = nn.Conv1d(4, 4, 1).to(half)
        x = torch.randn(8, 4, 5, dtype=half, requires_grad=True)
        conv(bn(x)).float().sum().backward()
        assert x.grad is not None and x.grad.dtype == half
        assert bn.weight.grad is not None and bn.weight.grad.dtype == param_dtype
        assert bn.bias.grad is not None and bn.bias.grad.dtype == param_dtype


def test_half_precision_inputs_match_torch() -> None:
    run_distributed(_half_precision_body, WORLD, timeout=90)


def _batch_norm_refusing_eps_zero(*args: object, **kwargs: object) -> Tensor:
    """``F.batch_norm`` as torch 2.11 has it: a Python check refuses ``eps <= 0`` before the kernel runs."""
    raise ValueError("batch_norm eps must be positive, but got 0.0")


def _eps_check_body(rank: int, world_size: int) -> None:
    ref = nn.BatchNorm1d(4)
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    x = torch.randn(16, 4, 3, generator=torch.Generator().manual_seed(rank))
    expected = ref(_global_batch(x, world_size))
    torch.nn.functional.batch_norm = _batch_norm_refusing_eps_zero  # this rank's process only
    out = layer(x)
    torch.testing.assert_close(out, expected[rank * 16 : (rank + 1) * 16], rtol=1e-5, atol=1e-5)


def test_forward_does_not_depend_on_functional_batch_norm_accepting_eps_zero() -> None:
    """The normalisation passes the exact variance with eps=0 to torch's kernel: through ``F.batch_norm`` every
    forward raised "batch_norm eps must be positive" on torch 2.11 (seen in the whole suite there)."""
    run_distributed(_eps_check_body, WORLD, timeout=60)
