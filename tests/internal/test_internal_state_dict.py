# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.state_dict."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from fairscale.internal.state_dict import find_module_instances, replace_by_prefix_


def _prefixes(found):
    return [prefix for prefix, _ in found]


def test_find_module_instances() -> None:
    net = nn.Sequential(
        nn.Linear(1, 1), nn.ModuleDict({"ln": nn.LayerNorm(1), "linear": nn.Linear(1, 1)}), nn.LayerNorm(1)
    )
    # (prefix, module) pairs, as upstream returns them.
    found = find_module_instances(net, nn.LayerNorm)
    assert found == [("1.ln.", net[1]["ln"]), ("2.", net[2])]
    assert all(m is net.get_submodule(p.rstrip(".")) for p, m in found)
    assert _prefixes(find_module_instances(net, nn.Linear)) == ["0.", "1.linear."]
    assert find_module_instances(net, nn.Dropout) == []
    assert find_module_instances(net, nn.Sequential) == [("", net)]
    assert _prefixes(find_module_instances(net, nn.Module))[:2] == ["", "0."]  # matches are searched inside too
    # Prefixes are real state-dict prefixes.
    keys = net.state_dict().keys()
    assert all(any(k.startswith(p) for k in keys) for p, _ in find_module_instances(net, nn.LayerNorm))


def test_find_module_instances_shared_module() -> None:
    shared = nn.Linear(1, 1)
    net = nn.Sequential(shared, nn.Sequential(shared))
    assert find_module_instances(net, nn.Linear) == [("0.", shared), ("1.0.", shared)]


def test_replace_by_prefix() -> None:
    sd = OrderedDict([("layer.weight", 1), ("other", 2), ("layer.bias", 3), ("layerX", 4)])
    replace_by_prefix_(sd, "layer.", "module.layer.")
    assert list(sd.items()) == [("other", 2), ("layerX", 4), ("module.layer.weight", 1), ("module.layer.bias", 3)]
    replace_by_prefix_(sd, "module.", "")
    assert sd == {"other": 2, "layerX": 4, "layer.weight": 1, "layer.bias": 3}
    tensors = {"a.w": torch.ones(1)}
    original = tensors["a.w"]
    replace_by_prefix_(tensors, "a.", "b.")
    assert tensors["b.w"] is original and "a.w" not in tensors
    with pytest.raises(ValueError, match="must be distinct"):
        replace_by_prefix_(sd, "x", "x")


def test_replace_by_prefix_never_overwrites() -> None:
    # One rename at a time overwrote a key still to be renamed: {"w": "inner"} here, one entry lost, whatever order.
    for items in ([("m.m.w", "inner"), ("m.w", "outer")], [("m.w", "outer"), ("m.m.w", "inner")]):
        sd = OrderedDict(items)
        replace_by_prefix_(sd, "m.", "")
        assert sd == {"m.w": "inner", "w": "outer"}, sd
    # A key that is not renamed is not replaced: refused, and the dict is as it was.
    sd = OrderedDict([("module.w", 1), ("w", 2), ("module.b", 3)])
    with pytest.raises(ValueError, match=r"would overwrite the existing key\(s\) \['w'\]"):
        replace_by_prefix_(sd, "module.", "")
    assert list(sd.items()) == [("module.w", 1), ("w", 2), ("module.b", 3)]
