# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Normalisation layers under checkpoint_wrapper: running statistics are updated exactly once per step."""

import copy
from typing import Any, Callable, List

import pytest
import torch
from torch import nn

from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.checkpoint.checkpoint_utils import patch_batchnorm

NORMS: List[Callable[[], nn.Module]] = [
    lambda: nn.BatchNorm2d(8),
    lambda: nn.LayerNorm([8, 6, 6]),
    lambda: nn.GroupNorm(2, 8),
]


def conv_model(norm: nn.Module) -> Any:
    block = nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.ReLU())
    return nn.Sequential(block, nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def train(model: nn.Module, steps: int, autocast: bool) -> List[torch.Tensor]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(4, 3, 8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("norm_index", range(len(NORMS)), ids=["batch_norm", "layer_norm", "group_norm"])
def test_norm_layers_match_plain_training(norm_index: int, autocast: bool) -> None:
    torch.manual_seed(0)
    plain = conv_model(NORMS[norm_index]())
    ckpt = copy.deepcopy(plain)
    checkpoint_wrapper(ckpt[0])  # checkpoint the conv + norm + relu block (in place)
    steps = 3
    plain_losses = train(plain, steps, autocast)
    ckpt_losses = train(ckpt, steps, autocast)
    torch.testing.assert_close(ckpt_losses, plain_losses)
    torch.testing.assert_close(ckpt.state_dict(), plain.state_dict())
    if norm_index == 0:
        assert ckpt[0][1].num_batches_tracked.item() == steps
        assert ckpt[0][1].track_running_stats


def test_running_stats_updated_in_recomputation_only() -> None:
    torch.manual_seed(0)
    model = checkpoint_wrapper(conv_model(nn.BatchNorm2d(8)))
    bn = model[0][1]
    out = model(torch.randn(4, 3, 8, 8))
    # The first pass ran without grad and left the statistics alone.
    assert bn.num_batches_tracked.item() == 0 and torch.all(bn.running_mean == 0)
    out.sum().backward()
    assert bn.num_batches_tracked.item() == 1 and not torch.all(bn.running_mean == 0)


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.SyncBatchNorm], ids=["batch_norm", "torch_sync_batch_norm"])
def test_a_wrapped_batch_norm_layer_itself_updates_once(cls: Any) -> None:
    """checkpoint_wrapper(nn.BatchNorm1d(4)): the checkpoint calls the layer's forward directly in both passes, so its
    own hooks never ran in the no-grad one, and its statistics moved twice per step (found by a docs review)."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4)
    wrapped = checkpoint_wrapper(copy.deepcopy(plain) if cls is nn.BatchNorm1d else cls(4))
    for step in range(3):
        x = torch.randn(8, 4, requires_grad=True)
        out = wrapped(x)
        assert wrapped.num_batches_tracked.item() == step, "the no-grad pass updated the statistics"
        out.sum().backward()
        plain(x).sum().backward()
        assert wrapped.num_batches_tracked.item() == step + 1
        assert torch.equal(wrapped.running_mean, plain.running_mean)
        assert torch.equal(wrapped.running_var, plain.running_var)
        assert wrapped.track_running_stats


@pytest.mark.parametrize("itself", [False, True], ids=["inside the wrapped module", "the wrapped module itself"])
def test_retained_graph_backward_twice_updates_the_statistics_once(itself: bool) -> None:
    """``backward(retain_graph=True)`` then ``backward()``: each backward recomputes the call, and each recomputation
    updated the statistics (num_batches_tracked 2 where the plain module has 1)."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4) if itself else nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(8, 4, requires_grad=True)
    for module in (plain, wrapped):
        out = module(x).pow(2).sum()
        out.backward(retain_graph=True)
        out.backward()
    bn_plain, bn_wrapped = (m if itself else m[1] for m in (plain, wrapped))
    assert bn_wrapped.num_batches_tracked.item() == bn_plain.num_batches_tracked.item() == 1
    assert torch.equal(bn_wrapped.running_mean, bn_plain.running_mean)
    assert torch.equal(bn_wrapped.running_var, bn_plain.running_var)


@pytest.mark.parametrize("backwards", [1, 2, 3])
def test_nested_wrappers_retained_graph_update_every_level_once(backwards: int) -> None:
    """Three nested checkpointed calls, one forward and ``backwards`` backwards over a retained graph: every batch norm
    moves once, as in the plain model. The inner calls are new calls (new stashes) in each recomputation of the outer
    one, so the outer call's "recomputed already" mark alone left the inner ones updating again."""
    torch.manual_seed(0)

    def build() -> nn.Sequential:
        inner = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
        middle = nn.Sequential(nn.BatchNorm1d(6), inner, nn.Tanh())
        outer = nn.Sequential(nn.BatchNorm1d(6), middle, nn.ReLU())
        return nn.Sequential(nn.Linear(4, 6), outer, nn.Linear(6, 2))

    plain = build()
    wrapped = copy.deepcopy(plain)
    checkpoint_wrapper(wrapped[1][1][1])  # inner
    checkpoint_wrapper(wrapped[1][1])  # middle
    checkpoint_wrapper(wrapped[1])  # outer
    x = torch.randn(8, 4)
    for model in (plain, wrapped):
        loss = model(x).pow(2).sum()
        for i in range(backwards):
            loss.backward(retain_graph=i < backwards - 1)
    norms = [lambda m: m[1][0], lambda m: m[1][1][0], lambda m: m[1][1][1][1]]
    for pick in norms:
        bn_plain, bn_wrapped = pick(plain), pick(wrapped)
        assert bn_wrapped.num_batches_tracked.item() == bn_plain.num_batches_tracked.item() == 1
        torch.testing.assert_close(bn_wrapped.running_mean, bn_plain.running_mean)
        torch.testing.assert_close(bn_wrapped.running_var, bn_plain.running_var)
    for p_plain, p_wrapped in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(p_wrapped.grad, p_plain.grad)


