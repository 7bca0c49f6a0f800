# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of checkpoint_wrapper: parity with the plain module, input/output structures, flags, memory."""

import copy
import dataclasses
import gc
import pickle
import warnings
import weakref
from collections import OrderedDict, namedtuple
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from fairscale.fair_dev.testing import run_distributed
from fairscale.nn.checkpoint import checkpoint_wrapper, is_checkpointing, is_recomputing
from fairscale.nn.checkpoint.checkpoint_activations import disable_checkpointing


class Spy(nn.Module):
    """Records, for every forward call, (is_checkpointing, is_recomputing, grad enabled)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: List[Tuple[bool, bool, bool]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((is_checkpointing(), is_recomputing(), torch.is_grad_enabled()))
        return self.module(*args, **kwargs)


FIRST_PASS = (True, False, False)
RECOMPUTE = (False, True, True)
PLAIN_WITH_GRAD = (False, False, True)


def mlp(width: int = 16, depth: int = 3, dropout: float = 0.0) -> nn.Sequential:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Dropout(dropout), nn.GELU()]
    return nn.Sequential(*layers)


def pair(seed: int = 0, **kwargs: Any) -> Tuple[nn.Module, Any]:
    """A plain model and an identical checkpointed copy (a checkpointed Spy around the copy)."""
    torch.manual_seed(seed)
    plain = mlp(**kwargs)
    return plain, checkpoint_wrapper(Spy(copy.deepcopy(plain)))


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    grads_a = [p.grad for p in a.parameters()]
    grads_b = [p.grad for p in b.parameters()]
    assert all(g is not None for g in grads_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_fp32_parity_and_recomputation(input_requires_grad: bool) -> None:
    plain, ckpt = pair()
    x = torch.randn(4, 16, requires_grad=input_requires_grad)
    x2 = x.detach().clone().requires_grad_(input_requires_grad)
    out_plain, out_ckpt = plain(x), ckpt(x2)
    torch.testing.assert_close(out_ckpt, out_plain)
    assert out_ckpt.requires_grad
    assert ckpt.calls == [FIRST_PASS]
    out_plain.square().sum().backward()
    out_ckpt.square().sum().backward()
    assert ckpt.calls == [FIRST_PASS, RECOMPUTE]
    assert not is_checkpointing() and not is_recomputing()
    assert_same_grads(plain, ckpt)
    if input_requires_grad:
        assert x.grad is not None
        torch.testing.assert_close(x2.grad, x.grad)


def test_bf16_autocast_is_replayed() -> None:
    plain, ckpt = pair()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_plain, out_ckpt = plain(x), ckpt(x)
    assert out_plain.dtype == out_ckpt.dtype == torch.bfloat16
    torch.testing.assert_close(out_ckpt, out_plain)
    # backward runs outside autocast: the recomputation must still use bf16 to give the same grads
    out_plain.float().sum().backward()
    out_ckpt.float().sum().backward()
    assert_same_grads(plain, ckpt)


def test_dropout_rng_is_replayed() -> None:
    plain, ckpt = pair(dropout=0.5)
    x = torch.randn(8, 16)
    torch.manual_seed(123)
    plain(x).sum().backward()
    after_plain = torch.rand(4)
    torch.manual_seed(123)
    ckpt(x).sum().backward()
    after_ckpt = torch.rand(4)
    assert_same_grads(plain, ckpt)
    # The recomputation replays the forward's RNG state without consuming the caller's stream.
    torch.testing.assert_close(after_ckpt, after_plain)


def test_bypassed_without_grad_and_when_disabled() -> None:
    plain, ckpt = pair()
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(ckpt(x), plain(x))
    assert ckpt.calls == [(False, False, False)]

    ckpt.calls.clear()
    with disable_checkpointing():
        out = ckpt(x)
    out.sum().backward()
    plain(x).sum().backward()
    assert ckpt.calls == [PLAIN_WITH_GRAD]  # no first pass under no_grad, no recomputation
    assert_same_grads(plain, ckpt)


class MultiIO(nn.Module):
    Result = namedtuple("Result", ["main", "aux"])

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: float, bias: Optional[torch.Tensor] = None) -> Any:
        main = self.a(x) * scale + self.b(y)
        if bias is not None:
            main = main + bias
        aux = OrderedDict(y_out=self.b(y).relu(), note="text", count=3, nothing=None)
        return MultiIO.Result(main, aux), [x.sum(-1).long(), "tail"]


def test_multiple_inputs_outputs_kwargs_and_non_tensors() -> None:
    torch.manual_seed(0)
    plain = MultiIO()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        x, y, bias = (torch.randn(2, 4, requires_grad=True) for _ in range(3))
        res, (ints, tail) = model(x, y, scale=2.0, bias=bias)
        assert isinstance(res, MultiIO.Result) and type(res.aux) is OrderedDict
        assert (res.aux["note"], res.aux["count"], res.aux["nothing"], tail) == ("text", 3, None, "tail")
        assert ints.dtype == torch.int64 and not ints.requires_grad
        (res.main.sum() + res.aux["y_out"].square().sum()).backward()
        results.append((res.main, ints, x.grad, y.grad, bias.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
    assert_same_grads(plain, ckpt)


class SumOfList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, xs: List[torch.Tensor], extra: Dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(self.lin(x) for x in xs) * extra["w"]


def test_tensors_nested_in_list_and_dict_inputs_get_grads() -> None:
    torch.manual_seed(0)
    plain = SumOfList()
    ckpt = checkpoint_wrapper(Spy(copy.deepcopy(plain)))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        xs = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
        w = torch.randn(3, requires_grad=True)
        model(xs, {"w": w}).sum().backward()
        grads.append([x.grad for x in xs] + [w.grad])
    assert ckpt.calls == [FIRST_PASS, RECOMPUTE]
    for got, want in zip(grads[1], grads[0]):
        assert got is not None
        torch.testing.assert_close(got, want)
    assert_same_grads(plain, ckpt)


@dataclasses.dataclass(frozen=True)
class Features:
    """An argument object, frozen, with a field __init__ does not take."""

    hidden: torch.Tensor
    scale: float
    extra: List[torch.Tensor] = dataclasses.field(default_factory=list)
    note: str = dataclasses.field(init=False, default="kept")


@dataclasses.dataclass
class Prediction:
    """A model-output record (not a dict: HF's ModelOutput is one and already worked)."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor]
    tag: str


class DataclassInOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, features: Features) -> Prediction:
        h = self.proj(features.hidden) * features.scale + sum(features.extra)
        assert features.note == "kept"
        return Prediction(h.tanh(), h.pow(2).mean(), tag="out")


