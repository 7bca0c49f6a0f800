# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``vocab_parallel_cross_entropy`` equals ``F.cross_entropy`` on the gathered logits: values and gradients.

One 4-rank gloo world runs the cases at model-parallel sizes 4, 2 (x 2 data parallel) and 1; a 2-rank world at 2.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel import vocab_parallel_cross_entropy
from fairscale.nn.model_parallel.mappings import scatter_to_model_parallel_region

BATCH, SEQ, VOCAB_PER = 13, 17, 11
TOL = dict(atol=1e-5, rtol=1e-5)


def _assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """``torch.testing.assert_close`` without its one-time import cost (about 2 s in every forked rank)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what} not close: max abs diff {diff}"


def _inputs(scale: float) -> "tuple[Tensor, Tensor]":
    vocab = VOCAB_PER * mpu.get_model_parallel_world_size()
    g = torch.Generator().manual_seed(1234 + mpu.get_data_parallel_rank())
    logits = scale * torch.randn(BATCH, SEQ, vocab, generator=g)
    target = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return logits, target


def _parity(scale: float) -> None:
    logits, target = _inputs(scale)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, ref_logits.size(-1)), target.view(-1), reduction="none")
    ref = ref.view_as(target).mean()
    ref.backward()
    leaf = logits.clone().requires_grad_()
    # The loss shifts its input in place: give it a copy of the slice (at size 1 the scatter is the identity).
    local = scatter_to_model_parallel_region(leaf).clone()
    loss = vocab_parallel_cross_entropy(local, target)
    assert loss.shape == target.shape and loss.dtype == logits.dtype
    loss.mean().backward()
    _assert_close(loss.mean(), ref.detach(), **TOL)
    _assert_close(leaf.grad, ref_logits.grad, **TOL)


def _out_of_range_target() -> None:
    logits, target = _inputs(1.0)
    target[0, 0] = -1
    target[1, 1] = logits.size(-1)
    local = scatter_to_model_parallel_region(logits).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local.clone(), target)
    lse_minus_max = torch.logsumexp(logits, -1) - logits.max(-1).values
    _assert_close(loss[0, 0], lse_minus_max[0, 0], **TOL)
    _assert_close(loss[1, 1], lse_minus_max[1, 1], **TOL)
    loss[0, 0].backward()
    softmax = scatter_to_model_parallel_region(torch.softmax(logits[0, 0], -1))
    _assert_close(local.grad[0, 0], softmax, **TOL)  # no -1 anywhere: no rank owns the target


def _shifts_input_in_place() -> None:
    """Upstream's side effect on the caller's logits is the max shift alone (its exp is out of place): they held the
    softmax after the forward, then the gradient (found by running upstream's tests on the CPU)."""
    logits, target = _inputs(1.0)
    local = scatter_to_model_parallel_region(logits).clone()
    before = local.clone()
    vocab_parallel_cross_entropy(local, target)
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    _assert_close(local, scatter_to_model_parallel_region(shifted), **TOL)
    assert not torch.equal(local, before)


def _parity_straight_from_the_scatter() -> None:
    """Upstream's own test feeds the scatter's output to the loss without a copy: at model-parallel size 1 the scatter
    returns a view of its input, which the in-place exp made autograd refuse in backward."""
    logits, target = _inputs(1.0)
    leaf = logits.clone().requires_grad_()
    vocab_parallel_cross_entropy(scatter_to_model_parallel_region(leaf * 1.0), target).mean().backward()
    ref_logits = logits.clone().requires_grad_()
    F.cross_entropy(ref_logits.view(-1, ref_logits.size(-1)), target.view(-1)).backward()
    _assert_close(leaf.grad, ref_logits.grad, **TOL)


def _uneven_slices(first_width: int, empty_rank: int = -1) -> None:
    # A vocabulary split unevenly by hand (model-parallel rank r holds VOCAB_PER + r ids): before, every rank took its
    # id range as rank * its own slice size, and the loss was wrong with no error. No collective is added for it.
    # An empty slice (``empty_rank``) raised in torch.max on that rank alone while the others waited.
    mp, mp_rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    # From 4097 on, a width's high part (// 4096) is not 0.
    widths = [0 if r == empty_rank else first_width + r for r in range(mp)]
    g = torch.Generator().manual_seed(99 + mpu.get_data_parallel_rank())
    logits = torch.randn(BATCH, SEQ, sum(widths), generator=g)
    target = torch.randint(0, sum(widths), (BATCH, SEQ), generator=g)
    bounds = [sum(widths[: r + 1]) for r in range(mp)]
    edges = sorted(
        {i for b in bounds for i in (0, b - 1, b) if 0 <= i < sum(widths)}
    )  # each slice's first and last ids
    target.view(-1)[: len(edges)] = torch.tensor(edges)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, sum(widths)), target.view(-1), reduction="none").view_as(target)
    ref.mean().backward()
    leaf = logits[..., sum(widths[:mp_rank]) : sum(widths[: mp_rank + 1])].clone().requires_grad_()
    with collectives.count_collectives() as counter:
        loss = vocab_parallel_cross_entropy(leaf.clone(), target)
    assert counter.count() == counter.count("all_reduce") == 3, counter
    loss.mean().backward()
    _assert_close(loss, ref.detach(), what="uneven slices: loss")
    _assert_close(leaf.grad, ref_logits.grad[..., sum(widths[:mp_rank]) : sum(widths[: mp_rank + 1])], what="grad")


