# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Block partitioning of a sequence of costs (the heuristic of Bárány, Grinberg and others, "Block partitions of
sequences", 2015), reproduced exactly so that balances match upstream's."""

from typing import List, Sequence, Tuple, TypeVar

__all__ = ["solve"]

T = TypeVar("T", int, float)


def solve(sequence: Sequence[T], partitions: int = 1) -> List[List[T]]:
    """Split ``sequence`` into ``partitions`` consecutive blocks of similar sums.

    Values are first normalized to [0, 1]; blocks are then rebalanced by moving one boundary element at a time
    towards the lightest block until the heaviest is at most 1 (one normalized element) heavier.

    Raises:
        ValueError: ``partitions`` is not positive or exceeds the length of ``sequence``.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer ({partitions} < 1)")
    n = len(sequence)
    if n < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({n} < {partitions})")

    minimum = min(sequence)
    spread = max(sequence) - minimum
    normal: List[float] = [0.0] * n if spread == 0 else [(x - minimum) / spread for x in sequence]

    # splits[i] is the end (exclusive) of block i.
    splits = [n // partitions * (t + 1) for t in range(partitions - 1)] + [n]

    def weights() -> List[Tuple[float, int]]:
        starts = [0] + splits[:-1]
        return [(sum(normal[start:stop]), i) for i, (start, stop) in enumerate(zip(starts, splits))]

    while True:
        heaviest, p = max(weights())  # ties: the largest index
        while True:
            lightest, q = min(weights())  # ties: the smallest index
            if heaviest <= lightest + 1:
                starts = [0] + splits[:-1]
                return [list(sequence[start:stop]) for start, stop in zip(starts, splits)]
            if p < q:
                # Grow the lightest block by the last element of the block before it.
                h = q - 1
                splits[h] -= 1
            else:
                # Grow the lightest block by the first element of the block after it.
                h = q + 1
                splits[q] += 1
            if h == p:
                break
