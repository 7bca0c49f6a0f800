# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Block partitioning of a sequence of costs (the heuristic of Bárány, Grinberg and others, "Block partitions of
sequences", 2015), reproduced exactly so that balances match upstream's."""

from typing import List, Sequence, Set, Tuple, TypeVar

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

    # (splits, p, heaviest) at each step: the heuristic is deterministic in them, so a repeat is a cycle.
    seen: Set[Tuple[Tuple[int, ...], int, float]] = set()
    # Runs that end took at most 0.31 * n * partitions steps over 3000 random sequences of up to 60 costs.
    budget = 1000 + 16 * n * partitions
    while True:
        heaviest, p = max(weights())  # ties: the largest index
        while True:
            lightest, q = min(weights())  # ties: the smallest index
            if heaviest <= lightest + 1:
                starts = [0] + splits[:-1]
                blocks = [list(sequence[start:stop]) for start, stop in zip(starts, splits)]
                # Where upstream's heuristic ends with boundaries out of order (blocks that do not make up the
                # sequence) or an empty block, which no pipeline takes: the exact partition instead. Its other
                # results are kept, so that balances match upstream's.
                ordered = all(0 < b - a for a, b in zip([0] + splits, splits))
                return blocks if ordered else _min_max_blocks(sequence, partitions)
            state = (tuple(splits), p, heaviest)
            if state in seen or len(seen) > budget or not 0 <= min(splits) <= max(splits) <= n:
                # Upstream loops here forever (e.g. [1, 1, 1, 1, 1000000, 7] in 5 blocks, or measured layer times
                # with a few heavy layers), repeating itself, or moving a boundary past its neighbours and on
                # without end (no state repeats: the budget ends it): the exact partition instead.
                return _min_max_blocks(sequence, partitions)
            seen.add(state)
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


def _min_max_blocks(sequence: Sequence[T], partitions: int) -> List[List[T]]:
    """The split into ``partitions`` non-empty consecutive blocks whose largest sum is smallest (ties: each block
    ends as early as it can), by dynamic programming over the prefix sums: ``O(n**2 * partitions)``, used only where
    the heuristic cycles or leaves a block empty."""
    n = len(sequence)
    prefix = [0.0]
    for x in sequence:
        prefix.append(prefix[-1] + float(x))
    inf = float("inf")
    # best[k][i]: the smallest largest sum of the first i elements in k non-empty blocks; cut[k][i]: where the last
    # of those blocks starts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(partitions, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [list(sequence[a:b]) for a, b in zip(bounds, bounds[1:])]
