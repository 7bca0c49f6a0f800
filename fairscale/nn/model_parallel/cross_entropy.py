# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Cross entropy over logits whose vocabulary dimension is split over the model-parallel group."""

import math
from typing import Any, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives

from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .utils import VocabUtility  # noqa: F401  # upstream's module namespace has it

__all__ = ["vocab_parallel_cross_entropy"]


_SIZE_SPLIT = 4096  # a slice size rides as (size // 4096, size % 4096): both exact in fp32 up to 2**36


def _row_max_and_vocab_range(logits: Tensor, rank: int, world_size: int, group: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """The row maxima over the whole vocabulary, and the range of ids ``[start, end)`` this rank's slice holds.

    Upstream took the range as ``rank * size`` from this rank's own slice size: slices of different sizes (a
    vocabulary split unevenly by hand) got ranges that overlap or leave gaps, and a wrong loss with no error. Here
    the ranks' sizes ride in the max all-reduce the loss makes anyway (each rank puts its size at its own index after
    the row maxima, zeros elsewhere: the max gathers them), so the range is the sum of the sizes before this rank's,
    computed on the device: no extra collective and no host sync. The packed tensor is fp32, or fp64 for fp64
    logits: it holds the maxima exactly (logits of a dtype it holds), and they go back to the logits' dtype, so even
    slices give upstream's values bit for bit. A size travels as two numbers below 2**12 and 2**24 (``size // 4096``,
    ``size % 4096``), exact in fp32 whatever the size, so the dtype never depends on a rank's own size.
    """
    size = logits.size()[-1]
    # An empty slice (more ranks than ids, or a split by hand) has no maximum of its own: -inf leaves the others'.
    # torch.max would raise on this rank alone while the others wait in the all-reduce.
    local_max = torch.max(logits, dim=-1)[0] if size else logits.new_full(logits.shape[:-1], float("-inf"))
    wide = torch.promote_types(logits.dtype, torch.float32)
    sizes = torch.zeros(world_size, 2, dtype=wide, device=logits.device)
    sizes[rank, 0], sizes[rank, 1] = divmod(size, _SIZE_SPLIT)
    packed = torch.cat([local_max.reshape(-1).to(wide), sizes.view(-1)])
    collectives.all_reduce(packed, group=group, op="max")
    high_low = packed[-2 * world_size :].view(world_size, 2).to(torch.long)
    end = (high_low[:, 0] * _SIZE_SPLIT + high_low[:, 1]).cumsum(0)[rank]
    return packed[: -2 * world_size].view_as(local_max).to(local_max.dtype), end - size, end


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss = log(sum_v exp(z_v - m)) - (z_t - m), from three all-reduces of per-row values.

    ``m`` is the global row maximum (for stability). Only the rank owning the target id ``t``
    contributes ``z_t``; the others add 0. The forward shifts the caller's logits in place and the
    backward reuses the saved softmax in place (upstream's memory savings): the same graph cannot
    be differentiated twice.
    """

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: Tensor, target: Tensor) -> Tensor:
        group = get_model_parallel_group()
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        # The id range is a tensor on the logits' device: a target elsewhere (CPU ids, CUDA logits) is moved there.
        target = target.to(vocab_parallel_logits.device)
        logits_max, vocab_start_index, vocab_end_index = _row_max_and_vocab_range(
            vocab_parallel_logits, get_model_parallel_rank(), get_model_parallel_world_size(), group
        )
        vocab_parallel_logits.sub_(logits_max.unsqueeze(dim=-1))

        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        # The rows named: view(-1, 0) cannot infer them for an empty slice. reshape: logits cut from a larger
        # tensor (the language-model shift logits[:, :-1]) and transposed targets are not viewable as 2-D / 1-D.
        logits_2d = vocab_parallel_logits.reshape(math.prod(vocab_parallel_logits.shape[:-1]), partition_vocab_size)
        masked_target_1d = masked_target.reshape(-1)
        if partition_vocab_size:
            arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
            predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
            predicted_logits[target_mask] = 0.0
        else:  # an empty slice owns no target: it adds 0, as a rank that does not own a row's target does
            predicted_logits = vocab_parallel_logits.new_zeros(target.shape)
        collectives.all_reduce(predicted_logits, group=group)

        # Out of place, as upstream: the caller's logits keep only the max shift above (upstream's documented side
        # effect), not the softmax, which then became the gradient in backward; at model-parallel size 1, behind
        # scatter_to_model_parallel_region (a view of the caller's tensor), autograd refused the in-place write.
        exp_logits = torch.exp(vocab_parallel_logits).contiguous()  # backward views it as 2-D
        sum_exp_logits = exp_logits.sum(dim=-1)
        collectives.all_reduce(sum_exp_logits, group=group)

        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Tensor, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        if partition_vocab_size:  # an empty slice's gradient is empty: nothing to subtract
            grad_2d = grad_input.view(-1, partition_vocab_size)
            arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
            grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.reshape(-1).float()
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: Tensor, target: Tensor) -> Tensor:
    """Per-element cross entropy of logits split along the vocabulary over the model-parallel group.

    Equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), reduction="none").view_as(target)``
    for the logits gathered along the last dimension. The ranks' slices may differ in size (a vocabulary split
    unevenly by hand; upstream's loss was wrong then): each rank's ids follow those of the ranks before it. A slice
    may be empty (upstream raised on that rank alone and the others waited). No reduction, ``ignore_index`` or label
    smoothing. A target outside ``[0, V)`` is owned by no rank: its loss is the log-sum-exp of the
    shifted logits and no error is raised (upstream's behaviour).

    Args:
        vocab_parallel_logits (Tensor): ``[..., V/p]``, this rank's contiguous slice of the vocabulary.
            **Modified in place** (shifted by the row maximum).
        target (Tensor): ``[...]`` global class ids (long).

    Returns:
        Tensor: the loss, with the shape of ``target`` and the dtype of the logits.

    Raises:
        ValueError: ``target``'s shape is not the logits' shape without the last dimension (a ``[N, 1]`` target for
            ``[N, V/p]`` logits broadcast to an ``[N, N]`` "loss", and its backward failed). Raised before any
            collective, on the ranks with such a target only (telling the others would cost a host sync per call):
            the others fail in the first all-reduce at the group's timeout. Do not catch it and go on.
        TypeError: ``target`` is not an integer tensor (the same rule as the shape's).
    """
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: the target's shape {tuple(target.shape)} must be the logits' shape "
            f"without the vocabulary dimension, {tuple(vocab_parallel_logits.shape[:-1])} (logits "
            f"{tuple(vocab_parallel_logits.shape)}); squeeze or reshape the target"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        # Before: torch's "tensors used as indices must be long, int, byte or bool tensors" from inside.
        raise TypeError(
            f"vocab_parallel_cross_entropy: the target holds class ids, an integer tensor (long), got {target.dtype}; "
            "convert it with .long()"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