def test_tensors_in_dataclass_inputs_and_outputs_get_grads() -> None:
    torch.manual_seed(0)
    plain = DataclassInOut()
    ckpt = checkpoint_wrapper(Spy(copy.deepcopy(plain)))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        hidden = torch.randn(3, 4, requires_grad=True)
        extra = torch.randn(4, requires_grad=True)
        out = model(Features(hidden * 1.0, 0.5, [extra]))
        assert type(out) is Prediction and out.tag == "out"
        assert out.logits.requires_grad and out.loss is not None and out.loss.requires_grad
        (out.logits.sum() + out.loss).backward()
        grads.append([hidden.grad, extra.grad])
    assert ckpt.calls == [FIRST_PASS, RECOMPUTE]
    for got, want in zip(grads[1], grads[0]):
        assert got is not None
        torch.testing.assert_close(got, want)
    assert_same_grads(plain, ckpt)


class Record:
    """A hand-written output record (no dataclass, no container), holding another."""

    def __init__(self, logits: torch.Tensor, inner: Optional["Record"] = None) -> None:
        self.logits = logits
        self.inner = inner
        self.tag = "out"


class ObjectOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Record:
        h = self.proj(x).tanh()
        return Record(self.head(h), Record(h))


def test_tensors_in_plain_output_objects_get_grads() -> None:
    # Left as they were, their tensors came from the no-grad first pass: the module got no gradient, silently (a
    # fuzz of checkpointing, session 45).
    torch.manual_seed(0)
    plain = ObjectOut()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    for model in (plain, ckpt):
        out = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
        assert type(out) is Record and type(out.inner) is Record and out.tag == "out"
        assert out.logits.requires_grad and out.inner is not None and out.inner.logits.requires_grad
        (out.logits.sum() + out.inner.logits.pow(2).sum()).backward()
    assert_same_grads(plain, ckpt)


class Cache:
    """A KV cache handed to each layer, filled and returned."""

    def __init__(self) -> None:
        self.keys: List[torch.Tensor] = []


