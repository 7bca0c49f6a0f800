# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""apply_to_tensors keeps the type of dict subclasses (Hugging Face's ModelOutput is an OrderedDict subclass read by
attribute), so FSDP's mixed-precision input cast hands the module the object it was given."""

from collections import OrderedDict, defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.containers import apply_to_tensors, split_non_tensors


class _Output(OrderedDict):
    """Attribute access, as transformers' ModelOutput."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _NeedsArgs(dict):
    def __init__(self, tag: str, *args: Any) -> None:
        super().__init__(*args)
        self.tag = tag


def test_subclasses_keep_their_type() -> None:
    out = apply_to_tensors(lambda t: t * 2, _Output(x=torch.ones(2), y=[torch.ones(1)]))
    assert type(out) is _Output and list(out) == ["x", "y"]
    assert torch.equal(out.x, torch.full((2,), 2.0)) and torch.equal(out.y[0], torch.full((1,), 2.0))
    d: defaultdict = defaultdict(list, a=torch.ones(1))
    copied = apply_to_tensors(lambda t: t, d)
    assert type(copied) is defaultdict and copied.default_factory is list
    # One whose constructor needs arguments keeps them (and its attributes); the original is left alone.
    original = _NeedsArgs("t", {"a": torch.zeros(1)})
    kept = apply_to_tensors(lambda t: t + 1, original)
    assert type(kept) is _NeedsArgs and kept.tag == "t" and torch.equal(kept["a"], torch.ones(1))
    assert torch.equal(original["a"], torch.zeros(1))
    assert type(apply_to_tensors(lambda t: t, OrderedDict(a=torch.ones(1)))) is OrderedDict
    assert type(apply_to_tensors(lambda t: t, {"a": torch.ones(1)})) is dict


class _Batch(list):
    pass


class _Pair(tuple):
    def __new__(cls, a: Any, b: Any) -> "_Pair":  # a constructor of its own: rebuilt as a plain tuple
        return super().__new__(cls, (a, b))


class _VarTuple(tuple):
    def __new__(cls, *items: Any) -> "_VarTuple":  # takes the items themselves: type(x)(values) nests them
        return super().__new__(cls, items)


class _Spec(tuple):  # takes one iterable, as tuple does: rebuilt with its type
    pass


def test_sequence_subclasses_keep_their_type() -> None:
    """``torch.max(t, 0)`` came back as a plain tuple (``.values`` gone), ``torch.Size`` as a tuple, list and tuple
    subclasses as plain ones (session 37)."""
    t = torch.arange(6.0).view(2, 3)
    out = apply_to_tensors(lambda x: x * 2, torch.max(t, 0))
    assert type(out) is type(torch.max(t, 0)) and torch.equal(out.values, torch.tensor([6.0, 8.0, 10.0]))
    size = torch.Size([2, 3])
    assert apply_to_tensors(lambda x: x, size) is size
    batch = apply_to_tensors(lambda x: x + 1, _Batch([t, 1]))
    assert type(batch) is _Batch and torch.equal(batch[0], t + 1) and batch[1] == 1
    untouched = _Pair(1, "a")
    assert apply_to_tensors(lambda x: x, untouched) is untouched
    pair = apply_to_tensors(lambda x: x + 1, _Pair(t, 1))
    assert type(pair) is tuple and torch.equal(pair[0], t + 1)
    assert type(apply_to_tensors(lambda x: x, [t])) is list and type(apply_to_tensors(lambda x: x, (t,))) is tuple
    var = apply_to_tensors(lambda x: x + 1, _VarTuple(t, t))  # was _VarTuple([t + 1, t + 1]): one item, a list
    assert type(var) is tuple and len(var) == 2 and torch.equal(var[1], t + 1)
    spec = apply_to_tensors(lambda x: x + 1, _Spec([t, 2]))
    assert type(spec) is _Spec and torch.equal(spec[0], t + 1) and spec[1] == 2


class _ListOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        return _Batch([y, y * 2]), _VarTuple(y, y + 1), torch.max(y, 1)


def test_checkpoint_wrapper_outputs_keep_their_structure() -> None:
    from fairscale.nn.checkpoint import checkpoint_wrapper

    torch.manual_seed(0)
    plain = _ListOut()
    wrapped = checkpoint_wrapper(_ListOut())
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3)
    got, want = wrapped(x), plain(x)
    assert type(got[0]) is _Batch and len(got[0]) == 2  # came back a plain list
    assert type(got[1]) is tuple and len(got[1]) == 2  # came back a _VarTuple holding one list
    assert type(got[2]) is type(want[2]) and torch.equal(got[2].values, want[2].values)
    sum(t.sum() for t in [*got[0], *got[1], got[2].values]).backward()
    sum(t.sum() for t in [*want[0], *want[1], want[2].values]).backward()
    torch.testing.assert_close(wrapped.lin.weight.grad, plain.lin.weight.grad)


@pytest.mark.parametrize("bad", [{"a": torch.ones(1)}, None, 3])
def test_split_non_tensors_refuses_what_is_not_a_tuple(bad: Any) -> None:
    with pytest.raises(TypeError, match="split_non_tensors takes a tensor or a tuple"):
        split_non_tensors(bad)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, batch: _Output) -> torch.Tensor:
        return self.lin(batch.x)


def _mixed_precision_body(rank: int, world_size: int) -> None:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    model = FSDP(_Head(), mixed_precision=True, compute_dtype=torch.bfloat16)
    y = model(_Output(x=torch.ones(1, 2)))  # the input cast gave a plain OrderedDict: AttributeError 'x'
    assert y.dtype == torch.bfloat16


def test_fsdp_mixed_precision_keeps_the_input_type() -> None:
    run_distributed(_mixed_precision_body, 1, timeout=60)
