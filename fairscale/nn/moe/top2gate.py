# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Top-2 gating of GShard (https://arxiv.org/abs/2006.16668), as in upstream fairscale.

Each token goes to its most likely expert and to a second expert sampled (Gumbel-max) from the
others; each expert takes at most ``capacity = 2 * S // E`` tokens, first choices in token order
before second choices in token order, and drops the rest.
"""

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

__all__ = ["Top2Gate", "top2gating", "one_hot", "gumbel_rsample"]

# One sampler per device (upstream cached torch.distributions' Gumbel(0, 1).rsample here).
gumbel_map: Dict[torch.device, Callable[..., Tensor]] = {}


def _standard_gumbel_sampler(device: torch.device) -> Callable[..., Tensor]:
    """``-log(-log(u))`` for ``u`` uniform in ``[tiny, 1 - eps)``: what ``Gumbel(0, 1).rsample`` computes.

    The same single ``torch.rand`` draw and the same float32 operations, so the values are bit-identical to
    torch's distribution (checked in the tests), without the distribution's one-time set-up cost of about a
    second per process.
    """
    finfo = torch.finfo(torch.float32)
    low = torch.full((), finfo.tiny, device=device)
    high = torch.full((), 1 - finfo.eps, device=device)

    def sample(shape: Tuple[int, ...]) -> Tensor:
        u = low + torch.rand(shape, dtype=torch.float32, device=device) * (high - low)
        return 0.0 + (-1.0) * torch.log(-torch.log(u))

    return sample


def gumbel_rsample(shape: Tuple[int, ...], device: torch.device) -> Tensor:
    """Samples of a standard Gumbel distribution (float32), drawn with one ``torch.rand`` on ``device``."""
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        gumbel = _standard_gumbel_sampler(device)
        gumbel_map[device] = gumbel
    return gumbel(shape)


def one_hot(tensor: Tensor, num_classes: int) -> Tensor:
    """One-hot encoding along a new last dimension, with ``tensor``'s dtype and device."""
    if num_classes <= 0:
        # Upstream's assert and text (an AssertionError subclass, kept under ``python -O``).
        raise FairscaleValueError(f"num_classes must be a positive integer, got {num_classes}")
    ret = torch.zeros(tensor.shape + (num_classes,), device=tensor.device, dtype=tensor.dtype)
    ret.scatter_(-1, tensor.unsqueeze(-1), 1)
    return ret


def _check_logits(logits: Tensor) -> None:
    # AssertionError subclasses as upstream (bare asserts there, gone under ``python -O``), saying what to change.
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        got = f"shape {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits).__name__
        raise FairscaleValueError(f"top2gating: logits must be a 2-D [tokens, experts] tensor, got {got}")
    if not logits.is_floating_point():
        # Integer logits were silently wrong: the combine weights went back to the integer dtype (all 0).
        raise FairscaleTypeError(
            f"top2gating: logits must be floating point, got {logits.dtype}; the gate's weights are probabilities"
        )
    num_tokens, num_experts = logits.shape
    if num_experts == 0:
        raise FairscaleValueError("top2gating: got logits for 0 experts; the gate needs at least one expert")
    if num_tokens == 0:
        raise FairscaleValueError("top2gating: got 0 tokens; the expert capacity 2 * tokens // experts would be 0")
    if num_tokens % num_experts != 0:
        raise FairscaleValueError(
            f"top2gating: the number of tokens ({num_tokens}) must be a multiple of the number of experts "
            f"({num_experts}); pad the batch or change the expert count"
        )


def top2gating(logits: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Route each of ``S`` tokens to two of ``E`` experts with capacity ``C = 2 * S // E``.

    Args:
        logits (Tensor): ``[S, E]`` gate logits; ``S`` must be a positive multiple of ``E``.

    Raises:
        FairscaleValueError: ``logits`` is not 2-D, has no expert, or ``S`` is not a positive multiple of ``E``
            (an ``AssertionError`` as upstream).

    Returns:
        Tuple[Tensor, Tensor, Tensor]: ``l_aux`` (load-balancing loss, mean over experts of the mean
        gate probability times the fraction of first choices, computed before dropping),
        ``combine_weights`` ``[S, E, C]`` (a token's normalised gate weight at its expert slot) and
        ``dispatch_mask`` ``[S, E, C]`` (bool, where ``combine_weights`` is non-zero).
    """
    _check_logits(logits)
    gates = F.softmax(logits, dim=1, dtype=torch.float)
    num_tokens, num_experts = gates.shape
    capacity = 2 * num_tokens // num_experts

    # First choice: the most likely expert (lowest index on ties).
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = one_hot(indices1_s, num_classes=num_experts)
    # Second choice: Gumbel-max sample among the other experts (noise on the logits).
    logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = one_hot(indices2_s, num_classes=num_experts)

    # Slots: first choices in token order, then second choices after all first choices of that expert.
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce)

    # Drop what does not fit.
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    # Normalise the two kept weights of each token (a token keeping one choice gets weight 1 on it).
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s

    slots1 = one_hot(locations1_s, num_classes=capacity).to(gates.dtype)
    slots2 = one_hot(locations2_s, num_classes=capacity).to(gates.dtype)
    combine1 = gates1_s[:, None, None] * mask1.to(gates.dtype)[:, :, None] * slots1[:, None, :]
    combine2 = gates2_s[:, None, None] * mask2.to(gates.dtype)[:, :, None] * slots2[:, None, :]
    combine_weights = combine1 + combine2
    dispatch_mask = combine_weights.bool()
    return l_aux.to(logits.dtype), combine_weights.to(logits.dtype), dispatch_mask


class Top2Gate(torch.nn.Module):
    """Gate of a :class:`~fairscale.nn.moe.MOELayer`: a linear map to expert logits, then :func:`top2gating`.

    Args:
        model_dim (int): size of each token.
        num_experts (int): total number of experts (over all ranks).
    """

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Gate ``input`` ``[S, model_dim]``: returns ``(l_aux, combine_weights, dispatch_mask)``."""
        logits = self.wg(input)
        return top2gating(logits)