class CacheFiller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(4, 4)
        self.state = Record(torch.zeros(1))  # the module's own object, returned as it is

    def forward(self, x: torch.Tensor, cache: Cache) -> Tuple[torch.Tensor, Cache, Record]:
        k = self.k(x)
        cache.keys.append(k)
        return k * 2, cache, self.state


def test_objects_given_or_held_are_returned_as_they_are() -> None:
    # A review of the walk above: the cache given was walked as an output, copied, and its recomputation (which
    # appends again) returned one tensor more than the first pass ("the recomputed forward returned 3 tensors").
    torch.manual_seed(0)
    plain = CacheFiller()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    for model in (plain, ckpt):
        cache = Cache()
        y, returned, state = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), cache)
        assert returned is cache and state is model.state
        y.sum().backward()
    assert_same_grads(plain, ckpt)


class AttributeDict:
    """An easydict-style record (attributes kept in an inner dict): copy.copy recurses through __getattr__."""

    def __init__(self, **items: Any) -> None:
        self.__dict__["items"] = items

    def __getattr__(self, name: str) -> Any:
        return self.items[name]


class Slotted:
    __slots__ = ("a", "__dict__")

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a = a
        self.b = b


class OddObjects(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        h = self.proj(x)
        extra = Slotted(h.tanh(), h * 2) if self.kind == "slots" else AttributeDict(metric=h.sum())
        return h, extra


@pytest.mark.parametrize("kind", ["slots", "uncopyable"])
def test_output_objects_with_slots_or_no_copy(kind: str) -> None:
    # A review of the walk above, session 45: a class with __slots__ had only its __dict__ tracked (a gradient missing
    # the slot's share, silently): slots are walked too. One that copy.copy cannot handle failed the forward: it is
    # returned as it is, untracked, as before the walk.
    torch.manual_seed(0)
    plain = OddObjects(kind)
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    for model in (plain, ckpt):
        h, extra = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
        assert type(extra) is (Slotted if kind == "slots" else AttributeDict)
        (h.sum() + (extra.a.sum() + extra.b.sum() if kind == "slots" else 0)).backward()
    assert_same_grads(plain, ckpt)


@dataclasses.dataclass
class Context:
    """A context object the forward writes into (auxiliary losses), beside a tensor."""

    hidden: torch.Tensor
    aux: List[str] = dataclasses.field(default_factory=list)


class WritesIntoItsArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, ctx: Context, log: List[str], seen: Dict[str, Any]) -> torch.Tensor:
        ctx.aux.append("aux")
        log.append("called")
        seen["ctx"], seen["log"] = ctx, log
        return self.proj(ctx.hidden)


def test_arguments_are_the_callers_own() -> None:
    # The first pass gets the caller's arguments themselves, containers that hold tensors included, so its writes
    # reach the caller once, as without checkpointing; the recomputation runs on a copy of the arguments as they were
    # before the first pass.
    model = checkpoint_wrapper(WritesIntoItsArguments())
    ctx, log, seen = Context(torch.randn(2, 4, requires_grad=True)), [], {}
    out = model(ctx, log, seen)
    assert seen["log"] is log and log == ["called"]
    assert seen["ctx"] is ctx and ctx.aux == ["aux"]
    out.sum().backward()
    assert log == ["called"] and ctx.aux == ["aux"]
    assert ctx.hidden.grad is not None


