# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Divisibility checks, last-dimension splitting and vocabulary ranges for model-parallel layers."""

from typing import Tuple

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

__all__ = ["ensure_divisibility", "divide_and_check_no_remainder", "split_tensor_along_last_dim", "VocabUtility"]


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Check that ``numerator`` is divisible by ``denominator``.

    Raises:
        FairscaleValueError: ``"{numerator} is not divisible by {denominator}"`` (upstream's text; an
            ``AssertionError`` as upstream, kept under ``python -O``).
        ZeroDivisionError: ``denominator`` is 0.
    """
    if numerator % denominator != 0:
        raise FairscaleValueError("{} is not divisible by {}".format(numerator, denominator))


def divide_and_check_no_remainder(numerator: int, denominator: int) -> int:
    """``numerator // denominator`` after :func:`ensure_divisibility`."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Tuple[Tensor, ...]:
    """Cut the last dimension of ``tensor`` into ``num_partitions`` equal consecutive pieces.

    Args:
        tensor (Tensor): the tensor to split; its last dimension must divide by ``num_partitions``.
        num_partitions (int): number of pieces.
        contiguous_split_chunks (bool): return contiguous copies instead of views.

    Returns:
        Tuple[Tensor, ...]: the pieces, in order.
    """
    last_dim = tensor.dim() - 1
    last_dim_size = divide_and_check_no_remainder(tensor.size()[last_dim], num_partitions)
    pieces = torch.split(tensor, last_dim_size, dim=last_dim)
    if contiguous_split_chunks:
        return tuple(piece.contiguous() for piece in pieces)
    return tuple(pieces)


class VocabUtility:
    """Ranges of a vocabulary split into equal contiguous partitions: ``[first, last)`` of a rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Tuple[int, int]:
        """The half-open range owned by ``rank`` when each partition holds ``per_partition_vocab_size`` ids."""
        del world_size  # the range depends on the partition size and the rank only
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        """The half-open range owned by ``rank`` of a vocabulary of ``global_vocab_size`` split ``world_size`` ways."""
        per_partition = divide_and_check_no_remainder(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
