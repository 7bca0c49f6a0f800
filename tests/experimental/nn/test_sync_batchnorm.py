# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale's SyncBatchNorm in real gloo worlds: output, input gradient and running statistics equal one
BatchNorm over the global batch, weight/bias gradients are the local contributions (their sum is the global
gradient; torch.nn.SyncBatchNorm itself rejects CPU tensors, so the reference is BatchNorm1d/2d/3d), also under
checkpoint_wrapper (upstream skipped those tests as "broken at head"), with three
all-reduces per step; ranks that disagree on channels or dtype; plus conversion, eval mode and single-process use.
"""

import copy
import io
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import SyncBatchNorm
from fairscale.experimental.nn.sync_batchnorm import _track_running_stats
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import all_gather_into_flat, all_reduce, count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper

WORLD = 2
SHAPES = {"1d": (4, 3, 4), "2d": (4, 3, 4, 4), "3d": (4, 3, 4, 4, 4)}
BN = {"1d": nn.BatchNorm1d, "2d": nn.BatchNorm2d, "3d": nn.BatchNorm3d}


def _inputs(shape: Tuple[int, ...], world_size: int) -> List[Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world_size)]


def _gather(t: Tensor, world_size: int) -> Tensor:
    out = torch.empty((world_size,) + tuple(t.shape), dtype=t.dtype)
    all_gather_into_flat(out, t.contiguous())
    return out


def _check_parity(rank: int, world_size: int, dims: str, affine: bool, wrap: str) -> None:
    shape = SHAPES[dims]
    torch.manual_seed(0)
    ref = BN[dims](3, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(layer, SyncBatchNorm)
    model: nn.Module = layer
    if wrap == "checkpoint":
        model = checkpoint_wrapper(nn.Sequential(layer))
    elif wrap == "checkpoint_twice":
        model = checkpoint_wrapper(nn.Sequential(layer, layer))
    ref_model: nn.Module = nn.Sequential(ref, ref) if wrap == "checkpoint_twice" else ref
    inputs = _inputs(shape, world_size)
    grad_out = [torch.randn(shape, generator=torch.Generator().manual_seed(50 + r)) for r in range(world_size)]
    x = inputs[rank].clone().requires_grad_()
    with count_collectives() as counter:
        y = model(x)
        y.backward(grad_out[rank])
    # Forward: count + stats; backward: one reduction of the two per-channel sums (per use of the layer).
    uses = 2 if wrap == "checkpoint_twice" else 1
    assert counter.count("all_reduce") == 3 * uses, counter.summary()

    x_ref = torch.cat(inputs).requires_grad_()
    y_ref = ref_model(x_ref)
    y_ref.backward(torch.cat(grad_out))
    rows = shape[0]
    torch.testing.assert_close(y, y_ref[rank * rows : (rank + 1) * rows])
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad[rank * rows : (rank + 1) * rows])
    torch.testing.assert_close(layer.running_mean, ref.running_mean)
    torch.testing.assert_close(layer.running_var, ref.running_var)
    if affine:
        for p, q in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
            assert p.grad is not None and q.grad is not None
            local = p.grad.clone()
            all_reduce(local)  # local contributions add up to the global gradient
            torch.testing.assert_close(local, q.grad, rtol=1e-4, atol=1e-5)
            gathered = _gather(p.grad, world_size)
            assert world_size == 1 or not torch.allclose(gathered[0], gathered[1])  # not reduced by the layer itself


def _check_eval_and_errors(rank: int, world_size: int) -> None:
    layer = SyncBatchNorm(3).eval()
    with pytest.raises(ValueError, match="expected 4D input"):
        layer(torch.randn(2, 3, 4))  # eval goes through BatchNorm2d, as upstream
    with count_collectives() as counter:
        layer(torch.randn(2, 3, 4, 4))
    assert counter.count() == 0
    layer.train()
    with pytest.raises(ValueError, match="channels"):
        layer(torch.randn(2, 5, 4))
    layer.momentum = None
    with pytest.raises(RuntimeError, match="momentum=None"):
        layer(torch.randn(2, 3, 4))


def _check_ranks_disagree(rank: int, world_size: int) -> None:
    """Other channels or another input dtype on one rank: the same RanksDisagreeError on every rank, carried by the
    count's all-reduce (no extra collective), raised before anything changes; the group stays usable (gloo aborted
    the process before)."""
    for what, channels, dtype in [("channels", 3 + (rank == 1), torch.float32), ("dtype", 3, torch.float64)]:
        layer = SyncBatchNorm(channels).to(dtype if rank == 1 else torch.float32)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        x = torch.randn(4, layer.num_features, 5, dtype=dtype if rank == 1 else torch.float32)
        with count_collectives() as counter, pytest.raises(RanksDisagreeError, match="disagree on the layer's"):
            layer(x)
        assert counter.count("all_reduce") == 1, (what, counter.summary())
        for k, v in layer.state_dict().items():
            assert torch.equal(v, before[k]), (what, k)
    # Another momentum, eps, affine or track_running_stats on one rank (found by a rank-disagreement review): the
    # outputs and running statistics drifted apart silently. Carried by the same all-reduce.
    other = {"momentum": 0.5, "eps": 1e-3, "affine": False, "track_running_stats": False}
    for setting, value in other.items():
        layer = SyncBatchNorm(3, **({setting: value} if rank == 1 else {}))
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with count_collectives() as counter, pytest.raises(RanksDisagreeError, match="momentum, eps, affine or track"):
            layer(torch.randn(4, 3, 5))
        assert counter.count("all_reduce") == 1, (setting, counter.summary())
        for k, v in before.items():
            assert torch.equal(layer.state_dict()[k], v), (setting, k)
    # Nothing is left in flight: the next valid step runs normally.
    layer = SyncBatchNorm(3)
    with count_collectives() as counter:
        layer(torch.randn(4, 3, 5, requires_grad=True)).sum().backward()
    assert counter.count("all_reduce") == 3


def _check_one_rank_input_fails(rank: int, world_size: int) -> None:
    """A call that fails a check of its own on one rank (other channels, a 1-D input, momentum=None): that rank raised
    before the collectives and the others waited in them until the group's timeout. Now it takes part in the count's
    all-reduce with a flag, and every other rank raises too, at once."""
    for what in ("channels", "ndim", "momentum"):
        layer = SyncBatchNorm(3)
        if what == "momentum" and rank == 1:
            layer.momentum = None
        x = torch.randn(4, 3, 5)
        if rank == 1 and what == "channels":
            x = torch.randn(4, 4, 5)
        elif rank == 1 and what == "ndim":
            x = torch.randn(4)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        if rank == 1:
            expected = {"channels": "4 channels in dim 1", "ndim": "at least 2 dims", "momentum": "momentum=None"}
            with pytest.raises((ValueError, RuntimeError), match=expected[what]):
                layer(x)
        else:
            with pytest.raises(RuntimeError, match="the input of 1 other rank.* failed its own check"):
                layer(x)
        for k, v in layer.state_dict().items():
            assert torch.equal(v, before[k]), (what, k)
    layer = SyncBatchNorm(3)  # nothing left in flight
    with count_collectives() as counter:
        layer(torch.randn(4, 3, 5, requires_grad=True)).sum().backward()
    assert counter.count("all_reduce") == 3


def _check_one_value_per_channel(rank: int, world_size: int) -> None:
    """One value per channel over the whole group: torch's BatchNorm refuses it; the running variance became NaN."""
    layer = SyncBatchNorm(3)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(1 if rank == 0 else 0, 3)
    with pytest.raises(ValueError, match="expected more than 1 value per channel when training, got 1"):
        layer(x)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    # Where the count is not read (accelerators after the first forward), the update skips it instead of NaN.
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    _track_running_stats(running_mean, running_var, 0.1, torch.ones(3), torch.zeros(3), torch.ones(1))
    assert torch.equal(running_mean, torch.zeros(3)) and torch.equal(running_var, torch.ones(3))


