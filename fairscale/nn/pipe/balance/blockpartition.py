# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Block partitioning of a sequence of costs (the heuristic of Bárány, Grinberg and others, "Block partitions of
sequences", 2015), reproduced exactly so that balances match upstream's."""

from typing import List, Optional, Sequence, TypeVar

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
    index = range(partitions)

    # Every decision compares block sums as upstream computes them (``sum`` over the block's slice, which may round
    # differently from any sum kept incrementally; ties included), but such a sum costs a pass over the block. Each
    # step moves one boundary, so blocks keep their sum (``exact``, None once their bounds change) and an estimate
    # from prefix sums (``approx``, O(1) to update) within ``tol`` of it: decisions the estimates settle with room to
    # spare are those upstream makes, and the others sum the blocks they involve. ``tol`` bounds the rounding of the
    # prefix sums, of the subtraction, of any summation order of a block (at most n units of the last place of the
    # total each) and of ``lightest + 1``, twice over.
    inf = float("inf")
    prefix = [0.0] * (n + 1)
    # Where no estimate holds, every decision sums (``tol`` infinite): costs that do not normalize to floats (the
    # bound is for float sums), or a NaN among them (upstream compares it as it may).
    tol = inf
    if all(isinstance(x, float) for x in normal):
        for i, x in enumerate(normal):
            prefix[i + 1] = prefix[i] + x
        if not prefix[-1] < inf:
            prefix = [0.0] * (n + 1)
        elif _sums_are_exact(normal):
            # Every sum is exact, in any order: the estimates are the sums. Without this, the ties such costs are full
            # of (layers of equal cost with a few heavy ones: 0 and 1 once normalized) would sum blocks at every step.
            tol = 0.0
        else:
            tol = 8.0 * (n + 2) * (prefix[-1] + 1.0) * 2.0**-53
    approx = [prefix[stop] - prefix[start] for start, stop in zip([0] + splits[:-1], splits)]
    exact: List[Optional[float]] = [None] * partitions

    def weight(i: int) -> float:
        w = exact[i]
        if w is None:
            w = exact[i] = sum(normal[splits[i - 1] if i else 0 : splits[i]])
        return w

    def pick(largest: bool) -> int:
        """The block upstream's max (ties: the largest index) or min (ties: the smallest) over (sum, index) picks."""
        if tol == 0.0:
            return max(zip(approx, index))[1] if largest else min(zip(approx, index))[1]
        edge = max(approx) if largest else min(approx)
        i = approx.index(edge)
        approx[i] = -inf if largest else inf
        runner_up = max(approx) if largest else min(approx)
        approx[i] = edge
        if abs(edge - runner_up) > 2 * tol:
            return i  # every other block's sum is on the far side of this one's
        near = [(weight(j), j) for j in index if abs(approx[j] - edge) <= 2 * tol]
        return max(near)[1] if largest else min(near)[1]

    # The heuristic is deterministic in (splits, p, heaviest), so a repeated state is a cycle. Upstream loops forever
    # there (e.g. [1, 1, 1, 1, 1000000, 7] in 5 blocks, or measured layer times with a few heavy layers): the exact
    # partition instead. Cycles are found by Brent's method (the state at steps 1, 2, 4, ... is kept and compared with
    # each later one), which needs one saved state instead of every state seen: any cycle is found within about three
    # times its start plus its length, and a repeat is never reported where there is none. heaviest is block p's sum
    # throughout (block p only changes where p is picked again), so (splits, p) is the state; except where no estimate
    # holds, where heaviest is kept (with a NaN, upstream's picks are not a max and a min, and NaN never repeats).
    saved_splits: List[int] = []
    saved_p, save_at = -1, 1
    saved_heaviest: Optional[float] = None
    # A run that neither ends nor repeats stops after this many moves, as it always did (moves past it fall back, so
    # the budget is part of which inputs keep upstream's result). Runs that end took at most 0.31 * n * partitions
    # steps over 3000 random sequences of up to 60 costs, but more as n grows with a few heavy costs among light ones:
    # up to 2 * n * partitions at n = 3000 and 8 * n * partitions at n = 10000 (8 partitions).
    budget = 1000 + 16 * n * partitions
    steps = 0
    p = pick(largest=True)
    heaviest = weight(p) if tol == inf else None
    while True:
        q = pick(largest=False)
        gap = approx[p] - approx[q] - 1.0
        if gap < -3 * tol or not gap > 3 * tol and (weight(p) if heaviest is None else heaviest) <= weight(q) + 1:
            blocks = [list(sequence[start:stop]) for start, stop in zip([0] + splits[:-1], splits)]
            # Where upstream's heuristic ends with boundaries out of order (blocks that do not make up the sequence)
            # or an empty block, which no pipeline takes: the exact partition instead. Its other results are kept,
            # so that balances match upstream's.
            ordered = all(0 < b - a for a, b in zip([0] + splits, splits))
            return blocks if ordered else _min_max_blocks(sequence, partitions)
        if steps > budget or (p == saved_p and splits == saved_splits and heaviest == saved_heaviest):
            return _min_max_blocks(sequence, partitions)
        if steps == save_at:
            saved_splits, saved_p, saved_heaviest, save_at = splits[:], p, heaviest, 2 * save_at
        steps += 1
        if p < q:
            # Grow the lightest block by the last element of the block before it.
            h = s = q - 1
            splits[s] -= 1
        else:
            # Grow the lightest block by the first element of the block after it.
            h, s = q + 1, q
            splits[s] += 1
        cut = splits[s]
        if not 0 <= cut <= n:
            # A boundary moved past its neighbours and out of the sequence (the last one, too, where p is q: a NaN):
            # upstream goes on without end (or ends with blocks out of order, which falls back too).
            return _min_max_blocks(sequence, partitions)
        start, stop = splits[s - 1] if s else 0, splits[s + 1]
        # A block whose bounds crossed is an empty slice: sum 0.
        approx[s] = prefix[cut] - prefix[start] if start < cut else 0.0
        approx[s + 1] = prefix[stop] - prefix[cut] if cut < stop else 0.0
        exact[s] = exact[s + 1] = None
        if h == p:
            p = pick(largest=True)
            heaviest = weight(p) if tol == inf else None