def test_eval_mode_uses_running_stats_and_keeps_them() -> None:
    torch.manual_seed(0)
    plain = conv_model(nn.BatchNorm2d(8))
    train(plain, 1, autocast=False)
    ckpt = checkpoint_wrapper(copy.deepcopy(plain)).eval()
    plain.eval()
    x = torch.randn(2, 3, 8, 8)
    out = ckpt(x)
    out.sum().backward()
    torch.testing.assert_close(out, plain(x))
    torch.testing.assert_close(ckpt.state_dict(), plain.state_dict())


def test_patch_batchnorm_handles_and_behaviour() -> None:
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.SyncBatchNorm(4), nn.LayerNorm(4))
    handles = patch_batchnorm(model)
    assert len(handles) == 4  # a pre- and a post-forward hook for each of the two batch-norm layers
    bn: Any = model[0]
    x = torch.randn(8, 4)
    with torch.no_grad():
        out_no_grad = bn(x)
    assert bn.num_batches_tracked.item() == 0 and bn.track_running_stats
    out_grad = bn(x)
    assert bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(out_no_grad, out_grad)  # batch statistics are used either way
    for h in handles:
        h.remove()
    with torch.no_grad():
        bn(x)
    assert bn.num_batches_tracked.item() == 2


def test_patch_batchnorm_leaves_disabled_tracking_alone() -> None:
    bn = nn.BatchNorm1d(4, track_running_stats=False)
    patch_batchnorm(bn)
    with torch.no_grad():
        bn(torch.randn(8, 4))
    bn(torch.randn(8, 4))
    assert not bn.track_running_stats


def test_patch_batchnorm_skips_layers_that_opt_out() -> None:
    """Upstream's rule: the mere presence of ``disable_patch_batchnorm`` keeps a layer unpatched."""
    from fairscale.experimental.nn import SyncBatchNorm

    opted_out: Any = nn.BatchNorm1d(4)
    opted_out.disable_patch_batchnorm = False  # the value does not matter
    model = nn.Sequential(nn.BatchNorm1d(4), opted_out, SyncBatchNorm(4))
    handles = patch_batchnorm(model)
    assert len(handles) == 2  # only the first layer
    with torch.no_grad():
        opted_out(torch.randn(8, 4))
    assert opted_out.num_batches_tracked.item() == 1  # unpatched: a no-grad pass updates its statistics


def test_patching_twice_still_updates_once() -> None:
    torch.manual_seed(0)
    model = checkpoint_wrapper(checkpoint_wrapper(conv_model(nn.BatchNorm2d(8))))
    bn = model[0][1]
    for step in range(2):
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        assert bn.track_running_stats and bn.num_batches_tracked.item() == step + 1


def test_failed_forward_does_not_leave_tracking_disabled() -> None:
    bn: Any = nn.BatchNorm1d(4)
    patch_batchnorm(bn)
    with torch.no_grad(), pytest.raises(RuntimeError):
        bn(torch.randn(8, 5))  # wrong number of features
    assert bn.track_running_stats
    bn(torch.randn(8, 4))
    assert bn.num_batches_tracked.item() == 1


def test_patch_batchnorm_rejects_non_modules() -> None:
    bad: Any = [nn.BatchNorm1d(4)]
    with pytest.raises(TypeError, match="expects an nn.Module"):
        patch_batchnorm(bad)


def test_no_grad_forwards_of_the_user_update_statistics_as_unwrapped() -> None:
    """Only the wrapper's own no-grad pass skips the update: a no-grad forward in training mode (as
    ``torch.optim.swa_utils.update_bn`` recomputes the statistics) updates them as the module does unwrapped; it
    left them as they were (update_bn: reset, zero batches tracked). Deliberate difference from upstream."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    batches = [torch.randn(8, 4) for _ in range(3)]
    loader = [(b,) for b in batches]
    for model in (plain, wrapped):
        torch.optim.swa_utils.update_bn(loader, model)  # resets, then no-grad forwards in training mode
    for name, value in plain.state_dict().items():
        assert torch.equal(wrapped.state_dict()[name], value), name
    assert int(wrapped[1].num_batches_tracked) == len(batches)
    # The checkpointed training forward still updates once (in the recomputation), not twice.
    x = torch.randn(8, 4, requires_grad=True)
    for model in (plain, wrapped):
        model(x).sum().backward()
    assert int(wrapped[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == len(batches) + 1
    torch.testing.assert_close(wrapped[1].running_mean, plain[1].running_mean)