def _check_float64_running_var(rank: int, world_size: int) -> None:
    """float64 running statistics get float64's digits: the Bessel factor was fp32 (1e-7 relative off)."""
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3).double()
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    inputs = [x.double() for x in _inputs((5, 3, 7), world_size)]
    layer(inputs[rank])
    ref(torch.cat(inputs))
    torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(layer.running_var, ref.running_var, rtol=1e-13, atol=1e-13)


def _world_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Callable[[], None]]] = []
    for dims in SHAPES:
        for affine in (True, False):
            cases.append(
                (f"{dims}-affine={affine}", lambda d=dims, a=affine: _check_parity(rank, world_size, d, a, "none"))
            )
    for wrap in ("checkpoint", "checkpoint_twice"):
        cases.append((wrap, lambda w=wrap: _check_parity(rank, world_size, "3d", True, w)))
    cases.append(("eval_and_errors", lambda: _check_eval_and_errors(rank, world_size)))
    cases.append(("float64_running_var", lambda: _check_float64_running_var(rank, world_size)))
    if world_size > 1:
        cases.append(("ranks_disagree", lambda: _check_ranks_disagree(rank, world_size)))
        cases.append(("one_rank_input_fails", lambda: _check_one_rank_input_fails(rank, world_size)))
        cases.append(("one_value_per_channel", lambda: _check_one_value_per_channel(rank, world_size)))
    run_cases(cases)


