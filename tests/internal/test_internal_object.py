# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.object."""

import pickle
from typing import Any, Dict

import pytest
import torch

from fairscale.internal.object import pyobject_to_tensor, tensor_to_pyobject


def test_roundtrip() -> None:
    obj: Dict[str, Any] = {"a": [1, 2.5, "x"], "t": torch.arange(3)}
    tensor = pyobject_to_tensor(obj)
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1
    assert tensor.numel() == len(pickle.dumps(obj))
    back = tensor_to_pyobject(tensor)
    assert back["a"] == obj["a"] and torch.equal(back["t"], obj["t"])


def test_fixed_buffer_size() -> None:
    needed = pyobject_to_tensor([1, 2, 3]).numel()
    padded = pyobject_to_tensor([1, 2, 3], fixed_buffer_size=needed + 100)
    assert padded.numel() == needed + 100 and int(padded[needed:].sum()) == 0
    assert tensor_to_pyobject(padded) == [1, 2, 3]
    assert pyobject_to_tensor("x", fixed_buffer_size=0).numel() == len(pickle.dumps("x"))
    with pytest.raises(ValueError, match=f"needs {needed} bytes but fixed_buffer_size is {needed - 1}"):
        pyobject_to_tensor([1, 2, 3], fixed_buffer_size=needed - 1)


def test_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="expected a torch.uint8 tensor"):
        tensor_to_pyobject(torch.zeros(3))
