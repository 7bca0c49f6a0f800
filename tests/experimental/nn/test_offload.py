# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel: training equals the plain model (outputs, input and parameter gradients, parameters after steps)
in every mode, slices are balanced as upstream, and bad arguments raise upstream's errors.

On CPU the compute device is the CPU (every move is a no-op, the algorithm still runs: slices, sync layers,
recomputation per micro-batch). The CUDA variant moves slices between the CPU and the GPU for real.
"""

import copy
from typing import List, Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.experimental.nn import OffloadModel
from fairscale.experimental.nn.auto_shard import shard_model
from fairscale.experimental.nn.offload import _split
from fairscale.internal.device import accelerator_available

MODES = [(False, 1), (True, 1), (True, 5)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not accelerator_available(), reason="needs a GPU"))]


def _model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(2, 20)]
    for _ in range(10):
        layers += [nn.Linear(20, 20), nn.Dropout(dropout)] if dropout else [nn.Linear(20, 20)]
    layers.append(nn.Linear(20, 2))
    return nn.Sequential(*layers)


def _train(model: nn.Module, device: torch.device, steps: int = 2) -> Tuple[List[Tensor], List[Tensor], Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, outs = [], []
    x = None
    for step in range(steps):
        x = torch.randn(32, 2, generator=torch.Generator().manual_seed(step)).to(device).requires_grad_()
        torch.manual_seed(100 + step)
        out = model(x)
        loss = nn.functional.mse_loss(out, torch.zeros_like(out), reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
        outs.append(out.detach().cpu())
    assert x is not None and x.grad is not None
    return losses, outs, x.grad.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_training_equals_plain_model(device: str) -> None:
    dev = torch.device(device)
    for checkpoint, nmb in MODES:
        ref = _model().to(dev)
        offload = OffloadModel(_model(), dev, num_slices=3, checkpoint_activation=checkpoint, num_microbatches=nmb)
        ref_losses, ref_outs, ref_xgrad = _train(ref, dev)
        losses, outs, xgrad = _train(offload, dev)
        for a, b in zip(ref_losses + ref_outs, losses + outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # Upstream never produced the input gradient; here it equals the plain model's.
        torch.testing.assert_close(ref_xgrad, xgrad, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(offload.named_parameters(), ref.parameters()):
            assert p.device == torch.device("cpu"), name  # at rest on the offload device
            torch.testing.assert_close(p.detach(), q.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_recomputation_replays_rng() -> None:
    """Checkpointed recomputation restores the RNG of each slice's forward, so dropout masks match."""
    ref = _model(0.3)
    offload = OffloadModel(_model(0.3), torch.device("cpu"), num_slices=3, checkpoint_activation=True)
    ref_losses, _, ref_xgrad = _train(ref, torch.device("cpu"), steps=2)
    losses, _, xgrad = _train(offload, torch.device("cpu"), steps=2)
    torch.testing.assert_close(torch.stack(ref_losses), torch.stack(losses))
    torch.testing.assert_close(ref_xgrad, xgrad)


def test_auto_shard_slices_and_shapes() -> None:
    model = _model()
    slices = shard_model(nn.Sequential(*model), shard_count=3)
    offload = OffloadModel(slices, torch.device("cpu"))
    assert len(offload.model_slices) == len(slices)
    x = torch.randn(4, 2)
    torch.testing.assert_close(offload(x), model(x))
    # Last-layer width 1: (N, 1) without checkpointing, (N,) with it (upstream's squeeze(-1)).
    narrow = [nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)]
    assert OffloadModel(nn.Sequential(*copy.deepcopy(narrow)), torch.device("cpu"), num_slices=2)(x).shape == (4, 1)
    ck = OffloadModel(nn.Sequential(*narrow), torch.device("cpu"), num_slices=2, checkpoint_activation=True)
    assert ck(x).shape == (4,)


