# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DeferredBatchNorm's state through unusual calls: an empty mini-batch, a forward that raises.

The reference for the running statistics is a plain batch norm run on each whole mini-batch (what a deferred batch
norm stands for); the outputs are those of the plain layers run per micro-batch.
"""

from copy import deepcopy

import pytest
import torch
from torch import nn

from fairscale.nn import Pipe
from fairscale.nn.pipe.batchnorm import DeferredBatchNorm


def accumulators(dbn: DeferredBatchNorm):
    return dbn.sum.clone(), dbn.sum_squares.clone(), dbn.counter, dbn.tracked


def assert_same_accumulators(before, after) -> None:
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]


def per_micro_batch(module: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.cat([module(c) for c in x.chunk(chunks)])


class WholeBatchNorm(nn.BatchNorm1d):
    """A plain batch norm run on each whole mini-batch, whose running variance is the population (biased) variance
    as DeferredBatchNorm's is (upstream's choice; torch keeps the unbiased one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.numel() == 0:
            return super().forward(x)
        previous_var = self.running_var.clone()
        out = super().forward(x)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        biased_var = x.var([0, *range(2, x.dim())], unbiased=False)
        self.running_var.copy_(previous_var * (1 - factor) + biased_var * factor)
        return out


@pytest.mark.parametrize("momentum", [0.1, None])
def test_empty_mini_batch_leaves_the_running_statistics(momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 2))
    plain = deepcopy(model)  # run per micro-batch: the outputs
    whole = WholeBatchNorm(4, momentum=momentum)  # run per mini-batch: the running statistics
    pipe = Pipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    dbn = pipe[0]

    empty = torch.zeros(0, 4)
    out = pipe(empty)
    whole(empty)
    assert out.shape == per_micro_batch(plain, empty, 2).shape == (0, 2)
    assert torch.equal(dbn.running_mean, whole.running_mean) and torch.equal(dbn.running_var, whole.running_var)
    assert int(dbn.num_batches_tracked) == int(whole.num_batches_tracked) == 1

    for _ in range(3):
        x = torch.randn(8, 4) * 3 + 1
        assert torch.allclose(pipe(x), per_micro_batch(plain, x, 2), atol=1e-5)
        whole(x)
    assert torch.allclose(dbn.running_mean, whole.running_mean, atol=1e-5)
    assert torch.allclose(dbn.running_var, whole.running_var, rtol=1e-3, atol=1e-4)
    assert int(dbn.num_batches_tracked) == int(whole.num_batches_tracked) == 4

    pipe.eval()
    whole.eval()
    plain[0].load_state_dict(whole.state_dict())
    plain.eval()
    x = torch.randn(2, 4)
    out = pipe(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, plain(x), rtol=1e-3, atol=1e-4)


def test_micro_batches_without_elements_leave_the_running_statistics():
    # (N, C, 0): every micro-batch has rows but no element per channel.
    dbn = DeferredBatchNorm(3, chunks=2)
    bn = nn.BatchNorm1d(3)
    x = torch.zeros(4, 3, 0)
    assert per_micro_batch(dbn, x, 2).shape == bn(x).shape == (4, 3, 0)
    assert torch.equal(dbn.running_mean, bn.running_mean) and torch.equal(dbn.running_var, bn.running_var)
    assert (dbn.counter, dbn.tracked) == (0, 0)


def test_failed_forward_leaves_the_partial_sums():
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.BatchNorm1d(3)), balance=[1], devices=["cpu"], chunks=2, deferred_batch_norm=True)
    dbn = pipe[0]
    whole = WholeBatchNorm(3)
    before = accumulators(dbn)
    # One value per channel in training: a plain batch norm refuses it before touching its buffers.
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        pipe(torch.full((1, 3), 100.0))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        whole(torch.full((1, 3), 100.0))
    assert_same_accumulators(before, accumulators(dbn))

    for _ in range(2):
        x = torch.randn(8, 3)
        pipe(x)
        whole(x)
        # Each good mini-batch is committed whole, on its own.
        assert (dbn.counter, dbn.tracked) == (0, 0)
        assert torch.allclose(dbn.running_mean, whole.running_mean, atol=1e-6)
        assert torch.allclose(dbn.running_var, whole.running_var, rtol=1e-4, atol=1e-6)


def test_input_of_another_dtype_leaves_the_partial_sums():
    dbn = DeferredBatchNorm(3, chunks=2)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        bn(x)
    before = accumulators(dbn)
    with pytest.raises(RuntimeError):
        dbn(x)
    assert_same_accumulators(before, accumulators(dbn))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels", [1, 5])
def test_input_with_other_channels_is_refused(affine, channels):
    # Without affine parameters a 1-channel input was broadcast into the 3 sums, silently.
    dbn = DeferredBatchNorm(3, affine=affine, chunks=2)
    bn = nn.BatchNorm1d(3, affine=affine)
    x = torch.randn(4, channels)
    with pytest.raises(RuntimeError):
        bn(x)
    before = accumulators(dbn)
    with pytest.raises(ValueError, match=r"DeferredBatchNorm\(3\) got an input with .* channels"):
        dbn(x)
    assert_same_accumulators(before, accumulators(dbn))