def _sums_are_exact(normal: List[float]) -> bool:
    """Whether every value is a multiple of one power of two ``1 / d`` with ``(n + 2) * d <= 2**53``: then every sum of
    them (at most n), and such a sum plus 1, is a multiple of ``1 / d`` below ``2**53 / d``, which a float holds
    exactly, so no addition rounds."""
    limit = 2**53 // (len(normal) + 2)
    denominator = 1
    for x in normal:
        denominator = max(denominator, x.as_integer_ratio()[1])
        if denominator > limit:
            return False
    return True


def _min_max_blocks(sequence: Sequence[T], partitions: int) -> List[List[T]]:
    """The split into ``partitions`` non-empty consecutive blocks whose largest sum is smallest, used only where the
    heuristic cycles or leaves a block empty.

    Sums are differences of float prefix sums. Ties are broken from the end: with ``best(k, i)`` the smallest largest
    sum of the first ``i`` elements in ``k`` blocks, the last of ``k`` blocks ending at ``i`` starts at the smallest
    ``j`` for which ``max(best(k - 1, j), sum(j, i))`` is ``best(k, i)``.
    """
    n = len(sequence)
    prefix = [0.0]
    for x in sequence:
        prefix.append(prefix[-1] + float(x))
    if all(float(x) >= 0 for x in sequence) and prefix[-1] < float("inf"):
        bounds = _min_max_bounds(prefix, partitions)
    else:
        # A negative, infinite or NaN cost (no pipeline has one) breaks the monotonicity the fast search relies on.
        bounds = _min_max_bounds_quadratic(prefix, partitions)
    return [list(sequence[a:b]) for a, b in zip(bounds, bounds[1:])]


def _min_max_bounds(prefix: List[float], partitions: int) -> List[int]:
    """The block bounds of :func:`_min_max_blocks` for finite non-negative costs, in ``O(n * partitions)``.

    Float prefix sums of non-negative costs never decrease and float subtraction is monotone, so ``sum(j, i) =
    prefix[i] - prefix[j]`` grows with ``i`` and shrinks with ``j``, and ``best(k, i)`` grows with ``i`` (the blocks of
    a longer prefix, cut short and split, are blocks of a shorter one, and no smaller). Over ``j``,
    ``max(best(k - 1, j), sum(j, i))`` thus falls until the first ``j`` where ``best(k - 1, j) >= sum(j, i)`` and
    rises after it: the minimum is at that ``j`` or the one before, and that ``j`` never moves back as ``i`` grows.
    These are the values of the quadratic program, bit for bit (max and min round nothing).
    """
    n = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        before, row = best[k - 1], best[k]
        j = k - 1
        for i in range(k, n - (partitions - k) + 1):
            top = prefix[i]
            while j < i and before[j] < top - prefix[j]:
                j += 1
            if j == k - 1:
                row[i] = before[j]
            else:
                left = top - prefix[j - 1]
                row[i] = left if j == i or left < before[j] else before[j]
    # The smallest j where max(best(k - 1, j), sum(j, i)) is best(k, i) is the smallest j where sum(j, i) is at most
    # best(k, i): before it the block alone is heavier, and from it best(k - 1, j) must be at most best(k, i) (it
    # only grows, and some j reaches the minimum).
    bounds = [n]
    for k in range(partitions, 0, -1):
        i = bounds[-1]
        value, top = best[k][i], prefix[i]
        lo, hi = k - 1, i - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if top - prefix[mid] <= value:
                hi = mid
            else:
                lo = mid + 1
        bounds.append(lo)
    bounds.reverse()
    return bounds


def _min_max_bounds_quadratic(prefix: List[float], partitions: int) -> List[int]:
    """The block bounds of :func:`_min_max_blocks` by the plain dynamic program, ``O(n**2 * partitions)``."""
    n = len(prefix) - 1
    inf = float("inf")
    # best[k][i]: the smallest largest sum of the first i elements in k non-empty blocks; cut[k][i]: where the last
    # of those blocks starts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = -inf  # no block yet: 0 was a floor under the first block's sum, wrong for negative costs
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                # The first split is taken even where no value is below infinity (an infinite cost): every block
                # stays non-empty, as a pipeline needs.
                if value < best[k][i] or j == k - 1:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(partitions, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return bounds
