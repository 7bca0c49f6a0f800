# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel against the plain model where the checkpointed recomputation used to differ from its forward or fail:
train/eval switched between a forward and its backward, InstanceNorm running statistics, tuple inputs, in-place ops
at a slice start, CPU autocast, a frozen first slice, a 0-d output; and the model/device checks of the constructor.
"""

import copy
import warnings
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import OffloadModel, SyncBatchNorm
from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.device import accelerator_available

CPU = torch.device("cpu")


def _plain(model: nn.Module, x: Tensor, nmb: int) -> Tensor:
    """The plain model run the way OffloadModel runs it: chunk by chunk along the batch."""
    return torch.cat([model(c) for c in torch.chunk(x, nmb)])


def _assert_same_state(ref: nn.Module, offload: nn.Module, **tol: Any) -> None:
    """Parameters, their gradients and the buffers equal the plain model's (``tol``: for the gradients)."""
    for (name, p), q in zip(offload.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name)
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=f"grad of {name}", **tol)
    for (name, b), c in zip(offload.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, msg=name)


def _dropout_bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


@pytest.mark.parametrize("nmb", [1, 2])
def test_eval_between_forward_and_backward_keeps_the_forward_modes(nmb: int) -> None:
    """A validation pass (eval() and no_grad) between a training forward and its backward: the recomputation ran
    Dropout and BatchNorm in eval mode, and the gradients were not the plain model's."""
    ref = _dropout_bn_model()
    offload = OffloadModel(_dropout_bn_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=nmb)
    x, val = torch.randn(8, 4), torch.randn(8, 4)
    outs = []
    for model, run in ((ref, lambda m, t: _plain(m, t, nmb)), (offload, lambda m, t: m(t))):
        torch.manual_seed(1)
        y = run(model, x)
        model.eval()
        with torch.no_grad():
            outs.append(run(model, val))
        y.pow(2).sum().backward()
        model.train()
    torch.testing.assert_close(outs[0], outs[1])
    _assert_same_state(ref, offload)
    # The current modes are back after the backward, and a frozen layer (eval at the forward) stays frozen.
    assert all(m.training for m in offload.modules() if not isinstance(m, OffloadModel))


def test_frozen_batchnorm_at_the_forward_stays_frozen_in_the_recomputation() -> None:
    """The opposite switch: a BatchNorm frozen (eval) at the forward, put back in training mode before the backward."""
    ref = _dropout_bn_model()
    offload = OffloadModel(_dropout_bn_model(), CPU, num_slices=3, checkpoint_activation=True)
    x = torch.randn(8, 4)
    for model in (ref, offload):
        bn = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)][0]
        bn.eval()
        torch.manual_seed(1)
        y = model(x)
        bn.train()
        y.pow(2).sum().backward()
    _assert_same_state(ref, offload)


def _instance_norm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, track_running_stats=True, affine=True), nn.Conv1d(4, 4, 3),
        nn.Conv1d(4, 2, 3),
    )  # fmt: skip


