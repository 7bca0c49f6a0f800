# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``torch.compile`` with Pipe.

* ``torch.compile(pipe)`` failed with the compiler's internal error (a phony tensor aliasing an input): the schedule
  now runs outside the compiler and the run equals the uncompiled one, with one warning to compile the partitions.
* ``deferred_batch_norm=True`` with a layer compiled before the Pipe converted the batch norm inside the compiled
  wrapper, whose code still called the original one: running statistics moved once per micro-batch, silently. That
  is refused; converting first and compiling then works.
"""

import copy
import warnings
from typing import List

import pytest
import torch
from torch import Tensor, nn

from fairscale.internal.version import torch_version
from fairscale.nn import Pipe
from fairscale.nn.pipe.batchnorm import DeferredBatchNorm


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.BatchNorm1d(8), nn.Tanh()), nn.Linear(8, 2))


def _train(pipe: nn.Module, params: List[nn.Parameter]) -> List[Tensor]:
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(3):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        pipe(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [t.detach().clone() for t in list(params)]


def _pipe(seq: nn.Sequential) -> Pipe:
    return Pipe(seq, balance=[2, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)


def test_compiling_the_whole_pipe_trains_as_without(torch_sees_no_gpu: None) -> None:
    plain = _pipe(_sequential())
    expected = _train(plain, list(plain.parameters()))
    torch._dynamo.reset()
    pipe = _pipe(_sequential())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(torch.compile(pipe, backend="aot_eager"), list(pipe.parameters()))
    assert sum("torch.compile reached a fairscale Pipe" in str(w.message) for w in caught) == 1
    for a, b in zip(got, expected):
        assert torch.equal(a, b), (a - b).abs().max()
    for a, b in zip(pipe.buffers(), plain.buffers()):
        assert torch.equal(a, b)


def test_deferred_batch_norm_inside_a_compiled_layer(torch_sees_no_gpu: None) -> None:
    seq = _sequential()
    seq[1] = torch.compile(seq[1], backend="aot_eager")
    with pytest.raises(ValueError, match="was compiled \\(torch.compile\\) before its batch norms were made deferred"):
        _pipe(seq)
    # Converted first, then compiled: the same as the uncompiled pipe (checked on torch 2.6, 2.9, 2.11, 2.13 and
    # 2.14; the compilers of torch 2.1 and 2.4 give other running statistics for a compiled DeferredBatchNorm, with or
    # without Pipe; 2.5 is unchecked).
    if torch_version() < (2, 6, 0):
        pytest.skip(f"torch {torch.__version__}'s compiler does not keep DeferredBatchNorm's running statistics")
    plain = _pipe(_sequential())
    expected = _train(plain, list(plain.parameters()))
    torch._dynamo.reset()
    seq = _sequential()
    seq[1] = torch.compile(DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(seq[1]), 4), backend="aot_eager")
    pipe = _pipe(seq)
    got = _train(pipe, list(pipe.parameters()))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    for a, b in zip(pipe.buffers(), plain.buffers()):
        torch.testing.assert_close(a, b)