def _three_all_reduces() -> None:
    logits, target = _inputs(1.0)
    with collectives.count_collectives() as counter:
        vocab_parallel_cross_entropy(scatter_to_model_parallel_region(logits).clone(), target)
    assert counter.count() == counter.count("all_reduce") == 3, counter  # the check adds no collective


def _non_contiguous_logits_and_targets() -> None:
    # The language-model shift (logits[:, :-1] against target[:, 1:]) and a transposed target failed with torch's
    # "view size is not compatible with input tensor's size and stride".
    logits, target = _inputs(1.0)
    shifted, next_ids = logits[:, :-1], target[:, 1:]
    ref_logits = shifted.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, ref_logits.size(-1)), next_ids.reshape(-1), reduction="none")
    ref.sum().backward()
    leaf = logits.clone().requires_grad_()
    local = scatter_to_model_parallel_region(leaf).clone()[:, :-1]
    assert not local.is_contiguous() and not next_ids.is_contiguous()
    loss = vocab_parallel_cross_entropy(local, next_ids)
    loss.sum().backward()
    _assert_close(loss, ref.detach().view_as(next_ids), **TOL)
    _assert_close(leaf.grad[:, :-1], ref_logits.grad, **TOL)
    transposed = target.t().contiguous().t()
    assert not transposed.is_contiguous()
    loss = vocab_parallel_cross_entropy(scatter_to_model_parallel_region(logits).clone(), transposed)
    _assert_close(loss, vocab_parallel_cross_entropy(scatter_to_model_parallel_region(logits).clone(), target))


def _target_of_another_shape_is_refused() -> None:
    # A [N, 1] target for [N, V/p] logits broadcast to an [N, N] "loss", and its backward failed.
    logits, target = _inputs(1.0)
    local = scatter_to_model_parallel_region(logits[0]).clone()
    for bad in (target[0].unsqueeze(1), target[0].unsqueeze(0), target):
        with pytest.raises(ValueError, match="the target's shape .* must be the logits' shape without"):
            vocab_parallel_cross_entropy(local.clone(), bad)
    # A float target: torch's "tensors used as indices must be long, ..." from inside, naming nothing.
    with pytest.raises(TypeError, match="target holds class ids, an integer tensor .*got torch.float32"):
        vocab_parallel_cross_entropy(local.clone(), target[0].float())


def _ce_body(rank: int, world_size: int) -> None:
    for mp in [s for s in (4, 2, 1) if s <= world_size]:
        mpu.initialize_model_parallel(mp)
        try:
            run_cases(
                [
                    (f"mp={mp}:parity", lambda: _parity(1.0)),
                    (f"mp={mp}:parity_large_logits", lambda: _parity(1000.0)),
                    (f"mp={mp}:out_of_range_target", _out_of_range_target),
                    (f"mp={mp}:shifts_input_in_place", _shifts_input_in_place),
                    (f"mp={mp}:parity_straight_from_the_scatter", _parity_straight_from_the_scatter),
                    (f"mp={mp}:three_all_reduces", _three_all_reduces),
                    (f"mp={mp}:non_contiguous", _non_contiguous_logits_and_targets),
                    (f"mp={mp}:target_shape", _target_of_another_shape_is_refused),
                ]
                + [(f"mp={mp}:uneven_slices_{w}", functools.partial(_uneven_slices, w)) for w in (VOCAB_PER, 4097)]
                + [
                    (f"mp={mp}:empty_slice_{r}", functools.partial(_uneven_slices, VOCAB_PER, r))
                    for r in range(mp)
                    if mp > 1
                ]
            )
        finally:
            mpu.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
def test_cross_entropy(world_size: int) -> None:
    run_distributed(_ce_body, world_size)