@pytest.mark.parametrize("nmb", [1, 2])
def test_instance_norm_statistics_updated_once(nmb: int) -> None:
    """InstanceNorm with running statistics: the recomputation updated them a second time (only BatchNorm was
    frozen); now they equal the plain model's after several steps, and the eval output does too."""
    ref = _instance_norm_model()
    offload = OffloadModel(_instance_norm_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=nmb)
    for model, run in ((ref, lambda m, t: _plain(m, t, nmb)), (offload, lambda m, t: m(t))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 2, 12, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            run(model, x).pow(2).sum().backward()
            opt.step()
    _assert_same_state(ref, offload)
    norm = [m for m in offload.modules() if isinstance(m, nn.InstanceNorm1d)][0]
    assert norm.running_mean is not None and norm.running_mean.abs().sum() > 0  # updated, once per step
    ref.eval()
    offload.eval()
    x = torch.randn(4, 2, 12)
    torch.testing.assert_close(offload(x), ref(x))


def _linear_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("nmb", [1, 2])
def test_checkpoint_tuple_input_trains(nmb: int) -> None:
    """A tuple input (each tensor runs through the slices): the list output had no autograd link, so neither the
    parameters nor the inputs got a gradient. Now both equal the plain model's run on each input."""
    ref = _linear_model()
    offload = OffloadModel(_linear_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=nmb)
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    grads: List[Tuple[Tensor, Tensor]] = []
    for model in (ref, offload):
        xa, xb = a.clone().requires_grad_(), b.clone().requires_grad_()
        if model is ref:
            out = [_plain(ref, xa, nmb), _plain(ref, xb, nmb)]
        else:
            out = offload((xa, xb))
            assert isinstance(out, list) and len(out) == 2  # upstream's type
            assert all(o.grad_fn is not None for o in out)
        (out[0].pow(2).sum() + 3 * out[1].pow(2).sum()).backward()
        assert xa.grad is not None and xb.grad is not None
        grads.append((xa.grad, xb.grad))
    torch.testing.assert_close(grads[0], grads[1])
    _assert_same_state(ref, offload)


@pytest.mark.parametrize("bad", ["two", "none", "list", "mixed_tuple", "empty_tuple"])
def test_checkpoint_bad_inputs_are_refused_clearly(bad: str) -> None:
    offload = OffloadModel(_linear_model(), CPU, num_slices=3, checkpoint_activation=True)
    x = torch.randn(2, 4)
    args: Any = {
        "two": (x, x),
        "none": (None,),
        "list": ([x],),
        "mixed_tuple": ((x, 3),),
        "empty_tuple": ((),),
    }[bad]
    with pytest.raises(TypeError, match="OffloadModel with checkpoint_activation=True"):
        offload(*args)


class _Residual(nn.Sequential):
    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return x + super().forward(x)


class _Named(nn.Sequential):
    """A subclass without its own forward: its layers are the model."""


def test_sequential_subclass_with_own_forward_warns() -> None:
    """Its forward was dropped silently (only the layers ran): a warning says so (an error would refuse forwards that
    only call nn.Sequential's, which upstream ran); a subclass without its own forward is fine."""
    with pytest.warns(UserWarning, match="_Residual overrides nn.Sequential.forward"):
        OffloadModel(_Residual(nn.Linear(4, 4), nn.Tanh()), CPU, num_slices=2)
    model = _Named(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload = OffloadModel(model, CPU, num_slices=2)
    torch.testing.assert_close(offload(x), expected)


def _inplace_model() -> nn.Sequential:
    torch.manual_seed(0)
    act: Callable[[], nn.Module] = lambda: nn.LeakyReLU(0.1, inplace=True)  # noqa: E731
    return nn.Sequential(nn.Linear(4, 8), act(), nn.Linear(8, 8), act(), nn.Linear(8, 2))


@pytest.mark.parametrize("checkpoint, nmb", [(False, 1), (True, 1), (True, 2)])
def test_inplace_op_at_the_start_of_a_slice(checkpoint: bool, nmb: int) -> None:
    """The split puts an in-place LeakyReLU first in the last slice: both modes crashed; with checkpointing the
    forward also overwrote the input kept for the recomputation. A second backward (retain_graph) reads the kept
    input again and gives the same gradients."""
    ref = _inplace_model()
    offload = OffloadModel(_inplace_model(), CPU, num_slices=3, checkpoint_activation=checkpoint, num_microbatches=nmb)
    assert isinstance(offload.model_slices[-1].model_shard[0], nn.LeakyReLU)
    x = torch.randn(6, 4)
    x_ref, x_off = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = _plain(ref, x_ref, nmb), offload(x_off)
    torch.testing.assert_close(y, y_ref)
    y_ref.pow(2).sum().backward(retain_graph=True)
    y.pow(2).sum().backward(retain_graph=True)
    _assert_same_state(ref, offload)
    torch.testing.assert_close(x_off.grad, x_ref.grad)
    y_ref.pow(2).sum().backward()
    y.pow(2).sum().backward()
    _assert_same_state(ref, offload)


@pytest.mark.parametrize("nmb", [1, 2])
def test_checkpoint_under_cpu_autocast(nmb: int) -> None:
    """The recomputation replayed CUDA autocast only: under CPU autocast it ran in fp32 on the kept bf16 inputs and
    failed ("mat1 and mat2 must have the same dtype"). Now the gradients equal the plain autocast model's."""
    ref = _linear_model()
    offload = OffloadModel(_linear_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=nmb)
    x = torch.randn(8, 4)
    for model, run in ((ref, lambda m, t: _plain(m, t, nmb)), (offload, lambda m, t: m(t))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(model, x)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
    # bf16 rounding: with several micro-batches the plain model sums the chunks' weight gradients in bf16 (one cached
    # cast of each weight), the recomputation in fp32 (one backward per chunk).
    _assert_same_state(ref, offload, rtol=2e-2, atol=1e-2)


def _frozen_embedding_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("nmb", [1, 2])
def test_checkpoint_frozen_first_slice_on_token_ids(nmb: int) -> None:
    """A frozen embedding as the first slice, fed token ids: its recomputed output does not require grad, and the
    backward through it failed ("element 0 of tensors does not require grad")."""
    ref = _frozen_embedding_model()
    offload = OffloadModel(
        _frozen_embedding_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=nmb
    )
    assert [len(s.model_shard) for s in offload.model_slices][0] == 1
    tokens = torch.randint(0, 10, (6, 3), generator=torch.Generator().manual_seed(0))
    for model, run in ((ref, lambda m, t: _plain(m, t, nmb)), (offload, lambda m, t: m(t))):
        run(model, tokens).pow(2).sum().backward()
    _assert_same_state(ref, offload)


class _MeanSquare(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.pow(2).mean()


def _loss_head_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), _MeanSquare())


def test_checkpoint_zero_dim_output() -> None:
    """A loss head (0-d output) trains with one micro-batch (torch.cat failed on it); with several, the error names
    OffloadModel, the slice and what to do."""
    ref = _loss_head_model()
    offload = OffloadModel(_loss_head_model(), CPU, num_slices=3, checkpoint_activation=True)
    x = torch.randn(5, 4)
    loss_ref, loss = ref(x), offload(x)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, loss_ref)
    loss_ref.backward()
    loss.backward()
    _assert_same_state(ref, offload)
    several = OffloadModel(_loss_head_model(), CPU, num_slices=3, checkpoint_activation=True, num_microbatches=2)
    with pytest.raises(ValueError, match="slice 2 returned a 0-d tensor .* use num_microbatches=1"):
        several(x)


def test_meta_offload_device_is_refused() -> None:
    """The caller's layers were moved to meta (their weights lost) and only the first forward failed."""
    model = _linear_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="`offload_device` .* is a meta device"):
        OffloadModel(model, CPU, offload_device=torch.device("meta"))
    for p, q in zip(model.parameters(), before):
        assert p.device == CPU and torch.equal(p.detach(), q)


