# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel and the optimizers it is given: OSS only, over the wrapped module's parameters, and groups
added with ``OSS.add_param_group`` after wrapping (unfreezing a backbone) are reduced like the others.

Before: a plain torch optimizer failed with ``AttributeError: 'SGD' object has no attribute 'world_size'``; an OSS
over another model's parameters was accepted and the wrapped model never trained; an added group's gradients were
never reduced (each owner stepped its own gradient), even after ``refresh_trainable()``. The construction checks
need no process group (they raise before any collective); the training checks run in a real gloo world and compare
with a single-process reference.
"""

from typing import Any, List, Optional

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 60.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(100 * step + rank))


# ------------------------------------------------------------------------------------------------------------------
# Construction (no process group: a world of one)


@pytest.mark.parametrize(
    "make, got",
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "Got torch.optim.sgd.SGD."),
        (lambda m: [OSS(m.head.parameters(), lr=0.1), torch.optim.SGD(m.backbone.parameters(), lr=0.1)], "SGD."),
        (lambda m: (OSS(m.parameters(), lr=0.1),), "(several OSS optimizers go in a list, not a tuple)"),
    ],
    ids=["torch SGD", "list with a torch SGD", "tuple of OSS"],
)
def test_an_optimizer_that_is_not_oss_is_refused(make: Any, got: str) -> None:
    model = _Net()
    with pytest.raises(TypeError, match="ShardedDataParallel needs fairscale.optim.OSS optimizers") as e:
        ShardedDataParallel(model, make(model))
    assert got in str(e.value), str(e.value)
    assert "OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)" in str(e.value), "says how to build one"


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    model, other = _Net(), _Net()
    # A subset of the module's parameters is fine (upstream trained the others with nothing, or a second OSS).
    head_only = OSS(model.head.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, head_only)
    sdp(_batch(0, 0)).sum().backward()
    assert model.head.weight.grad is not None
    with pytest.raises(
        ValueError, match=r"the optimizers hold 6 parameter\(s\) that are not parameters of the wrapped"
    ):
        ShardedDataParallel(model, OSS(other.parameters(), lr=0.1))
    # One foreign parameter among the module's: named by its shape.
    with pytest.raises(ValueError, match=r"hold 1 parameter\(s\) .* \(shapes \[4, 4\]\)"):
        ShardedDataParallel(model, OSS(list(model.parameters()) + [other.backbone[2].weight], lr=0.1))
    # A group added from another model after wrapping: refused at the next forward, and at every one after it.
    head_only.add_param_group({"params": other.backbone.parameters()})
    for _ in range(2):
        with pytest.raises(ValueError, match=r"hold 4 parameter\(s\) that are not parameters"):
            sdp(_batch(1, 0))
    with pytest.raises(ValueError, match="add_param_group\\(\\) only that module's parameters"):
        sdp.refresh_trainable()


def test_a_parameter_in_two_optimizers_is_refused() -> None:
    """Its gradient was reduced twice (scaled by 1 / world_size twice): silently wrong."""
    model = _Net()
    whole, head = OSS(model.parameters(), lr=0.1), OSS(model.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter\(s\) head.bias, head.weight are held by more than one optimizer"):
        ShardedDataParallel(model, [whole, head])
    # Disjoint parts are fine.
    ShardedDataParallel(model, [OSS(model.backbone.parameters(), lr=0.1), OSS(model.head.parameters(), lr=0.1)])


# ------------------------------------------------------------------------------------------------------------------
# Unfreezing a backbone by adding a group after wrapping (a gloo world of 2 vs one process)


def _params(model: nn.Module) -> List[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference(world_size: int, steps: int) -> List[torch.Tensor]:
    """One process: the loss averaged over every rank's batch, the backbone unfrozen and added after step 0."""
    model = _Net()
    model.backbone.requires_grad_(False)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        if step == 1:
            model.backbone.requires_grad_(True)
            optimizer.add_param_group({"params": model.backbone.parameters(), "lr": 0.05})
        optimizer.zero_grad()
        loss = sum(model(_batch(step, r)).pow(2).sum() for r in range(world_size)) / world_size
        loss.backward()
        optimizer.step()
    return _params(model)


def _unfreeze_body(rank: int, world_size: int, buffer: int, auto_refresh: bool) -> float:
    steps = 3
    model = _Net()
    model.backbone.requires_grad_(False)
    oss = OSS(model.head.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer, auto_refresh_trainable=auto_refresh)
    for step in range(steps):
        if step == 1:
            model.backbone.requires_grad_(True)
            oss.add_param_group({"params": model.backbone.parameters(), "lr": 0.05})
            if not auto_refresh:
                sdp.refresh_trainable()
        sdp.zero_grad()
        sdp(_batch(step, rank)).pow(2).sum().backward()
        oss.step()
    return max(float((p - r).abs().max()) for p, r in zip(_params(model), _reference(world_size, steps)))


@pytest.mark.parametrize("buffer", [0, 2**20], ids=["unbucketed", "bucketed"])
@pytest.mark.parametrize("auto_refresh", [True, False], ids=["auto refresh", "refresh_trainable()"])
def test_a_group_added_after_wrapping_is_reduced(buffer: int, auto_refresh: bool) -> None:
    differences = run_distributed(_unfreeze_body, 2, buffer, auto_refresh, timeout=TIMEOUT)
    assert max(differences) < 1e-6, f"largest difference from the single-process reference per rank: {differences}"


def _added_without_refresh_body(rank: int, world_size: int) -> Optional[str]:
    model = _Net()
    model.backbone.requires_grad_(False)
    oss = OSS(model.head.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=0, auto_refresh_trainable=False)
    sdp(_batch(0, rank)).sum().backward()
    oss.step()
    # Added while still frozen: nothing to reduce yet, so no error.
    oss.add_param_group({"params": model.backbone[0].parameters()})
    sdp(_batch(1, rank)).sum().backward()
    oss.step()
    # Added trainable, and no refresh_trainable(): refused, at every training forward until the refresh.
    model.backbone[0].requires_grad_(True)
    sdp.refresh_trainable()
    oss.add_param_group({"params": model.backbone[2].parameters()})
    model.backbone[2].requires_grad_(True)
    message = None
    for _ in range(2):
        try:
            sdp(_batch(2, rank))
        except RuntimeError as e:
            message = str(e)
    sdp.eval()
    sdp(_batch(2, rank))  # no gradients to reduce in eval mode
    sdp.train()
    sdp.refresh_trainable()
    sdp.zero_grad()
    sdp(_batch(2, rank)).sum().backward()
    oss.step()
    return message


def test_a_trainable_group_added_without_refresh_is_refused() -> None:
    """auto_refresh_trainable=False: the added parameters would get no hook, so each owner would step its own
    gradient (the ranks stay identical, the training is silently wrong)."""
    messages = run_distributed(_added_without_refresh_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    assert messages[0].startswith("ShardedDataParallel: 2 parameter(s) were added to the optimizers"), messages[0]
    assert "Call refresh_trainable() on every rank after add_param_group()" in messages[0]
