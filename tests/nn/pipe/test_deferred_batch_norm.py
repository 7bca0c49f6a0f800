# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
from copy import deepcopy
from itertools import chain

import pytest
import torch
from torch import nn, optim

from fairscale.nn.pipe.batchnorm import DeferredBatchNorm

CHUNKS = 4


def tilt_dist(input):
    # Tilt variance by channel.
    rgb = input.transpose(0, 1)
    rgb[0] *= 1
    rgb[1] *= 10
    rgb[2] *= 100
    # Tilt mean by single batch.
    for i, single in enumerate(input):
        single += 2**i
    return input


def chunked_forward(model, input, chunks=CHUNKS):
    output_chunks = []
    for chunk in input.chunk(chunks):
        output_chunks.append(model(chunk))
    return torch.cat(output_chunks)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_transparency(chunks, input_requires_grad):
    bn = nn.BatchNorm2d(3)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=chunks)

    input1 = torch.rand(16, 3, 32, 32)
    input1 = tilt_dist(input1)
    input2 = input1.clone()
    if input_requires_grad:
        input1.requires_grad = True
        input2.requires_grad = True

    output1 = chunked_forward(bn, input1, chunks=chunks)
    output2 = chunked_forward(dbn, input2, chunks=chunks)
    assert torch.allclose(output1, output2, atol=1e-4)

    output1.mean().backward()
    output2.mean().backward()
    assert torch.allclose(bn.weight.grad, dbn.weight.grad, atol=1e-4)
    if input_requires_grad:
        assert input1.grad is not None and input2.grad is not None
        assert torch.allclose(input1.grad, input2.grad, atol=1e-4)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats(momentum):
    bn = nn.BatchNorm2d(3, momentum=momentum)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=CHUNKS)

    input = torch.rand(16, 3, 32, 32)
    input = tilt_dist(input)

    bn(input)
    chunked_forward(dbn, input)

    assert torch.allclose(bn.running_mean, dbn.running_mean, atol=1e-4)
    assert torch.allclose(bn.running_var, dbn.running_var, rtol=1e-2, atol=1e-4)


def test_running_variance_is_biased():
    # Upstream keeps the population variance (mirrored): exactly the biased variance of the whole mini-batch.
    dbn = DeferredBatchNorm(1, momentum=1.0, chunks=2)
    x = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    dbn(x[:2])
    dbn(x[2:])
    assert torch.allclose(dbn.running_mean, x.mean(0))
    assert torch.allclose(dbn.running_var, x.var(0, unbiased=False))
    assert int(dbn.num_batches_tracked) == 1


def test_partial_sums_carry_over():
    dbn = DeferredBatchNorm(1, momentum=1.0, chunks=3)
    x = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    dbn(x[:2])
    dbn(x[2:])
    assert int(dbn.num_batches_tracked) == 0 and dbn.tracked == 2
    dbn(torch.tensor([[0.0], [1.0]]))
    assert int(dbn.num_batches_tracked) == 1 and dbn.tracked == 0


def test_convert_deferred_batch_norm():
    bn = nn.BatchNorm2d(3, track_running_stats=False)
    bn = DeferredBatchNorm.convert_deferred_batch_norm(bn, chunks=CHUNKS)
    assert type(bn) is nn.BatchNorm2d  # because of track_running_stats=False

    dbn = DeferredBatchNorm(3, chunks=CHUNKS)
    dbn_again = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=CHUNKS)
    assert dbn is dbn_again

    dbn_again = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=CHUNKS + 1)
    assert dbn is not dbn_again  # because of different chunks


def test_convert_shares_parameters_and_mutates_containers():
    bn = nn.BatchNorm2d(3)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), bn)
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    assert converted is model
    assert isinstance(model[1], DeferredBatchNorm)
    assert model[1].weight is bn.weight and model[1].running_mean is bn.running_mean
    assert "1.sum" in model.state_dict() and "1.sum_squares" in model.state_dict()