@pytest.mark.skipif(accelerator_available(), reason="device=0 is a real device here")
def test_device_zero_is_a_device_not_none() -> None:
    """``device=0`` is torch's shorthand for ``cuda:0``; it was reported as None."""
    with pytest.raises(TypeError, match="CUDA must be available"):
        OffloadModel(_linear_model(), 0)  # type: ignore[arg-type]


def _sync_bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), SyncBatchNorm(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 2, 1)
    )


def _sync_bn_eval_between(rank: int, world_size: int) -> None:
    ref = _sync_bn_model()
    offload = OffloadModel(_sync_bn_model(), CPU, num_slices=3, checkpoint_activation=True)
    x = torch.randn(4, 2, 5, 5, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    val = torch.randn(4, 2, 5, 5)
    for model in (ref, offload):
        y = model(x)
        model.eval()
        with torch.no_grad():
            model(val)
        y.pow(2).sum().backward()
        model.train()
    _assert_same_state(ref, offload)


def test_sync_batchnorm_eval_between_forward_and_backward() -> None:
    """fairscale's SyncBatchNorm on 2 gloo ranks: the recomputation runs it in the forward's training mode (it used
    the running statistics after an eval() in between) and leaves its running statistics alone."""
    run_distributed(_sync_bn_eval_between, 2, timeout=120)
