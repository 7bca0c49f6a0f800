# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel faults: with checkpointing, the output under ``torch.no_grad`` required grad (unlike the plain
model's), and a slice returning a tuple failed inside ``torch.cat`` with an error that named nothing."""

from typing import Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import OffloadModel
from fairscale.internal.errors import FairscaleTypeError


@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_no_grad_output_does_not_require_grad(checkpoint_activation: bool) -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))
    model = OffloadModel(seq, torch.device("cpu"), num_slices=2, checkpoint_activation=checkpoint_activation)
    x = torch.randn(5, 2)
    with torch.no_grad():
        ref = seq(x)
        out = model(x)
    assert not ref.requires_grad
    assert not out.requires_grad
    torch.testing.assert_close(torch.from_numpy(out.numpy()), ref)  # numpy() refused a tensor requiring grad
    out.add_(1)  # in-place outside no_grad was refused too
    # With grad mode on the output still requires grad and trains.
    out = model(x)
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert all(p.grad is not None for p in seq.parameters())


class _Rnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        out: Tuple[Tensor, Tuple[Tensor, Tensor]] = self.lstm(x)
        return out


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, out: Tensor, hc: Tuple[Tensor, Tensor]) -> Tensor:
        return self.linear(out)


def test_checkpointed_tuple_slice_raises_clear_error() -> None:
    torch.manual_seed(0)
    slices = [_Rnn(), _Head()]
    x = torch.randn(2, 3, 4)
    # Without checkpointing a tuple is passed on as the next slice's positional arguments.
    OffloadModel(slices, torch.device("cpu"), checkpoint_activation=False)(x).sum().backward()
    model = OffloadModel(slices, torch.device("cpu"), checkpoint_activation=True)
    with pytest.raises(FairscaleTypeError, match="slice 0 returned a tuple.*checkpoint_activation=True needs each"):
        model(x)