def test_split_balances_parameters() -> None:
    model = _model()
    assert [len(s) for s in _split(model, 3)] == [4, 3, 5]
    assert [len(s) for s in _split(model, 2)] == [5, 7]
    assert [len(s) for s in _split(model, 50)] == [1] * 12
    assert [len(s) for s in _split(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)), 2)] == [1, 2]
    offload = OffloadModel(model, torch.device("cpu"), num_slices=3)
    names = [n for n, _ in offload.named_parameters()]
    assert names[0] == "_model.0.model_shard.0.weight"
    offload.eval()
    assert not offload.model_slices[0].model_shard[0].training


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="cannot be None"):
        OffloadModel(None, torch.device("cpu"))
    with pytest.raises(TypeError, match="has no layers"):
        OffloadModel(nn.Sequential(), torch.device("cpu"))  # a TypeError as upstream's, which said "cannot be None"
    with pytest.raises(TypeError, match="`device` argument"):
        OffloadModel(_model(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be of type"):
        OffloadModel(nn.Linear(2, 2), torch.device("cpu"))
    with pytest.raises(TypeError, match="item 1 is a int"):
        OffloadModel([nn.Linear(2, 2), 3], torch.device("cpu"))  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="only support microbatches with activation checkpointing"):
        OffloadModel(_model(), torch.device("cpu"), num_microbatches=2)
    if not accelerator_available():
        with pytest.raises(TypeError, match="CUDA must be available"):
            OffloadModel(_model(), torch.device("cuda"))


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(num_slices=0), ValueError, "num_slices must be a positive integer, got 0"),
        (dict(num_slices=-1), ValueError, "num_slices must be a positive integer, got -1"),
        (dict(num_slices=2.5), TypeError, "num_slices must be an int, got float"),
        (dict(num_microbatches=0, checkpoint_activation=True), ValueError, "num_microbatches must be a positive"),
        (dict(num_microbatches=-1, checkpoint_activation=True), ValueError, "num_microbatches must be a positive"),
        (dict(num_microbatches=0), ValueError, "num_microbatches must be a positive integer, got 0"),
        (dict(num_microbatches="2", checkpoint_activation=True), TypeError, "num_microbatches must be an int"),
        # A string was truthy: "no" checkpointed.
        (dict(checkpoint_activation="no"), TypeError, "`checkpoint_activation` .* must be a bool, got 'no'"),
        (dict(checkpoint_activation=2), TypeError, "`checkpoint_activation` .* must be a bool, got 2"),
    ],
)
def test_bad_counts_are_refused_at_construction(kwargs: dict, error: type, text: str) -> None:
    """Upstream divided by zero, indexed out of range, or failed only in the first forward."""
    with pytest.raises(error, match=text):
        OffloadModel(_model(), torch.device("cpu"), **kwargs)
    # The same for a model given as its slices (num_slices is not used then, but a bad value is still a mistake).
    with pytest.raises(error, match=text):
        OffloadModel(list(_model()), torch.device("cpu"), **kwargs)


def test_failed_load_changes_nothing() -> None:
    """A dict with one entry of another shape (the last one: torch would have copied all the others first) raises
    torch's error and leaves every slice as it was; a dict that fits loads."""
    offload = OffloadModel(_model(), torch.device("cpu"), num_slices=3)
    before = {k: v.clone() for k, v in offload.state_dict().items()}
    spoiled = {k: torch.zeros_like(v) for k, v in before.items()}
    last = list(spoiled)[-1]
    spoiled[last] = torch.zeros(spoiled[last].numel() + 1)
    with pytest.raises(RuntimeError, match=f"size mismatch for {last}"):
        offload.load_state_dict(spoiled)
    for key, value in offload.state_dict().items():
        assert torch.equal(value, before[key]), key
    # A meta value (a shape without data) passed the shape-only dry run and failed partway in the real load.
    spoiled[last] = torch.zeros_like(before[last], device="meta")
    with pytest.raises(RuntimeError, match=f"{last}: the state dict holds a meta tensor"):
        offload.load_state_dict(spoiled)
    for key, value in offload.state_dict().items():
        assert torch.equal(value, before[key]), key
    spoiled[last] = torch.zeros_like(before[last])
    offload.load_state_dict(spoiled)
    assert all(not v.any() for v in offload.state_dict().values())


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))


def _plain(model: nn.Module, x: Tensor, nmb: int) -> Tensor:
    """The plain model run the way OffloadModel runs it: chunk by chunk along the batch (BatchNorm sees chunks)."""
    return torch.cat([model(c) for c in torch.chunk(x, nmb)])


def _assert_same_state(ref: nn.Module, offload: OffloadModel) -> None:
    """Parameters, their gradients and the buffers (BatchNorm running statistics) equal the plain model's."""
    for (name, p), q in zip(offload.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name)
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=f"grad of {name}")
    for (name, b), c in zip(offload.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, msg=name)


@pytest.mark.parametrize("nmb", [1, 2])
@pytest.mark.parametrize("between", ["no_grad_forward", "second_loss"])
def test_checkpoint_backward_uses_its_own_forward(between: str, nmb: int) -> None:
    """Another forward between a forward and its backward (a no_grad validation pass; a second batch whose loss is
    added to the first) leaves that backward's gradients as the plain model's: each call keeps its own state."""
    ref = _bn_model()
    offload = OffloadModel(
        _bn_model(), torch.device("cpu"), num_slices=3, checkpoint_activation=True, num_microbatches=nmb
    )
    x1, x2 = torch.randn(8, 3, generator=torch.Generator().manual_seed(1)), torch.randn(8, 3)
    outs = []
    for model, run in ((ref, lambda m, x: _plain(m, x, nmb)), (offload, lambda m, x: m(x))):
        y1 = run(model, x1)
        if between == "no_grad_forward":
            with torch.no_grad():
                y2 = run(model, x2)
            y1.sum().backward()
        else:
            y2 = run(model, x2)
            (y1.sum() + y2.pow(2).sum()).backward()
        outs.append((y1.detach(), y2.detach()))
    torch.testing.assert_close(outs[0], outs[1])
    _assert_same_state(ref, offload)