class CollectsAuxiliaryLosses(nn.Module):
    """Stacked layers appending to one shared list (MoE-style auxiliary losses), and a dict of extras."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, aux: List[torch.Tensor], extra: Dict[str, Any]) -> torch.Tensor:
        y = self.proj(x)
        aux.append(y.pow(2).mean())
        extra[f"ran{len(aux)}"] = True
        return y


def test_writes_into_containers_that_hold_tensors_reach_the_caller() -> None:
    # Before, a list or dict holding a tensor reached the first pass as a copy: the second layer's auxiliary loss
    # and the extras were lost (plain PyTorch and upstream pass them on).
    torch.manual_seed(0)
    plain = nn.ModuleList([CollectsAuxiliaryLosses(), CollectsAuxiliaryLosses()])
    ckpt = nn.ModuleList([checkpoint_wrapper(copy.deepcopy(layer)) for layer in plain])
    results = []
    for layers in (plain, ckpt):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        aux: List[torch.Tensor] = []
        extra: Dict[str, Any] = {"mask": torch.ones(2)}
        y = x
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for layer in layers:
                y = layer(y, aux, extra)
        stored = [w for w in caught if "stored new tensors in its arguments" in str(w.message)]
        assert len(stored) == (2 if layers is ckpt else 0), [str(w.message) for w in caught]
        assert "the forward of CollectsAuxiliaryLosses" in str(stored[0].message) if stored else True
        y.sum().backward()
        results.append((len(aux), sorted(extra), [t.item() for t in aux], x.grad, [t.requires_grad for t in aux]))
    assert results[1][:3] == results[0][:3] == (2, ["mask", "ran1", "ran2"], results[0][2])
    # Written by the first pass, which runs without grad: values to log, not losses to train on (as upstream).
    assert results[0][4] == [True, True] and results[1][4] == [False, False]
    torch.testing.assert_close(results[1][3], results[0][3], rtol=0, atol=0)
    assert_same_grads(plain, ckpt)


class TaggedPair(namedtuple("TaggedPair", ["a", "b"])):
    """A namedtuple whose __new__ sets an attribute: a rebuilt copy must keep it."""

    def __new__(cls, a: torch.Tensor, b: torch.Tensor) -> "TaggedPair":
        pair = super().__new__(cls, a, b)
        pair.scale = 3.0
        return pair


class UsesTheTag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, pair: TaggedPair) -> TaggedPair:
        return TaggedPair(self.proj(pair.a) * getattr(pair, "scale", 1.0), pair.b)


def test_namedtuple_subclass_keeps_attributes_set_in_new() -> None:
    # Rebuilt by _make (past __new__), the recomputation's argument lost the attribute and computed another function.
    torch.manual_seed(0)
    plain = UsesTheTag()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    outs = []
    for model in (plain, ckpt):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = model(TaggedPair(x, x))
        out.a.sum().backward()
        outs.append(out)
    assert getattr(outs[1], "scale", None) == 3.0  # the output keeps it too
    assert_same_grads(plain, ckpt)


class PackedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        out, _ = self.lstm(packed)
        return pad_packed_sequence(out, batch_first=True)[0]


def test_packed_sequence_argument() -> None:
    # An RNN encoder fed pack_padded_sequence(...): before, rebuilding the PackedSequence around placeholders failed
    # in its constructor ("'_Slot' object has no attribute 'device'"). Its data is tracked like any tensor argument.
    torch.manual_seed(0)
    plain = PackedEncoder()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    grads = []
    for model in (plain, ckpt):
        x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
        model(pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True)).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert_same_grads(plain, ckpt)


class YieldsItsOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        self.calls += 1
        h = self.proj(x)
        for i in range(3):
            yield h * i


def test_a_generator_output_is_checkpointed_and_returned_as_a_tuple() -> None:
    # Before, the generator came back from the no-grad first pass unconsumed: its body ran later, outside the
    # checkpoint (nothing was recomputed, so nothing was saved), and a second pass had nothing to return.
    torch.manual_seed(0)
    plain = YieldsItsOutputs()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    grads = []
    for model in (plain, ckpt):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
        outs = model(x)
        if model is ckpt:
            assert isinstance(outs, tuple) and len(outs) == 3  # upstream's type for it
            assert model.calls == 1
        sum(o.pow(2).sum() for o in outs).backward()
        grads.append(x.grad)
    assert ckpt.calls == 2  # the first pass, then the recomputation in backward
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert_same_grads(plain, ckpt)


class ConsumesItsOptions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, opts: Dict[str, float]) -> torch.Tensor:
        scale = opts.pop("scale", 1.0)  # gone after the first pass: the recomputation must not see that
        return self.proj(x) * scale


def test_a_forward_that_consumes_an_argument_recomputes_the_same_function() -> None:
    torch.manual_seed(0)
    plain = ConsumesItsOptions()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(3, 4)
    for model in (plain, ckpt):
        opts = {"scale": 10.0}
        model(x, opts).pow(2).sum().backward()
        assert opts == {}
    assert_same_grads(plain, ckpt)


class NoUpdateDict(OrderedDict):
    """Like HF's ModelOutput: ``update`` is refused, ``__setitem__`` keeps an attribute in step."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("update() is not allowed")

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


class ReturnsNoUpdateDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> NoUpdateDict:
        out = NoUpdateDict()
        out["logits"] = self.proj(x)
        return out


