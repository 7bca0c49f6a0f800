# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Inputs and outputs of any structure (dicts, lists, kwargs, namedtuples), and the root's input casts."""

import collections
import dataclasses
from typing import Any, Dict, List

import pytest
import torch
from _models import MIXED, assert_close_dict, assert_idle, gather_full_grads
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel._fsdp.io import cast_inputs

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass(frozen=True)
class Item:
    """A batch as a dataclass: the root's cast must reach inside it (it left it fp32 beside bf16 weights)."""

    t: Tensor
    parts: Dict[str, Tensor]
    name: str


@dataclasses.dataclass
class Scaled:
    """Its ``__post_init__`` scales by an ``InitVar``: the cast must not build it again (``dataclasses.replace``
    failed on the ``InitVar`` and would have scaled twice)."""

    t: Tensor
    factor: dataclasses.InitVar[float]

    def __post_init__(self, factor: float) -> None:
        self.t = self.t * factor


class StructuredIO(nn.Module):
    """Takes a dict, a list, a namedtuple, a dataclass and keyword arguments; returns a dict holding a list. Records
    dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: Dict[str, Any] = {}

    def forward(
        self, batch: Dict[str, Any], extra: List[Tensor], pair: Pair, *, bias: Tensor, item: Item, scaled: Scaled
    ) -> Dict[str, Any]:
        self.seen = {
            "x": batch["x"].dtype,
            "x_requires_grad": batch["x"].requires_grad,
            "mask": batch["mask"].dtype,
            "double": batch["double"].dtype,
            "extra": [t.dtype for t in extra],
            "pair_type": type(pair),
            "pair": (pair.a.dtype, pair.b),
            "bias": bias.dtype,
            "tag": batch["tag"],
            "scale": batch["scale"],
            "item": (type(item), item.t.dtype, item.parts["p"].dtype, item.name),
            "scaled": (type(scaled), scaled.t.dtype, scaled.t.float().sum().item()),
        }
        h = self.linear(batch["x"] * batch["scale"]) * batch["mask"].unsqueeze(-1)
        h = h + extra[0] + bias + pair.a + item.t * item.parts["p"] + scaled.t
        return {"out": h, "aux": [h.sum(-1), extra[1].sum()]}


def _inputs() -> Any:
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    batch = {
        "x": x,
        "mask": torch.tensor([1, 0, 1]),
        "double": torch.ones(2, dtype=torch.float64),
        "tag": "t",
        "scale": 2,
    }
    extra = [torch.randn(3, 4), torch.randn(5)]
    return (
        x,
        batch,
        extra,
        Pair(torch.randn(3, 4), 7),
        torch.randn(4),
        Item(torch.randn(3, 4), {"p": torch.randn(4)}, "i"),
        Scaled(torch.ones(3, 4), 2.0),
    )


def _structured(rank: int, ws: int, mp: str) -> None:
    torch.manual_seed(1)
    ref = StructuredIO()
    model = StructuredIO()
    model.load_state_dict(ref.state_dict())
    fsdp = FSDP(model, **MIXED[mp])
    x, batch, extra, pair, bias, item, scaled = _inputs()
    out = fsdp(batch, extra, pair, bias=bias, item=item, scaled=scaled)
    seen = fsdp.module.module.seen
    low = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mp]
    # The root casts fp32 floating tensors, anywhere in the structure, to the compute dtype; nothing else.
    assert seen["x"] == low and seen["extra"] == [low, low] and seen["bias"] == low and seen["pair"] == (low, 7)
    assert seen["mask"] == torch.int64 and seen["double"] == torch.float64
    assert seen["pair_type"] is Pair and seen["tag"] == "t" and seen["scale"] == 2
    assert seen["item"] == (Item, low, low, "i") and item.t.dtype == torch.float32  # the caller's object unchanged
    assert seen["scaled"] == (Scaled, low, 24.0) and scaled.t.dtype == torch.float32  # scaled once, at construction
    assert seen["x_requires_grad"], "a leaf input that requires grad must still require grad after the cast"
    assert isinstance(out, dict) and isinstance(out["aux"], list) and out["out"].dtype == low
    (out["out"].float().sum() + out["aux"][0].float().sum()).backward()
    assert_idle(fsdp)
    ref_out = ref(batch, extra, pair, bias=bias, item=item, scaled=scaled)
    (ref_out["out"].sum() + ref_out["aux"][0].sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-6) if mp == "fp32" else dict(rtol=3e-2, atol=3e-2)
    assert_close_dict(gather_full_grads(fsdp), {n: p.grad for n, p in ref.named_parameters()}, "grad", **tol)


def _structured_inputs_and_outputs_body(rank: int, ws: int) -> None:
    run_cases((mp, lambda mp=mp: _structured(rank, ws, mp)) for mp in ("fp32", "fp16", "bf16"))


@pytest.mark.parametrize("world_size", [1, 2])
def test_structured_inputs_and_outputs(world_size: int) -> None:
    run_distributed(_structured_inputs_and_outputs_body, world_size)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: List[Any] = []

    def forward(self, x: Any) -> Any:
        if isinstance(x, PackedSequence):
            self.seen.append((PackedSequence, x.data.dtype))
            return x.data.sum()
        self.seen.append(x.dtype)
        return self.linear(x.to(self.linear.weight.dtype))


def _only_the_root_casts_and_force_input_to_fp32_body(rank: int, ws: int) -> None:
    # A non-root instance gets its input as the parent produced it (fp32 here), without a cast.
    inner = FSDP(Recorder(), mixed_precision=True)
    outer = nn.Sequential(nn.Identity())
    outer.add_module("inner", inner)

    class MakesFp32(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = outer

        def forward(self, x: Tensor) -> Tensor:
            return self.body(x.float())  # undo the root's cast on purpose

    root = FSDP(MakesFp32(), mixed_precision=True)
    root(torch.randn(2, 4)).float().sum().backward()
    assert inner.module.module.seen == [torch.float32]
    # force_input_to_fp32 (no mixed precision): fp16 inputs become fp32, and gradients flow back to them.
    forced = FSDP(Recorder(), force_input_to_fp32=True)
    x = torch.randn(2, 4, dtype=torch.float16, requires_grad=True)
    forced(x).sum().backward()
    assert forced.module.module.seen == [torch.float32]
    assert x.grad is not None and x.grad.dtype == torch.float16
    # Without it, an fp16 input reaches the module unchanged.
    plain = FSDP(Recorder())
    plain(torch.randn(2, 4, dtype=torch.float16))
    assert plain.module.module.seen == [torch.float16]
    # A PackedSequence is passed through as is (not unpacked or cast) under mixed precision.
    packed_model = FSDP(Recorder(), mixed_precision=True)
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    packed_model(packed)
    assert packed_model.module.module.seen == [(PackedSequence, torch.float32)]


def test_only_the_root_casts_and_force_input_to_fp32() -> None:
    run_distributed(_only_the_root_casts_and_force_input_to_fp32_body, 2)


def _gradients_reach_inputs_under_mixed_precision_body(rank: int, ws: int) -> None:
    """The root cast fp32 inputs under no_grad (as upstream): a layer in front of the root got no gradient and a leaf
    input's ``.grad`` stayed None, silently, and a gradient penalty (``autograd.grad`` w.r.t. the input) raised that
    the input was not used in the graph (found by a fuzz of FSDP options, session 43). The cast is recorded now."""
    torch.manual_seed(0)
    pre, body = nn.Linear(4, 4), nn.Linear(4, 3)
    ref_pre, ref_body = nn.Linear(4, 4), nn.Linear(4, 3)
    ref_pre.load_state_dict(pre.state_dict())
    ref_body.load_state_dict(body.state_dict())
    model = FSDP(body, mixed_precision=True, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    model(pre(x)).float().pow(2).sum().backward()
    ref_body(ref_pre(ref_x)).pow(2).sum().backward()
    assert pre.weight.grad is not None and x.grad is not None and x.grad.dtype == torch.float32
    tol = dict(rtol=5e-2, atol=5e-2)  # bf16 compute against the fp32 reference
    torch.testing.assert_close(pre.weight.grad, ref_pre.weight.grad, **tol)
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    # A gradient penalty w.r.t. the input, as WGAN-GP and R1 regularisation compute it.
    y = torch.randn(5, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = model(y).float()
    (grad_y,) = torch.autograd.grad(out.sum(), y, create_graph=True)
    ref_y = y.detach().clone().requires_grad_(True)
    ref_out = ref_body(ref_y)
    (ref_grad_y,) = torch.autograd.grad(ref_out.sum(), ref_y, create_graph=True)
    torch.testing.assert_close(grad_y, ref_grad_y, **tol)
    (out.pow(2).sum() + grad_y.pow(2).sum()).backward()
    (ref_out.pow(2).sum() + ref_grad_y.pow(2).sum()).backward()
    assert_idle(model)
    torch.testing.assert_close(y.grad, ref_y.grad, **tol)


def test_gradients_reach_inputs_under_mixed_precision() -> None:
    run_distributed(_gradients_reach_inputs_under_mixed_precision_body, 2)


@dataclasses.dataclass
class _Cached:
    """A dataclass whose pickled state leaves a field out (a cache): ``copy.copy`` would drop it."""

    t: Tensor
    note: str = "default"

    def __getstate__(self) -> Dict[str, Any]:
        return {"t": self.t}


def test_dataclass_inputs_are_copied_field_by_field() -> None:
    # The cast's copy of a dataclass keeps every attribute: copy.copy goes through __getstate__, which may leave one
    # out (found by a review).
    item = _Cached(torch.ones(2), "kept")
    (cast,), _ = cast_inputs(torch.bfloat16, (torch.float32,), True, (item,), {})
    assert type(cast) is _Cached and cast.t.dtype == torch.bfloat16 and cast.note == "kept"
    assert item.t.dtype == torch.float32  # the caller's object is unchanged
