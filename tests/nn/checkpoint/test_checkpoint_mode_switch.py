# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A ``train()``/``eval()`` switch between a checkpointed forward and its backward changes nothing.

The recomputation replays each module's ``training`` flag of the forward: gradients (dropout masks, batch norm's batch
or running statistics) and batch-norm running statistics are those of the plain module, and the modes set after the
forward are back in place once backward is done.
"""

import copy
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from fairscale.nn.checkpoint import checkpoint_activations as ca
from fairscale.nn.checkpoint import checkpoint_wrapper, is_recomputing


class Net(nn.Module):
    """Batch norm (its statistics and its batch-or-running normalisation) and dropout (its mask) in one net."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _wrapped(net: Net, wrapping: str, offload: bool) -> Net:
    if wrapping in ("bn", "nested"):
        checkpoint_wrapper(net.bn, offload_to_cpu=offload)  # the batch-norm layer is the checkpointed module itself
    if wrapping in ("model", "nested"):
        checkpoint_wrapper(net, offload_to_cpu=offload)
    return net


def _step(model: nn.Module, start: str, switch: str, x: torch.Tensor, seed: int) -> None:
    getattr(model, start)()
    torch.manual_seed(seed)
    y = model(x)
    getattr(model, switch)()  # a validation pass's eval(), or the train() after it, before the backward
    y.pow(2).sum().backward()


def _grads(model: nn.Module, x: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["input"] = x.grad
    return grads


def _modes(model: nn.Module) -> List[bool]:
    return [m.training for m in model.modules()]


STEPS: List[Tuple[str, str]] = [("train", "eval"), ("eval", "train"), ("train", "train"), ("eval", "eval")]


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("wrapping", ["model", "bn", "nested"])
@pytest.mark.parametrize("start,switch", STEPS[:2], ids=["train_then_eval", "eval_then_train"])
def test_mode_switch_before_backward_matches_plain(start: str, switch: str, wrapping: str, offload: bool) -> None:
    torch.manual_seed(0)
    plain = Net()
    ckpt = _wrapped(copy.deepcopy(plain), wrapping, offload)
    # Several steps: the statistics a train-mode step leaves are what a later eval-mode step normalises with.
    for i, (first, second) in enumerate([(start, switch)] + STEPS + [(start, switch)]):
        x = torch.randn(6, 4, requires_grad=i % 2 == 0)
        x_ref = x.detach().clone().requires_grad_(x.requires_grad)
        _step(plain, first, second, x_ref, seed=10 + i)
        _step(ckpt, first, second, x, seed=10 + i)
        torch.testing.assert_close(_grads(ckpt, x), _grads(plain, x_ref))
        torch.testing.assert_close(ckpt.state_dict(), plain.state_dict())  # running statistics, batch count
        assert _modes(ckpt) == _modes(plain)  # the modes set after the forward are kept
    assert ckpt.bn.track_running_stats


def test_retained_graph_recomputed_twice_after_switch() -> None:
    """Each backward recomputes in the forward's mode; the statistics move once, as the plain forward moved them."""
    torch.manual_seed(0)
    plain = Net()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(6, 4)
    for model in (plain, ckpt):
        model.train()
        torch.manual_seed(3)
        loss = model(x).pow(2).sum()
        model.eval()
        loss.backward(retain_graph=True)
        model.train()
        loss.backward()
    torch.testing.assert_close(_grads(ckpt, x), _grads(plain, x))
    torch.testing.assert_close(ckpt.state_dict(), plain.state_dict())
    assert int(ckpt.bn.num_batches_tracked) == 1


class FailingRecomputation(nn.Module):
    """Records the mode of each pass, and raises in the recomputation while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.fail = False
        self.seen: List[Tuple[bool, bool, bool]] = []  # (recomputing, own mode, dropout's mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((is_recomputing(), self.training, self.drop.training))
        if self.fail and is_recomputing():
            raise RuntimeError("recomputation failed")
        return self.drop(self.fc(x))


def test_current_modes_restored_when_recomputation_raises() -> None:
    block = checkpoint_wrapper(FailingRecomputation())
    block.train()
    y = block(torch.randn(3, 4))
    block.eval()
    block.fail = True
    with pytest.raises(RuntimeError, match="recomputation failed"):
        y.sum().backward()
    assert block.seen == [(False, True, True), (True, True, True)]  # recomputed in the forward's mode
    assert _modes(block) == [False] * 3  # and the eval() of the caller is back

    block.fail = False
    y = block(torch.randn(3, 4))  # an eval-mode forward, recomputed in eval mode after a train()
    block.train()
    y.sum().backward()
    assert block.seen[-2:] == [(False, False, False), (True, False, False)]
    assert _modes(block) == [True] * 3


def test_checkpoint_function_replays_modes() -> None:
    """Upstream's CheckpointFunction protocol recomputes in the forward's modes too."""
    torch.manual_seed(0)
    block = FailingRecomputation()
    ref = copy.deepcopy(block)
    x = torch.randn(3, 4)
    torch.manual_seed(1)
    kwarg_keys, flat_args = ca.pack_kwargs(block, x)
    parent: dict = {"offload": False}
    out = ca.CheckpointFunction.apply(
        torch.tensor([], requires_grad=True), FailingRecomputation.forward, parent, kwarg_keys, *flat_args
    )
    block.eval()
    out.pow(2).sum().backward()
    assert block.seen[-1] == (True, True, True)
    assert _modes(block) == [False] * 3

    torch.manual_seed(1)
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(block.fc.weight.grad, ref.fc.weight.grad)
    torch.testing.assert_close(block.fc.bias.grad, ref.fc.bias.grad)
