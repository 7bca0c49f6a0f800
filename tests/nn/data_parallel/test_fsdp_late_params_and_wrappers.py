# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP with modules changed or wrapped after wrapping: a parameter added after wrapping is refused at the first
forward (every rank trained its own copy, silently), a nested instance wrapped by torch's CheckpointWrapper trains as
the plain model (it was refused as "already wrapped"), and the advice about frozen parameters is only given for a
flat parameter that mixes them."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as torch_checkpoint_wrapper

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import all_gather_into_flat
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _late_params_body(rank: int, world_size: int) -> None:
    for flatten in (True, False):
        torch.manual_seed(0)
        model = FSDP(_Net(), flatten_parameters=flatten)
        model.module.module.head = nn.Linear(6, 5)  # a classifier swapped after wrapping
        with pytest.raises(ValueError, match=r"added to the wrapped module after it was wrapped \(.*head\.weight"):
            model(torch.randn(2, 4))
        model = FSDP(_Net(), flatten_parameters=flatten)
        model.module.module.register_parameter("scale", nn.Parameter(torch.ones(3)))
        with pytest.raises(ValueError, match="added to the wrapped module after it was wrapped"):
            model.state_dict()
    # Changed before wrapping: trains, and the ranks agree.
    torch.manual_seed(0)
    net = _Net()
    net.head = nn.Linear(6, 5)
    model = FSDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    for value in model.state_dict().values():
        gathered = torch.empty((world_size,) + tuple(value.shape))
        all_gather_into_flat(gathered, value.contiguous())
        assert torch.equal(gathered[0], gathered[1])


def test_a_parameter_added_after_wrapping_is_refused() -> None:
    run_distributed(_late_params_body, 2, timeout=90)


def _wrapped_nested_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    torch.manual_seed(0)
    # The nested instance wraps a module with parameters. Non-reentrant, as torch >= 2.2 defaults to: torch 2.1's
    # default (reentrant) gives the inner parameters no gradient when the input does not require grad.
    inner = torch_checkpoint_wrapper(FSDP(nn.Linear(4, 4)), checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    model = FSDP(nn.Sequential(inner, nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    for m, batch in ((model, x[rank * 2 : rank * 2 + 2]), (ref, x)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        # Sum over the local rows, scaled as FSDP's mean over ranks: the same gradient as the whole batch's sum.
        (m(batch).pow(2).sum() * (world_size if m is model else 1)).backward()  # was a false "already wrapped"
        opt.step()
    got = list(model.state_dict().values())
    want = list(ref.state_dict().values())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_nested_instance_inside_torch_checkpoint_wrapper_trains() -> None:
    run_distributed(_wrapped_nested_body, 2, timeout=90)


class _FlatNamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat_param_0 = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a module without one is refused before the name is
        return x * self.flat_param_0


def _hint_body(rank: int, world_size: int) -> None:
    # The advice about frozen parts and flatten_parameters=False was added to every FlattenParamsWrapper refusal.
    with pytest.raises(ValueError) as info:
        FSDP(_FlatNamed())
    assert "flat_param_0" in str(info.value) and "frozen" not in str(info.value)
    mixed = nn.Linear(2, 2)
    mixed.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="mixes requires_grad(.|\n)*the frozen part"):
        FSDP(mixed)


def test_frozen_parameter_advice_only_for_mixed_groups() -> None:
    run_distributed(_hint_body, 1, timeout=60)
