# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Sub-modules of ``nn.TransformerEncoderLayer`` wrapped as FSDP instances of their own, evaluated without autograd.

In ``eval()`` under ``torch.no_grad()`` the layer's fast path hands its sub-modules' weights to one fused kernel
instead of calling them: an FSDP sub-module was never called, never gathered, and the kernel got this rank's shard
("2d weights expected", or "setStorage ... out of bounds" with flattened parameters, once a step had freed the
construction-time views). The root's lazy init now keeps such layers on their module-by-module path.
"""

import copy
import functools
import inspect
from typing import Any, Dict

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


def _layer() -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


def _evaluates_like_the_plain_layer(wrap: str, flatten: bool) -> None:
    reference = _layer()
    layer = copy.deepcopy(reference)
    kwargs: Dict[str, Any] = dict(flatten_parameters=flatten)
    if wrap in ("linear1", "both"):
        layer.linear1 = FSDP(layer.linear1, **kwargs)
    if wrap in ("self_attn", "both"):
        layer.self_attn = FSDP(layer.self_attn, **kwargs)
    model = FSDP(layer, **kwargs)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    for module in (model, reference):  # one step, so that the shards differ from the construction-time values
        optim = torch.optim.SGD(module.parameters(), lr=0.5)
        module(x).pow(2).sum().backward()
        optim.step()
        module.eval()
    with torch.no_grad():
        expected = reference(x)  # the plain layer takes its fast path
        got = model(x)
    # The fused kernel and the module-by-module path sum in another order.
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    model.train()
    with torch.no_grad():  # training mode: the layer's ordinary path, unchanged
        torch.testing.assert_close(model(x), reference.train()(x), atol=1e-5, rtol=1e-5)


def _encoder_with_padding_evaluates_like_the_plain_encoder(wrap: str, flatten: bool) -> None:
    """``nn.TransformerEncoder`` in eval with a padding mask first packs the batch into a nested tensor (reading the
    first layer's weights only to check them), then calls every layer on it: each layer's fast path must stay off."""
    layer = _layer()
    reference = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    encoder = copy.deepcopy(reference)
    for block in encoder.layers:
        setattr(block, wrap, FSDP(getattr(block, wrap), flatten_parameters=flatten))
    model = FSDP(encoder, flatten_parameters=flatten)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True  # left-aligned, as the encoder's nested-tensor path wants
    for module in (model, reference):
        optim = torch.optim.SGD(module.parameters(), lr=0.5)
        module(x, src_key_padding_mask=padding).pow(2).sum().backward()
        optim.step()
        module.eval()
    with torch.no_grad():
        expected = reference(x, src_key_padding_mask=padding)
        got = model(x, src_key_padding_mask=padding)
    kept = ~padding  # padded positions come back as zeros from the nested path and as values from the other
    torch.testing.assert_close(got[kept], expected[kept], atol=1e-4, rtol=1e-4)


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (f"{wrap}, flatten={flatten}", functools.partial(_evaluates_like_the_plain_layer, wrap, flatten))
            for wrap in ("linear1", "self_attn", "both")
            for flatten in (True, False)
        ]
        + [
            (
                f"encoder with padding, {wrap}, flatten={flatten}",
                functools.partial(_encoder_with_padding_evaluates_like_the_plain_encoder, wrap, flatten),
            )
            for wrap in ("linear1", "self_attn")
            for flatten in (True, False)
        ]
    )


# torch's own test for hooks inside the layer (2.6 and later have it; 2.1 does not): without it the fast path is taken
# whatever the modules are, and such a model still fails in evaluation there (docs/fsdp.rst).
_LAYER_LOOKS_FOR_HOOKS = "_forward_pre_hooks" in inspect.getsource(nn.TransformerEncoderLayer.forward)


@pytest.mark.skipif(not _LAYER_LOOKS_FOR_HOOKS, reason="this torch's encoder layer takes its fast path despite hooks")
def test_wrapped_sublayers_of_an_encoder_layer_evaluate_without_autograd() -> None:
    run_distributed(_body, 2)
