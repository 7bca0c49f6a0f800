# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.containers."""

from collections import OrderedDict, namedtuple
from typing import Any, List

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from fairscale.internal.containers import (
    apply_to_tensors,
    apply_to_type,
    from_np,
    pack_kwargs,
    split_non_tensors,
    to_np,
    unpack_kwargs,
    unpack_non_tensors,
)

Point = namedtuple("Point", ["x", "y"])


def test_apply_to_tensors_nested() -> None:
    t1, t2, t3, t4 = (torch.full((2,), float(i)) for i in range(4))
    container = {
        "list": [t1, "s", 3],
        "tuple": (t2, None),
        "named": Point(x=t3, y=7),
        "od": OrderedDict([("b", t4), ("a", [t1])]),
        "set": {1, 2},
    }
    out = apply_to_tensors(lambda t: t + 10, container)
    assert type(out) is dict and list(out) == list(container)
    assert torch.equal(out["list"][0], t1 + 10) and out["list"][1:] == ["s", 3]
    assert isinstance(out["tuple"], tuple) and torch.equal(out["tuple"][0], t2 + 10) and out["tuple"][1] is None
    assert type(out["named"]) is Point and torch.equal(out["named"].x, t3 + 10) and out["named"].y == 7
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    assert torch.equal(out["od"]["a"][0], t1 + 10)
    assert out["set"] == {1, 2}
    assert torch.equal(t1, torch.zeros(2))  # inputs untouched


def test_apply_to_tensors_set_and_leaf() -> None:
    t = torch.ones(1)
    out = apply_to_tensors(lambda x: x * 2, {t, "a"})
    assert isinstance(out, set) and "a" in out
    assert [float(x) for x in out if torch.is_tensor(x)] == [2.0]
    assert torch.equal(apply_to_tensors(lambda x: x * 3, t), t * 3)
    assert apply_to_tensors(lambda x: x * 3, "plain") == "plain"


def test_apply_to_tensors_packed_sequence() -> None:
    """fn sees the PackedSequence's data (side effects only); the sequence comes back unchanged."""
    seq = pack_padded_sequence(torch.arange(6.0).view(3, 2), lengths=[3, 2], enforce_sorted=True)
    seen: List[torch.Tensor] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t * 0

    out = apply_to_tensors(fn, [seq])
    assert out[0] is seq
    assert len(seen) == 1 and seen[0] is seq.data


def test_apply_to_type() -> None:
    out = apply_to_type(lambda x: isinstance(x, int), lambda x: x + 1, {"a": [1, "b", (2.5, 3)]})
    assert out == {"a": [2, "b", (2.5, 4)]}


def test_to_np_from_np_roundtrip() -> None:
    tensors = {"a": torch.arange(3.0, requires_grad=True), "b": [torch.ones(2, dtype=torch.int64)]}
    arrays = to_np(tensors)
    assert isinstance(arrays["a"], np.ndarray) and arrays["a"].tolist() == [0, 1, 2]
    assert arrays["b"][0].dtype == np.int64
    back = from_np(arrays)
    assert torch.equal(back["a"], torch.arange(3.0)) and back["b"][0].dtype == torch.int64
    assert from_np(np.float32(2.5)).dtype == torch.float32
    assert from_np({"x": np.zeros(2)}, device="meta")["x"].device.type == "meta"


def test_pack_unpack_kwargs() -> None:
    nested = {"inner": [torch.ones(1), {"deep": 3}]}
    keys, flat = pack_kwargs(1, "two", a=3, b=nested)
    assert keys == ("a", "b") and flat == (1, "two", 3, nested)
    args, kwargs = unpack_kwargs(keys, flat)
    assert args == (1, "two") and kwargs == {"a": 3, "b": nested} and kwargs["b"] is nested
    assert pack_kwargs(1, 2) == ((), (1, 2))
    assert unpack_kwargs((), (1, 2)) == ((1, 2), {})
    assert pack_kwargs(a=1) == (("a",), (1,))
    assert unpack_kwargs(("a",), (1,)) == ((), {"a": 1})
    with pytest.raises(ValueError, match="2 keyword names but only 1 values"):
        unpack_kwargs(("a", "b"), (1,))
    with pytest.raises(AssertionError):  # what upstream raises, for callers written for it
        unpack_kwargs(("a", "b"), (1,))


def test_split_unpack_non_tensors() -> None:
    x, y = torch.ones(1), torch.zeros(2)
    mixed: Any = (x, 1, None, y, "s")
    tensors, packed = split_non_tensors(mixed)
    assert tensors == (x, y)
    assert packed == {"is_tensor": [True, False, False, True, False], "objects": [1, None, "s"]}
    restored = unpack_non_tensors(tensors, packed)
    assert len(restored) == 5 and restored[0] is x and restored[3] is y and restored[1:3] == (1, None)
    single, none = split_non_tensors(x)
    assert single == (x,) and none is None
    assert unpack_non_tensors((x,), None) == (x,)
    assert split_non_tensors(()) == ((), {"is_tensor": [], "objects": []})
    with pytest.raises(ValueError, match="do not fit"):
        unpack_non_tensors((x,), packed)
    with pytest.raises(ValueError, match="returned by split_non_tensors"):
        unpack_non_tensors((x,), {"objects": []})
    for bad in (packed, {"objects": []}):  # also AssertionError, as upstream
        with pytest.raises(AssertionError):
            unpack_non_tensors((x,), bad)