def test_eval():
    bn = nn.BatchNorm2d(3)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=CHUNKS)

    input = torch.rand(16, 3, 32, 32)
    input = tilt_dist(input)

    bn(input)
    chunked_forward(dbn, input)

    bn.eval()
    dbn.eval()
    assert torch.allclose(bn(input), dbn(input), atol=1e-4, rtol=1e-3)


def test_optimize():
    bn = nn.BatchNorm2d(3)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=CHUNKS)

    opt = optim.SGD(chain(bn.parameters(), dbn.parameters()), lr=1.0)

    for i in range(5):
        input = torch.rand(16, 3, 32, 32)
        input = tilt_dist(input)

        # train
        y = bn(input)
        a = y.sum()
        a.backward()

        y = chunked_forward(dbn, input)
        b = y.sum()
        b.backward()

        opt.step()

        # eval
        bn.eval()
        dbn.eval()

        with torch.no_grad():
            # Smaller images than upstream make the (mirrored) biased running variance visible: compare relatively too.
            assert torch.allclose(bn(input), dbn(input), rtol=1e-3, atol=1e-1 * (10**i))


def test_conv_bn():
    bn = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=CHUNKS)

    input = torch.rand(16, 3, 32, 32)
    input = tilt_dist(input)

    opt = optim.SGD(chain(bn.parameters(), dbn.parameters()), lr=0.1)

    # 1st step
    a = bn(input)
    b = chunked_forward(dbn, input)

    # Outputs are different. (per-mini-batch vs. per-micro-batch)
    assert not torch.allclose(a, b)

    a.sum().backward()
    b.sum().backward()
    opt.step()
    opt.zero_grad()

    # Conv layers are also trained differently because of their different outputs.
    assert not torch.allclose(bn[0].weight, dbn[0].weight)

    # But BNs track identical running stats.
    assert torch.allclose(bn[1].running_mean, dbn[1].running_mean, atol=1e-4)
    assert torch.allclose(bn[1].running_var, dbn[1].running_var, atol=1e3)

    # 2nd step
    a = bn(input)
    b = chunked_forward(dbn, input)
    a.sum().backward()
    b.sum().backward()

    # BNs can't track identical running stats due to the different conv layers.
    assert not torch.allclose(bn[1].running_mean, dbn[1].running_mean, atol=1e-4)
    assert not torch.allclose(bn[1].running_var, dbn[1].running_var, atol=1e3)


def test_input_requiring_grad():
    dbn = DeferredBatchNorm(3, chunks=CHUNKS)

    input = torch.rand(16, 3, 32, 32)
    input = tilt_dist(input)
    input.requires_grad = True

    chunked_forward(dbn, input)

    assert not dbn.sum.requires_grad
    assert dbn.sum.grad_fn is None


def test_two_dimensional_input():
    bn = nn.BatchNorm1d(3)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(deepcopy(bn), chunks=2)
    x = torch.rand(8, 3)
    bn(x)
    chunked_forward(dbn, x, chunks=2)
    assert torch.allclose(bn.running_mean, dbn.running_mean, atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_plain_batch_norm_in_a_pipe_updates_once_per_micro_batch(checkpoint):
    """Without deferred_batch_norm a plain batch norm tracks every micro-batch, as outside a pipe; a checkpointed
    micro-batch runs the partition twice (no grad, then the recomputation), and it was tracked both times
    (num_batches_tracked 3 or 4 for 2 micro-batches)."""
    from fairscale.nn import Pipe

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    pipe = Pipe(deepcopy(plain), balance=[2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    x = torch.randn(8, 4)
    for _ in range(2):
        pipe(x).sum().backward()
        chunked_forward(plain, x, chunks=2).sum().backward()
    bn_pipe = pipe.partitions[0][1]
    assert bn_pipe.num_batches_tracked.item() == plain[1].num_batches_tracked.item() == 4
    assert torch.allclose(bn_pipe.running_mean, plain[1].running_mean, atol=1e-6)
    assert torch.allclose(bn_pipe.running_var, plain[1].running_var, atol=1e-6)
