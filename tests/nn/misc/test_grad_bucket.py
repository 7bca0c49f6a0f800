# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""GradBucket: gradients become views of one flat buffer; shrink/collapse/rebuild manage its memory."""

import pytest
import torch

from fairscale.nn.misc import GradBucket


def _param_with_grad(*shape):
    param = torch.nn.Parameter(torch.rand(*shape))
    param.grad = torch.rand(*shape)
    return param


def test_grad_values_conserved():
    bucket = GradBucket(100, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3, 4)
    grad_object, value = param.grad, param.grad.clone()
    bucket.add_grad(param)
    assert torch.equal(param.grad, value)
    assert param.grad is grad_object, "the gradient tensor object is kept, its storage swapped"
    bucket.buffer.fill_(2.0)
    assert bool((param.grad == 2.0).all())


def test_missing_grad_created_as_zero_view():
    bucket = GradBucket(100, torch.float32, "cpu", destination=1)
    param = torch.nn.Parameter(torch.rand(5))
    bucket.add_grad(param)
    assert torch.equal(param.grad, torch.zeros(5))
    assert bucket.slot(param).data_ptr() == param.grad.data_ptr()
    assert bucket.destination == 1 and bucket.sent


def test_memory_leak():
    bucket = GradBucket(1000, torch.float32, "cpu", destination=0)
    params = [_param_with_grad(2), _param_with_grad(4)]
    values = [p.grad.clone() for p in params]
    for p in params:
        bucket.add_grad(p)
    bucket.shrink()
    assert bucket.buffer.untyped_storage().size() == 6 * 4, "shrink must release the unused storage"
    for p, v in zip(params, values):
        assert torch.equal(p.grad, v)


def test_max_size():
    bucket = GradBucket(5, torch.float32, "cpu", destination=0)
    param = _param_with_grad(20, 30)
    assert not bucket.can_add_grad_view(param)
    with pytest.raises(AssertionError):
        bucket.add_grad(param)


def test_can_add_is_strict_and_checks_duplicates():
    bucket = GradBucket(6, torch.float32, "cpu", destination=0)
    exact = _param_with_grad(6)
    assert not bucket.can_add_grad_view(exact), "a gradient that exactly fills the bucket is not added (strict <)"
    small = _param_with_grad(3)
    bucket.add_grad(small)
    assert not bucket.can_add_grad_view(small)
    with pytest.raises(AssertionError, match="checked in twice"):
        bucket.add_grad(small)


def test_collapse():
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3)
    bucket.add_grad(param)
    bucket.collapse()
    assert bucket.buffer.numel() == 0 and param.grad is None
    with pytest.raises(AssertionError, match="collapsed"):
        bucket.shrink()
    bucket.rebuild()
    assert param.grad is not None and torch.equal(param.grad, torch.zeros(3))
    assert bucket.buffer.numel() == 10


def test_checked_in_counter():
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    params = [_param_with_grad(2), _param_with_grad(3)]
    for p in params:
        bucket.add_grad(p)
    bucket.reset_checked_in()
    assert not bucket.sent and not bucket.all_checked_in
    bucket.params_checked_in = 2
    assert bucket.all_checked_in


def test_collapse_after_the_reducer_reattached_a_view():
    """ShardedDDP's reducer gives a gradient back as ``param.grad = bucket.slot(param)``, a view of the buffer, which
    cannot be detached in place: collapse() releases it like the others (it raised "Can't detach views in-place")."""
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    kept, reattached = _param_with_grad(3), _param_with_grad(2)
    bucket.add_grad(kept)
    bucket.add_grad(reattached)
    reattached.grad = bucket.slot(reattached)
    assert reattached.grad._is_view()
    bucket.collapse()
    assert kept.grad is None and reattached.grad is None and bucket.buffer.numel() == 0
    bucket.rebuild()
    assert reattached.grad is not None and reattached.grad.data_ptr() == bucket.buffer.data_ptr() + 3 * 4


@pytest.mark.parametrize("collapsed", [False, True])
def test_failed_to_leaves_the_bucket_as_it_was(collapsed):
    """A cast the gradients cannot follow raises; the gradients stay views of the bucket's buffer (the buffer was
    replaced before the check, so a later reduction of it no longer reached them)."""
    bucket = GradBucket(100, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3)
    value = param.grad.clone()
    bucket.add_grad(param)
    if collapsed:
        bucket.collapse()
    with pytest.raises(TypeError, match="Different types for the bucket and the gradient"):
        bucket.to("cpu", torch.float16)
    assert bucket.buffer.dtype == torch.float32
    if collapsed:
        assert param.grad is None
        bucket.rebuild()
    else:
        torch.testing.assert_close(param.grad, value)
    bucket.buffer.fill_(5.0)
    assert torch.equal(param.grad, torch.full((3,), 5.0))