@pytest.mark.parametrize("nmb", [1, 2])
def test_checkpoint_batchnorm_statistics_updated_once_per_forward(nmb: int) -> None:
    """The recomputation in backward does not update BatchNorm's running statistics a second time; an eval forward
    does not update them at all."""
    ref = _bn_model()
    offload = OffloadModel(
        _bn_model(), torch.device("cpu"), num_slices=2, checkpoint_activation=True, num_microbatches=nmb
    )
    for model, run in ((ref, lambda m, x: _plain(m, x, nmb)), (offload, lambda m, x: m(x))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            run(model, x).pow(2).sum().backward()
            opt.step()
    _assert_same_state(ref, offload)
    bn = [m for m in offload.modules() if isinstance(m, nn.BatchNorm1d)][0]
    assert bn.num_batches_tracked.item() == 3 * nmb
    offload.eval()
    ref.eval()
    x = torch.randn(8, 3)
    torch.testing.assert_close(offload(x), ref(x))
    assert bn.num_batches_tracked.item() == 3 * nmb
    assert bn.track_running_stats  # restored after each recomputation


@pytest.mark.parametrize("nmb", [1, 2])
def test_checkpoint_width1_boundary_between_slices(nmb: int) -> None:
    """A slice whose output has last dim 1 feeds the next slice unchanged (upstream squeezed every slice output)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 4), nn.Linear(4, 1))
    offload = OffloadModel(
        copy.deepcopy(ref), torch.device("cpu"), num_slices=3, checkpoint_activation=True, num_microbatches=nmb
    )
    assert [len(s.model_shard) for s in offload.model_slices] == [1, 1, 1]
    x = torch.randn(6, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = offload(x), ref(x_ref)
    # Only the model output keeps upstream's squeeze(-1) in checkpoint mode.
    assert out.shape == (6,)
    torch.testing.assert_close(out, out_ref.squeeze(-1))
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    _assert_same_state(ref, offload)
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("batch, nmb", [(3, 2), (7, 3), (1, 1)])
def test_checkpoint_one_dimensional_output_with_a_one_row_micro_batch(batch: int, nmb: int) -> None:
    """A 1-D model output (``Flatten(0)``) whose last micro-batch has one row: its recomputation was squeezed to 0-d
    and backward failed ("Mismatch in shape"), upstream trained; a batch of one failed in both ("chunk expects at
    least a 1-dimensional tensor")."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Flatten(0))
    offload = OffloadModel(
        copy.deepcopy(ref), torch.device("cpu"), num_slices=2, checkpoint_activation=True, num_microbatches=nmb
    )
    x = torch.randn(batch, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = offload(x), ref(x_ref)
    torch.testing.assert_close(out.reshape(-1), out_ref)  # a batch of one comes back 0-d: upstream's squeeze(-1)
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    _assert_same_state(ref, offload)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_failed_forward_leaves_pending_backward_alone() -> None:
    """Without checkpointing too, a later forward (here one that fails half way) does not break the backward of an
    earlier one: the sync layers' backward reads only its own call's state."""
    ref = _bn_model()
    offload = OffloadModel(_bn_model(), torch.device("cpu"), num_slices=3)
    x = torch.randn(8, 3)
    y = offload(x)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        offload(torch.randn(8, 4))
    y.sum().backward()
    ref(x).sum().backward()
    _assert_same_state(ref, offload)


def test_checkpoint_backward_frees_the_slice_inputs() -> None:
    """The slice inputs a checkpointed call keeps for its backward are freed by it (a plain ctx attribute kept them,
    and every loss kept for logging held a copy of every slice's inputs); retain_graph keeps them for a second one."""
    torch.manual_seed(0)
    offload = OffloadModel(_model(), device=torch.device("cpu"), num_slices=3, checkpoint_activation=True)
    loss = offload(torch.randn(4, 2)).sum()
    node = loss.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "OffloadFunctionBackward" and len(node.saved_tensors) == 3
    loss.backward(retain_graph=True)
    assert len(node.saved_tensors) == 3
    loss.backward()
    with pytest.raises(RuntimeError, match="freed"):
        node.saved_tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuple_input", [False, True])
def test_checkpoint_input_gradient_on_the_input_device(device: str, tuple_input: bool) -> None:
    """A CPU batch that requires grad, fed to a model computing on ``device``: the checkpointed backward returned the
    input gradients on the compute device, which autograd refuses ("expected device cpu but got cuda:0")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    offload = OffloadModel(model, torch.device(device), num_slices=2, checkpoint_activation=True)
    xs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(2)]
    xs_ref = [x.detach().clone().requires_grad_() for x in xs]
    out = offload(tuple(xs)) if tuple_input else offload(xs[0])
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    sum(o.sum() for o in outs).backward()
    expected = [ref(x) for x in (xs_ref if tuple_input else xs_ref[:1])]
    sum(e.sum() for e in expected).backward()
    for x, x_ref in zip(xs if tuple_input else xs[:1], xs_ref):
        assert x.grad is not None and x.grad.device == torch.device("cpu")
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
