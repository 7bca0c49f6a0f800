# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Whether AdaScale's ranks measured the same reduced gradient, told from values that ride in the window's all-reduce.

AdaScale's estimate assumes that at the end of each window every rank holds the same, averaged gradient (DDP's).
Under FullyShardedDataParallel or ShardedDataParallel, or inside ``OSS(params, optim=AdaScaleWrapper)``, each rank
holds a different part of it: each then computes its own gain and steps its shard with its own learning rate,
silently. Each rank adds, per param group, the squared norm of the gradient it measured (``total``) and its square to
the window's all-reduce; the variance of ``total`` across ranks, read from the sums, is 0 when the ranks agree. Every
rank sees the same sums, so every rank decides alike, without an extra collective.
"""

import math
from typing import Any, List, Optional, Tuple

import numpy as np

__all__ = ["payload_values", "differing_group", "ranks_differ_message"]

# The variance of ``total`` across ranks, relative to its squared mean, above which the ranks measured different
# gradients. Under DDP every rank holds the same bits, and the same values measured in another order differ by about
# 1e-7 (relative variance 1e-14); what is left is the rounding of the fp32 sums, at most about 3 (n - 1) fp32 epsilons
# of n ranks: the margin covers that bound. At 2 ranks, squared norms within about 0.15% of each other pass.
_RELATIVE_VARIANCE = 4e-7
_PER_RANK_MARGIN = 1.8e-7


def payload_values(totals: "np.ndarray[Any, Any]") -> List[float]:
    """This rank's share: each group's squared gradient norm (``totals``), then its square.

    A square beyond fp32's range (a squared norm above about 1.8e19), like a total that is not finite, makes the sums
    non-finite, and that window is not checked.
    """
    values = [float(v) for v in np.asarray(totals, dtype=np.float64)]
    with np.errstate(over="ignore", invalid="ignore"):
        return values + [float(v) for v in np.square(np.asarray(values, dtype=np.float64))]


def differing_group(sums: List[float], size: int) -> Optional[Tuple[int, float]]:
    """The first param group whose ranks measured different gradients, and the relative standard deviation of the
    squared norms there; ``None`` when they agree (or when a sum is not finite).

    Args:
        sums: the group's sums of :func:`payload_values` (the squared norms of the n groups, then their squares).
        size: the number of ranks that summed them.
    """
    n = len(sums) // 2
    tolerance = _RELATIVE_VARIANCE + _PER_RANK_MARGIN * (size - 1)
    for idx in range(n):
        mean = sums[idx] / size
        mean_sqr = sums[n + idx] / size
        if not (math.isfinite(mean) and math.isfinite(mean_sqr)):
            continue
        if mean * mean < 1e-30:
            # The fp32 squares of norms this small lie near or in the subnormal range, where they keep too few digits
            # for the comparison (a false alarm); gradients this small give no gain worth checking.
            continue
        variance = mean_sqr - mean * mean
        if variance > tolerance * mean * mean:
            return idx, math.sqrt(variance) / mean
    return None


def ranks_differ_message(group: int, spread: float, size: int) -> str:
    """The warning, the same on every rank (it names no rank's own value)."""
    return (
        f"AdaScale: the ranks measured different gradients at the end of backward: the squared gradient norms of "
        f"param group {group} differ between the {size} ranks by {100 * spread:.3g}% (relative standard deviation). "
        "Each rank then computes its own gain and steps its parameters with its own learning rate. AdaScale needs "
        "the whole, averaged gradient on every rank: wrap the model with DistributedDataParallel "
        "(FullyShardedDataParallel and ShardedDataParallel leave each rank a different part of the gradients), and "
        "wrap OSS in AdaScale (AdaScale(OSS(params, optim=SGD, ...)) or AdaScaleWrapper(params, optim_cls=OSS, "
        "optim=SGD, ...)), not the other way round: OSS(params, optim=AdaScaleWrapper, ...) measures each rank's "
        "shard only. Warned once per AdaScale."
    )