@pytest.mark.parametrize("world_size", [1, WORLD])
def test_sync_batchnorm_parity(world_size: int) -> None:
    run_distributed(_world_body, world_size)


def test_without_distributed_is_batchnorm2d() -> None:
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3)
    layer = SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(layer(x), ref(x))
    assert layer.disable_patch_batchnorm is True


def test_convert_shares_parameters_and_buffers() -> None:
    net = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(3)))
    bn = net[1]
    bn.qconfig = "q"  # type: ignore[assignment]
    converted = SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net
    assert isinstance(net[1], SyncBatchNorm) and isinstance(net[2][0], SyncBatchNorm)
    assert net[1].weight is bn.weight and net[1].running_mean is bn.running_mean
    assert net[1].num_batches_tracked is bn.num_batches_tracked and net[1].qconfig == "q"


def _torch_syncbn_body(rank: int, world_size: int) -> None:
    """On CUDA/NCCL (where torch.nn.SyncBatchNorm runs): outputs, input gradients and statistics agree with it."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    ours = SyncBatchNorm(3).to(device)
    theirs = nn.SyncBatchNorm(3).to(device)
    x = _inputs(SHAPES["2d"], world_size)[rank].to(device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    (ya * ya).sum().backward()
    (yb * yb).sum().backward()
    torch.testing.assert_close(ya, yb)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)


def test_parity_vs_torch_syncbn_cuda() -> None:
    run_distributed(_torch_syncbn_body, WORLD, device="cuda")  # skips without two GPUs


def _empty_batch_body(rank: int, world_size: int) -> None:
    # Rank 1's batch is empty: the statistics are rank 0's alone (were NaN on both ranks: the mean of nothing).
    x = torch.randn(3, 4, 3, 3, generator=torch.Generator().manual_seed(0)) * 2 + 1
    local = x if rank == 0 else x[:0]
    torch.manual_seed(0)
    sbn, ref = SyncBatchNorm(4), nn.BatchNorm2d(4)
    out = sbn(local)
    expected = ref(x)
    if rank == 0:
        torch.testing.assert_close(out, expected)
    else:
        assert out.shape == (0, 4, 3, 3)
    torch.testing.assert_close(sbn.running_mean, ref.running_mean)
    torch.testing.assert_close(sbn.running_var, ref.running_var)
    # Every rank empty: nothing to measure, the running statistics stay as they were.
    before = (sbn.running_mean.clone(), sbn.running_var.clone())
    assert sbn(x[:0]).shape == (0, 4, 3, 3)
    assert torch.equal(sbn.running_mean, before[0]) and torch.equal(sbn.running_var, before[1])


def test_empty_batches_contribute_nothing() -> None:
    run_distributed(_empty_batch_body, WORLD, timeout=60)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 1), SyncBatchNorm(3), nn.ReLU(), nn.Conv2d(3, 1, 1))


class _Twice(nn.Module):
    """One convolution + SyncBatchNorm block applied twice, each call its own checkpointed region when wrapped."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = nn.Sequential(nn.Conv2d(3, 3, 1), SyncBatchNorm(3))
        self.block = checkpoint_wrapper(block) if wrap else block

    def forward(self, x: Tensor) -> Tensor:
        return self.block(self.block(x) * 3 + 1)


