# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What AdaScale's ranks must share at each window's end, checked from values that ride in the window's all-reduce.

Every rank sees the same all-reduced sums, so every rank decides alike and raises the same error: no extra collective,
and no rank left waiting.
"""

import math
import zlib
from typing import Any, Dict, List

import numpy as np

from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.errors import FairscaleValueError

__all__ = ["check_group_size", "check_same_loaded_statistics", "check_same_scale", "check_same_window", "fingerprint"]


def check_group_size(world_size: int) -> None:
    """Raise unless the default group has ``world_size`` ranks: the statistics are all-reduced over it.

    Upstream failed here without torch.distributed; in a group of another size (and in this fork without
    torch.distributed, where the all-reduce is a no-op) the statistics were computed for workers that did not exist,
    and the gain stayed 1 for good, silently. ``world_size`` agreed between the ranks at construction and the group's
    size is the same on each, so every rank raises alike.
    """
    size = collectives.group_size(None)
    if size != world_size:
        raise FairscaleValueError(
            f"AdaScale: world_size is {world_size} but the default process group has {size} rank(s) (1 without "
            "torch.distributed); the statistics are all-reduced over the default group: pass world_size=None (its "
            "size), or 1 for a rank on its own (with num_gradients_to_accumulate > 1)"
        )


def check_same_window(sums: List[float], accum: int) -> None:
    """Raise the same :class:`RanksDisagreeError` on every rank unless every rank's window length is ``accum``.

    ``sums`` are the group's sums of n and n * n: both equal the group size times this rank's n, n * n only when every
    rank has the same n (their variance is then 0), so no rank passes when any differs.
    """
    size = collectives.group_size(None)
    if sums != [size * accum, size * accum * accum]:
        raise RanksDisagreeError(
            f"AdaScale: num_gradients_to_accumulate differs between ranks: this rank has {accum}, the mean over the "
            f"{size} ranks is {sums[0] / size:g}. Call set_num_gradients_to_accumulate() with the same value on every "
            "rank. This step's statistics were not updated."
        )


def check_same_scale(sums: List[float], scale: float) -> None:
    """Raise the same :class:`RanksDisagreeError` on every rank unless every rank's scale is (to fp32's precision)
    ``scale``: ``sums`` are the group's sums of the scale and its square, whose variance is 0 only when all agree."""
    size = collectives.group_size(None)
    mean = sums[0] / size
    if sums[1] / size - mean * mean > 1e-5 * mean * mean:
        raise RanksDisagreeError(
            f"AdaScale: the scale differs between ranks: this rank has {scale:g}, the mean over the {size} ranks is "
            f"{mean:g}. Call set_scale() with the same value on every rank. This step's statistics were not updated."
        )


def fingerprint(stats: Dict[str, Any]) -> int:
    """A checksum of AdaScale's statistics (``state["adascale"]``), for :func:`check_same_loaded_statistics` (-1
    for statistics it cannot read: the rank still joins the gather)."""
    digest = 0
    try:
        for key in sorted(stats):
            value = np.asarray(stats[key], dtype=np.float64)
            digest = zlib.crc32(str(key).encode() + value.tobytes(), digest)
    except Exception:  # noqa: B902  # never a rank that skips the collective
        return -1
    return digest


def tells_sharding(sums: List[float]) -> bool:
    """Whether a window's sums of the measured squared norms (then their squares) can tell ranks that measure
    different gradients apart: finite, and not all zero."""
    norms = sums[: len(sums) // 2]
    return all(math.isfinite(v) for v in sums) and any(v > 0 for v in norms)


def check_same_loaded_statistics(loads: float, loaded: bool, stats: Dict[str, Any], measured_differ: bool) -> None:
    """After ``load_state_dict`` on some rank since the last window's end (``loads``: how many ranks loaded, the same
    sum on every rank, so every rank takes the extra collective or none), compare the ranks' statistics.

    A rank that loaded another checkpoint's statistics (a stale file on one node), or the only rank that loaded,
    computed another gain, so another learning rate: the DDP replicas drifted apart, silently. Not checked when the
    ranks measure different gradients (sharded gradients): each rank's statistics are its own then.

    Args:
        loads: the group's sum of this rank's "loaded since" flag.
        loaded: whether this rank loaded since.
        stats: this rank's statistics (``state["adascale"]``), before this window updates them.
        measured_differ: whether this window's gradients differed between the ranks.
    """
    if loads == 0:
        return
    gathered = collectives.all_gather_object((loaded, fingerprint(stats)), None)
    if measured_differ or len({digest for _, digest in gathered}) == 1:
        return
    groups: Dict[int, List[int]] = {}
    for rank, (_, digest) in enumerate(gathered):
        groups.setdefault(digest, []).append(rank)
    loaders = [rank for rank, (flag, _) in enumerate(gathered) if flag]
    raise RanksDisagreeError(
        f"AdaScale: after load_state_dict() on rank(s) {loaders}, the ranks' AdaScale statistics differ (alike on "
        f"{' / '.join(str(ranks) for ranks in groups.values())}): their gains, and so their learning rates, would "
        "differ. Load the same state dict on every rank. This step's statistics were not updated."
    )