def test_a_load_in_the_middle_of_a_carried_over_mini_batch_resumes_it():
    # The counts of the unfinished mini-batch were plain attributes, not saved: a load paired the loaded partial sums
    # with the loading instance's counts (0 in a fresh model), and the next commit divided them by the wrong number,
    # silently (session 37). They travel in the state dict's metadata now (no new entries: upstream loads it).
    torch.manual_seed(0)
    x = torch.randn(16, 3) * 2 + 1
    original = DeferredBatchNorm(3, chunks=4)
    for c in x[:8].chunk(2):  # two micro-batches of four: carried over
        original(c)
    state = original.state_dict()
    assert set(state) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked", "sum", "sum_squares"}
    resumed = DeferredBatchNorm(3, chunks=4)
    resumed.load_state_dict(state)
    for module in (original, resumed):
        for c in x[8:].chunk(2):
            module(c)
    reference = WholeBatchNorm(3)
    reference(x)
    for module in (original, resumed):
        torch.testing.assert_close(module.running_mean, reference.running_mean)
        torch.testing.assert_close(module.running_var, reference.running_var)
        assert module.counter == 0 and module.tracked == 0


def test_partial_sums_without_their_counts_are_dropped_with_a_warning():
    original = DeferredBatchNorm(3, chunks=4)
    original(torch.randn(4, 3))
    state = original.state_dict()
    del state._metadata  # as upstream fairscale saves it: no counts
    resumed = DeferredBatchNorm(3, chunks=4)
    resumed(torch.randn(4, 3))  # its own carried-over micro-batch is replaced by the load
    with pytest.warns(UserWarning, match="partial sums of an unfinished mini-batch"):
        resumed.load_state_dict(state)
    assert resumed.counter == 0 and resumed.tracked == 0 and not resumed.sum.any()
    torch.testing.assert_close(resumed.running_mean, original.running_mean)


def test_a_pipe_load_carries_the_counts_through_its_all_or_nothing_load():
    def make() -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        return Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)

    pipe = make()
    pipe(torch.randn(6, 3))  # three micro-batches of two: carried over
    loaded = make()
    loaded.load_state_dict(pipe.state_dict())  # tried on shape-only tensors first, then for real
    bn = loaded.partitions[0][1]
    assert (bn.counter, bn.tracked) == (6, 3)


def test_a_resume_with_fewer_chunks_commits_the_carried_micro_batches():
    # Counts loaded from a pipe with more chunks (3 micro-batches carried over, now chunks=2) were past `chunks`, and
    # the commit came only on equality: the statistics were never updated again (review, session 37).
    torch.manual_seed(0)
    original = DeferredBatchNorm(3, chunks=4)
    for c in torch.randn(6, 3).chunk(3):
        original(c)
    resumed = DeferredBatchNorm(3, chunks=2)
    resumed.load_state_dict(original.state_dict())
    assert resumed.tracked == 3
    resumed(torch.randn(2, 3))
    assert int(resumed.num_batches_tracked) == 1 and resumed.tracked == 0
    for c in torch.randn(4, 3).chunk(2):
        resumed(c)
    assert int(resumed.num_batches_tracked) == 2


def _deferred_pipe() -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    return Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)


@pytest.mark.parametrize("assign", [False, True])
def test_a_failed_pipe_load_leaves_the_counts(assign: bool):
    # With assign=True the all-or-nothing load's trial run holds the state dict's real tensors (not shape-only ones),
    # and it set the loaded counts before a later partition's wrong shape failed the load (review, session 37).
    source = _deferred_pipe()
    source(torch.randn(9, 3))  # three micro-batches of three carried over: counts (9, 3)
    bad = source.state_dict()
    bad["partitions.1.2.weight"] = torch.zeros(7)  # the last partition's weight, wrong shape
    target = _deferred_pipe()
    target(torch.randn(6, 3))  # three of two carried over: counts (6, 3)
    bn = target.partitions[0][1]
    before = accumulators(bn)
    with pytest.raises(RuntimeError, match="size mismatch"):
        target.load_state_dict(bad, assign=assign)
    assert_same_accumulators(before, accumulators(bn))


def test_an_assign_load_without_counts_leaves_the_callers_tensors():
    # Upstream's format (partial sums, no counts) is dropped with a warning; with assign=True the dropped sums were
    # the caller's own tensors, zeroed in place (review, session 37).
    original = DeferredBatchNorm(3, chunks=4)
    original(torch.randn(4, 3))
    state = dict(original.state_dict())  # a plain dict: no metadata, as upstream saves it
    kept = state["sum"].clone()
    resumed = DeferredBatchNorm(3, chunks=4)
    with pytest.warns(UserWarning, match="partial sums of an unfinished mini-batch"):
        resumed.load_state_dict(state, assign=True)
    assert torch.equal(state["sum"], kept)
    assert not resumed.sum.any() and resumed.counter == 0 and resumed.tracked == 0