def _checkpointed_calls_body(rank: int, world_size: int) -> None:
    # A forward without backward (a batch skipped for a non-finite loss) left its statistics for the next
    # recomputation to take (gradients off by 5 to 9); a layer called in two checkpointed regions, recomputed in
    # reverse order, took the other call's statistics (off by 5e3).
    plain, wrapped = _net(), checkpoint_wrapper(_net())
    skipped = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(10 + rank)) * 5 + 3
    x = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(20 + rank))
    for m in (plain, wrapped):
        m(skipped.requires_grad_())
        m(x).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert not wrapped[1].saved_for_2nd_fwd, "the statistics belong to the checkpointed call"
    y = torch.randn(2, 3, 3, 3, generator=torch.Generator().manual_seed(30 + rank))
    grads = []
    for wrap in (False, True):
        model = _Twice(wrap)
        model(y).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _nested(wrap: bool) -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Conv2d(2, 2, 1), SyncBatchNorm(2))
    outer = nn.Sequential(checkpoint_wrapper(inner) if wrap else inner, nn.Conv2d(2, 2, 1))
    return checkpoint_wrapper(outer) if wrap else outer


def _nested_checkpoints_body(rank: int, world_size: int) -> None:
    # The inner call's first pass runs inside the outer recomputation with both flags set: it computed no statistics
    # ("UnboundLocalError: 'mean'"); it takes those of the outer first pass.
    x = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(40 + rank))
    grads = []
    for wrap in (False, True):
        model = _nested(wrap)
        inp = x.clone().requires_grad_()
        model(inp).pow(2).sum().backward()
        grads.append([inp.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_nested_checkpointed_calls() -> None:
    run_distributed(_nested_checkpoints_body, WORLD, timeout=60)


def test_statistics_belong_to_their_checkpointed_call() -> None:
    run_distributed(_checkpointed_calls_body, WORLD, timeout=60)


def _far_from_zero_body(rank: int, world_size: int) -> List[float]:
    # E[x^2] - E[x]^2 in fp32 lost the variance of inputs far from zero: an error of 7.5 at mean 100 and std 0.01
    # (the output has unit std), NaN at mean 1000. Compared with the exact normalisation (float64) of the same fp32
    # inputs; fp32 itself keeps only a few digits of a spread that small (torch's BatchNorm2d: 2e-4 and 2e-3 off).
    errors = []
    for offset, std in ((100.0, 0.01), (1000.0, 0.01), (1000.0, 1.0)):
        xs = [torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(r)) * std + offset for r in range(2)]
        x64 = torch.cat(xs).double()
        mean, var = x64.mean((0, 2, 3), keepdim=True), x64.var((0, 2, 3), unbiased=False, keepdim=True)
        exact = ((x64 - mean) / torch.sqrt(var + 1e-5))[3 * rank : 3 * (rank + 1)]
        torch.manual_seed(0)
        sbn = SyncBatchNorm(2)
        out = sbn(xs[rank])
        errors.append((out.double() - exact).abs().max().item())
        unbiased = var.reshape(-1) * 96 / 95
        torch.testing.assert_close(sbn.running_var.double(), 0.9 + 0.1 * unbiased, atol=1e-6, rtol=1e-3)
    return errors


def test_inputs_far_from_zero_keep_their_variance() -> None:
    for errors in run_distributed(_far_from_zero_body, WORLD, timeout=60):
        assert errors[0] < 2e-3 and errors[1] < 2e-2 and errors[2] < 2e-4, errors  # were 7.5, NaN and 0.11


def test_copies_and_saves_whole() -> None:
    # The default group was stored at construction (dist.group.WORLD), which cannot be copied or pickled: an EMA copy
    # of a model with this layer failed. A copy with an explicit group synchronises over the same group.
    model = nn.Sequential(nn.Conv2d(2, 3, 1), SyncBatchNorm(3))
    clone = copy.deepcopy(model)
    assert clone[1]._process_group is None and clone[1].weight is not model[1].weight
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded[1].running_var, model[1].running_var)
    group = object()  # stands in for a process group: what matters is that it is shared, not copied
    layer = SyncBatchNorm(3, process_group=group)
    assert copy.deepcopy(layer)._process_group is group