def test_model_output_like_dicts_are_rebuilt_item_by_item() -> None:
    torch.manual_seed(0)
    plain = ReturnsNoUpdateDict()
    ckpt = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(3, 4, requires_grad=True)
    for model in (plain, ckpt):
        out = model(x)
        assert type(out) is NoUpdateDict and out.logits is out["logits"]
        out.logits.sum().backward()
    assert_same_grads(plain, ckpt)


def _frozen_wrapped_case(wrap: str) -> None:
    # checkpoint_wrapper around FlattenParamsWrapper or FSDP, frozen after a training step: the views the wrapper's
    # last forward left kept requires_grad=True, so the frozen module's output required grad, a trainable head's
    # backward raised torch's "none of output has requires_grad=True", and a training-mode forward never updated
    # the batch-norm statistics (session 39).
    from fairscale.nn import FlattenParamsWrapper, FullyShardedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain = copy.deepcopy(net)
    inner = FlattenParamsWrapper(net) if wrap == "fpw" else FullyShardedDataParallel(net)
    model = checkpoint_wrapper(inner)
    model(torch.randn(3, 4)).sum().backward()
    plain(torch.randn(3, 4))
    model.requires_grad_(False)
    plain.requires_grad_(False)
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    out = model(x)
    assert not out.requires_grad
    head(out).sum().backward()
    assert head.weight.grad is not None
    torch.testing.assert_close(out, plain(x))
    assert int(net[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == 2


def _frozen_fsdp_body(rank: int, world_size: int) -> None:
    _frozen_wrapped_case("fsdp")


def test_frozen_flattened_module_output_needs_no_grad() -> None:
    _frozen_wrapped_case("fpw")
    run_distributed(_frozen_fsdp_body, 1)


def test_output_requires_grad_only_when_something_does() -> None:
    torch.manual_seed(0)
    frozen = checkpoint_wrapper(Spy(mlp().requires_grad_(False)))
    x = torch.randn(2, 16)
    out = frozen(x)
    assert not out.requires_grad
    assert frozen.calls == [PLAIN_WITH_GRAD]  # nothing to save, so no checkpointing either

    # Frozen module, input requiring grad: the input still gets its gradient.
    reference = copy.deepcopy(frozen.module)
    x1 = torch.randn(2, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    frozen.calls.clear()
    frozen(x2).sum().backward()
    reference(x1).sum().backward()
    assert frozen.calls == [FIRST_PASS, RECOMPUTE]
    torch.testing.assert_close(x2.grad, x1.grad)
    assert all(p.grad is None for p in frozen.parameters())

    # Trainable module, input not requiring grad: the output requires grad through the parameters.
    plain, ckpt = pair()
    out = ckpt(torch.randn(2, 16))
    assert out.requires_grad


class ViewParams(nn.Module):
    """Imitates a module inside FlattenParamsWrapper: its weights are plain tensor views of an external
    flat parameter, listed in ``_unflattened_param_views``, and ``parameters()`` is empty."""

    def __init__(self, flat: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        del self.lin.weight, self.lin.bias
        weight, bias = flat.split([16, 4])
        self.lin.weight, self.lin.bias = weight.view(4, 4), bias
        self._unflattened_param_views = [self.lin.weight, self.lin.bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


def test_flattened_parameter_views_count_as_requiring_grad() -> None:
    torch.manual_seed(0)
    flat_ref = nn.Parameter(torch.randn(20))
    flat_ck = nn.Parameter(flat_ref.detach().clone())
    plain = ViewParams(flat_ref)
    ckpt = checkpoint_wrapper(Spy(ViewParams(flat_ck)))
    assert list(ckpt.parameters()) == []
    x = torch.randn(3, 4)
    out = ckpt(x)
    assert out.requires_grad
    out.sum().backward()
    plain(x).sum().backward()
    assert ckpt.calls == [FIRST_PASS, RECOMPUTE]
    torch.testing.assert_close(flat_ck.grad, flat_ref.grad)


def test_same_module_called_several_times_before_backward() -> None:
    plain, ckpt = pair()
    x1, x2 = torch.randn(2, 16), torch.randn(3, 16)
    (plain(plain(x1)).sum() + plain(x2).sum()).backward()
    (ckpt(ckpt(x1)).sum() + ckpt(x2).sum()).backward()
    assert ckpt.calls.count(FIRST_PASS) == 3 and ckpt.calls.count(RECOMPUTE) == 3
    assert_same_grads(plain, ckpt)


def test_nested_checkpoint_wrappers() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(mlp(), nn.Linear(16, 16), mlp())
    ckpt = copy.deepcopy(plain)
    inner = Spy(ckpt[2])
    ckpt[2] = checkpoint_wrapper(inner)
    ckpt = checkpoint_wrapper(ckpt)
    x = torch.randn(4, 16)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    assert_same_grads(plain, ckpt)
    # Outer first pass: grad disabled, so the inner wrapper is bypassed. Outer recomputation: the
    # inner wrapper checkpoints on its own (first pass, then its own recomputation).
    assert [c[2] for c in inner.calls] == [False, False, True]
    assert inner.calls[-1] == RECOMPUTE


def test_backward_with_create_graph_warns() -> None:
    """A gradient penalty's ``backward(create_graph=True)``: torch's reentrant checkpoint back-propagates the
    recomputation without a graph, so a second-order gradient through the region silently missed its share (3.90
    where the plain module gives 9.01). It warns; the first-order gradients, and a penalty on the head's gradients
    only, are those of the plain module."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = copy.deepcopy(plain)
    model[0] = checkpoint_wrapper(model[0])
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="create_graph=True"):
        model(x).pow(2).sum().backward(create_graph=True)
    plain(x).pow(2).sum().backward(create_graph=True)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad)
    penalties = [m[2].weight.grad.pow(2).sum() for m in (model, plain)]
    head_grads = [torch.autograd.grad(pen, m[2].weight)[0] for pen, m in zip(penalties, (model, plain))]
    assert torch.allclose(head_grads[0], head_grads[1])
    assert model[0].weight.grad.grad_fn is None  # the region's gradients carry no graph: what the warning says


def test_backward_twice_with_retain_graph() -> None:
    plain, ckpt = pair()
    x = torch.randn(4, 16)
    out_p, out_c = plain(x), ckpt(x)
    for _ in range(2):
        out_p.sum().backward(retain_graph=True)
        out_c.sum().backward(retain_graph=True)
    assert ckpt.calls == [FIRST_PASS, RECOMPUTE, RECOMPUTE]
    assert_same_grads(plain, ckpt)


def saved_bytes(fn: Any) -> int:
    """Bytes of distinct storages autograd keeps for backward while ``fn`` runs."""
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_activations_kept_for_backward_are_smaller() -> None:
    plain, ckpt = pair(width=64, depth=6)
    x = torch.randn(32, 64)
    plain_bytes = saved_bytes(lambda: plain(x))
    ckpt_bytes = saved_bytes(lambda: ckpt(x))
    with disable_checkpointing():
        disabled_bytes = saved_bytes(lambda: ckpt(x))
    # Checkpointed: only the input is kept (plus an empty anchor tensor), not the 6 layers' activations.
    assert ckpt_bytes == x.numel() * x.element_size()
    assert plain_bytes > 10 * ckpt_bytes
    assert disabled_bytes == plain_bytes


def test_offload_to_cpu_keeps_results() -> None:
    torch.manual_seed(0)
    plain = mlp(dropout=0.2)
    ckpt = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=True)
    x = torch.randn(4, 16)
    torch.manual_seed(5)
    plain(x).sum().backward()
    torch.manual_seed(5)
    ckpt(x).sum().backward()
    assert_same_grads(plain, ckpt)


def _offload_frees_device_memory(rank: int, world_size: int) -> None:
    device = torch.device("cuda")
    deltas = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = checkpoint_wrapper(mlp(width=256).to(device), offload_to_cpu=offload)
        x = torch.randn(4096, 256, device=device)
        before = torch.cuda.memory_allocated(device)
        out = model(x)
        del x
        deltas[offload] = torch.cuda.memory_allocated(device) - before
        out.sum().backward()
    # Without offload the saved input (4 MiB) stays on the device between forward and backward.
    assert deltas[False] - deltas[True] >= 4096 * 256 * 4


def test_offload_to_cpu_frees_device_memory() -> None:
    # Offloading is a no-op for CPU tensors: a CUDA world (skipped without a GPU), off the pytest process.
    run_distributed(_offload_frees_device_memory, 1, device="cuda")


def test_deprecated_import_path() -> None:
    from fairscale.nn.checkpoint import checkpoint_wrapper as new_path
    from fairscale.nn.misc.checkpoint_activations import checkpoint_wrapper as old_path

    assert old_path is new_path
    model = old_path(nn.Linear(2, 2))
    model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert model.weight.grad is not None


def test_pickle_and_deepcopy_keep_checkpointing() -> None:
    torch.manual_seed(0)
    model = checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    x = torch.randn(5, 4)
    clone: Any
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        # The new forward is bound to the clone, not to the original module.
        clone[0].weight.data.add_(1.0)
        spy_calls: List[bool] = []
        clone[0].register_forward_hook(lambda *_: spy_calls.append(torch.is_grad_enabled()))
        out = clone(x)
        out.sum().backward()
        assert spy_calls == [False, True]  # first pass without grad, recomputation with grad
        assert clone[0].weight.grad is not None and model[0].weight.grad is None
        assert clone[1].num_batches_tracked.item() == 1


def test_no_reference_cycle() -> None:
    model = checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    forward = model.forward
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None, "checkpoint_wrapper created a reference cycle through the module's forward"
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="garbage collected"):
        forward(torch.randn(2, 4))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module"):
        checkpoint_wrapper(lambda x: x)  # type: ignore[type-var]
    # offload_to_cpu is taken by its truth, as upstream does (tests/nn/checkpoint/test_checkpoint_upstream_names.py).


@pytest.mark.parametrize("checkpoint_outside", [False, True])
def test_with_flatten_params_wrapper(checkpoint_outside: bool) -> None:
    from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = copy.deepcopy(plain)
    if checkpoint_outside:
        spy = checkpoint_wrapper(Spy(model))  # FPW then flattens the parameters of the checkpointed module
        wrapped = FlattenParamsWrapper(spy)
    else:
        spy = checkpoint_wrapper(Spy(model[0]))  # a block inside FPW: its weights become plain views
        model[0] = spy
        wrapped = FlattenParamsWrapper(model)
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert spy.calls == [FIRST_PASS, RECOMPUTE]
    expected = torch.cat([p.grad.flatten() for p in plain.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(wrapped.flat_param.grad, expected)


class _ReturnsOwnTensors(nn.Module):
    """Returns a parameter and a buffer of its own as they are (a bias added later, a positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lin(x), self.lin.bias, self.table


@pytest.mark.timeout(60)  # the backward below never finished before
def test_a_returned_parameter_or_buffer_is_left_as_it_is() -> None:
    torch.manual_seed(0)
    plain = _ReturnsOwnTensors()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(3, 4)
    grads = []
    for m in (plain, wrapped):
        y, bias, table = m(x)
        # The checkpoint's node made the parameter a non-leaf and the buffer a tensor with its grad_fn.
        assert m.lin.bias.is_leaf and m.lin.bias.grad_fn is None
        assert m.table.grad_fn is None and not m.table.requires_grad
        (y.pow(2).sum() + (bias * 10).sum() + (table * y).sum()).backward()
        grads.append([p.grad for p in m.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)


class _ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> None:
        self.seen = self.lin(x)
        return None


def test_a_forward_that_returns_none() -> None:
    # It raised a bare AssertionError (None was also the "first pass not run" mark).
    m = checkpoint_wrapper(_ReturnsNone())
    assert m(torch.randn(2, 4, requires_grad=True)) is None
    assert m.seen is not None and m.seen.shape == (2, 4)


class ReturnsOverlappingOutputs(nn.Module):
    """Returns a tensor and a view of it (as a pooled token next to the sequence), and one more unrelated output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y[0], y.sum(0)


@pytest.mark.parametrize("modified", [None, 0, 1])
def test_outputs_that_share_memory_stay_views_of_one_tensor(modified: Optional[int]) -> None:
    # Each output became a separate detached alias: an in-place change of one changed the other's values but not
    # its graph, and the gradients were wrong without an error (bias gradient 2 or 1 where 3 is right). As views of
    # one tensor they are refused in place, as torch's reentrant checkpoint refuses them; used as they are, they
    # give the module's gradients.
    torch.manual_seed(0)
    plain = ReturnsOverlappingOutputs()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(2, 3, requires_grad=True)
    y, first, total = wrapped(x)
    assert torch.equal(first, y[0]) and first.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    if modified is not None:
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            (y, first)[modified].mul_(2)
        return
    (y.pow(2).sum() + first.sum() * 3 + total.sum()).backward()
    xp = x.detach().clone().requires_grad_(True)
    yp, firstp, totalp = plain(xp)
    (yp.pow(2).sum() + firstp.sum() * 3 + totalp.sum()).backward()
    assert torch.equal(x.grad, xp.grad)
    for p, q in zip(wrapped.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
