# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's toy models for tests: ``GPT2``, ``IdentityLayer`` and ``DeviceAndTypeCheckModule``.

Also importable from :mod:`fairscale.fair_dev.testing.testing`, where upstream had them.
"""

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["GPT2", "IdentityLayer", "DeviceAndTypeCheckModule"]


class IdentityLayer(nn.Module):
    """A module whose output is its own weight, whatever the input.

    Args:
        size: number of elements of the weight (drawn from a standard normal).
        scale: multiplies the initial weight.
    """

    def __init__(self, size: int, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(scale * torch.randn(size))

    def forward(self, *_: Any, **__: Any) -> torch.Tensor:
        return self.weight


class _GPT2Block(nn.Module):
    """Pre-norm transformer block with causal self-attention (sequence-first tensors)."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        causal = torch.full((length, length), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """A small GPT-2-like classifier: embeddings, causal transformer blocks, a classification head.

    Args:
        embed_dim: width of the model.
        num_heads: attention heads per block (must divide ``embed_dim``).
        num_layers: number of blocks.
        num_positions: longest sequence.
        num_vocab: vocabulary size.
        num_classes: output classes.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, num_layers: int, num_positions: int, num_vocab: int, num_classes: int
    ) -> None:
        super().__init__()
        self.position_embeddings = nn.Embedding(num_positions, embed_dim)
        self.token_embeddings = nn.Embedding(num_vocab, embed_dim)
        self.layers = nn.ModuleList(_GPT2Block(embed_dim, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(embed_dim)
        self.clf_head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids of shape (sequence, batch) -> class logits of shape (batch, num_classes)."""
        length = x.shape[0]
        positions = torch.arange(length, device=x.device)
        h = self.token_embeddings(x.long()) + self.position_embeddings(positions).unsqueeze(1)
        for layer in self.layers:
            h = layer(h)
        return self.clf_head(self.ln_f(h).mean(dim=0))


class DeviceAndTypeCheckModule(nn.Module):
    """A ``Linear(5, 5)`` whose forward asserts the dtype/device of its input, weight, buffer and loss.

    Every expectation left as ``None`` is not checked. A device given without an index matches any index.
    """

    def __init__(
        self,
        expected_input_dtype: Optional[torch.dtype] = None,
        expected_input_device: Optional[torch.device] = None,
        expected_param_dtype: Optional[torch.dtype] = None,
        expected_param_device: Optional[torch.device] = None,
        expected_loss_dtype: Optional[torch.dtype] = None,
        expected_loss_device: Optional[torch.device] = None,
        expected_buffer_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.expected_input_dtype = expected_input_dtype
        self.expected_input_device = expected_input_device
        self.expected_param_dtype = expected_param_dtype
        self.expected_param_device = expected_param_device
        self.expected_loss_dtype = expected_loss_dtype
        self.expected_loss_device = expected_loss_device
        self.expected_buffer_dtype = expected_buffer_dtype
        self.linear = nn.Linear(5, 5)
        self.register_buffer("buffer", torch.rand((5,)))

    def _check(self, what: str, got: Any, expected: Any) -> None:
        if expected is None:
            return
        if isinstance(got, torch.device):
            expected = torch.device(expected)
            matches = got.type == expected.type and expected.index in (None, got.index)
        else:
            matches = got == expected
        if not matches:
            raise AssertionError(f"{what} is {got}, expected {expected}")

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x = input[0]  # keyword arguments are accepted and ignored, as upstream
        self._check("input.dtype", x.dtype, self.expected_input_dtype)
        self._check("input.device", x.device, self.expected_input_device)
        weight = self.linear.weight
        self._check("param.dtype", weight.dtype, self.expected_param_dtype)
        self._check("param.device", weight.device, self.expected_param_device)
        self._check("buffer.dtype", self.buffer.dtype, self.expected_buffer_dtype)
        loss = self.linear(x).sum()
        self._check("loss.dtype", loss.dtype, self.expected_loss_dtype)
        self._check("loss.device", loss.device, self.expected_loss_device)
        return loss
