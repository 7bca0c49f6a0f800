# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What the collectives of a step should be, from the model and the configuration alone, and a cost model.

ZeRO-3 with fairscale's accumulation rule, per optimizer step of M microbatches, for each sharding unit with Ψ
padded parameter elements (Ψ rounded up to a multiple of the sharding group size N, per flat parameter or per
parameter without flattening), gathered in the compute dtype (b bytes per element):

* a unit that reshards after forward (every unit but the root, unless ``reshard_after_forward=False``)
  all-gathers Ψ·b in every forward and again in every backward, over N ranks, or over the zero2 group of G ranks
  in backward when it has one;
* a unit that does not reshard keeps its parameters across the ``no_sync()`` microbatches: one forward all-gather
  per step and none in backward;
* every unit reduce-scatters Ψ·b once per step (last microbatch) over N ranks;
* without ``flatten_parameters`` each parameter is gathered and reduced on its own (same bytes, more calls).

Bytes are full-buffer sizes, as the collective counter records them (a ring moves (n-1)/n of that per rank).
"""

from typing import Dict, List, Optional

from .config import Reshard

Summary = Dict[str, Dict[str, int]]


def padded_numel(numels: List[int], world_size: int, flatten: bool) -> int:
    """Elements of one unit after padding every shard to equal size."""

    def pad(n: int) -> int:
        return -(-n // world_size) * world_size

    if flatten:
        return pad(sum(numels)) if sum(numels) else 0
    return sum(pad(n) for n in numels if n)


def zero3_per_step(
    units: Dict[str, List[int]],
    world_size: int,
    reshard: Reshard,
    microbatches: int,
    compute_bytes: int,
    flatten: bool,
) -> Summary:
    """Expected collectives per step as a ``CollectiveCounter.summary()``-style dict (``"kind/phase/gs=n"``).

    Args:
        units: parameter numels owned by each unit, ``""`` being the root.
        world_size: N, the sharding group size.
        reshard: ``reshard_after_forward``; an int G means a zero2 group of G ranks for the backward gather.
        microbatches: M.
        compute_bytes: bytes per element of the gathered parameters and of the reduced gradients.
        flatten: ``flatten_parameters``.
    """
    out: Summary = {}

    def add(key: str, count: int, nbytes: int) -> None:
        entry = out.setdefault(key, {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += count * nbytes

    if world_size == 1:
        return out
    backward_group = reshard if not isinstance(reshard, bool) else world_size
    for name, numels in units.items():
        # One collective per flat parameter, or per parameter without flattening.
        pieces = [numels] if flatten else [[n] for n in numels]
        for piece in pieces:
            size = padded_numel(piece, world_size, flatten=True) * compute_bytes
            if size == 0:
                continue
            reshards = reshard is not False and name != ""
            add(f"all_gather/forward/gs={world_size}", microbatches if reshards else 1, size)
            if reshards:
                add(f"all_gather/backward/gs={backward_group}", microbatches, size)
            add(f"reduce_scatter/backward/gs={world_size}", 1, size)
    return out


def compare(measured: Summary, expected: Summary, compare_counts: Optional[List[str]] = None) -> List[str]:
    """Differences between a measured and an expected summary (empty when they match).

    Bytes are compared for every key; counts only for the kinds in ``compare_counts`` (reduce-scatters are
    bucketed, so their count depends on the bucket size and on the bucketer's flush policy, which sends a fill
    before it would outgrow the largest gradient seen or 1 MiB, whichever is larger; ``zero3_per_step`` gives the
    unbucketed count, one per flat parameter).
    """
    kinds = compare_counts if compare_counts is not None else ["all_gather"]
    diffs: List[str] = []
    for key in sorted(set(measured) | set(expected)):
        if not key.startswith(("all_gather/", "reduce_scatter/")):
            continue
        got = measured.get(key, {"count": 0, "bytes": 0})
        want = expected.get(key, {"count": 0, "bytes": 0})
        if got["bytes"] != want["bytes"]:
            diffs.append(f"{key}: {got['bytes']} bytes measured, {want['bytes']} expected")
        elif key.split("/")[0] in kinds and got["count"] != want["count"]:
            diffs.append(f"{key}: {got['count']} calls measured, {want['count']} expected")
    return diffs


def cost_model(summary: Summary, ranks_per_node: int, intra_gbps: float, inter_gbps: float) -> Dict[str, float]:
    """Seconds per step spent in all-gathers and reduce-scatters, and cross-node bytes per rank.

    A collective over n ranks moves (n-1)/n of its full buffer through each rank's link (ring algorithm). Groups
    of at most ``ranks_per_node`` ranks are taken to be inside one node (``intra_gbps``); bigger groups span nodes
    and are limited by the network (``inter_gbps``). GB = 1e9 bytes.
    """
    seconds = 0.0
    cross_node = 0.0
    for key, entry in summary.items():
        kind, _, group = key.split("/")
        if kind not in ("all_gather", "reduce_scatter"):
            continue
        n = int(group.split("=")[1])
        if n <= 1:
            continue
        moved = entry["bytes"] * (n - 1) / n
        inside = n <= ranks_per_node
        seconds += moved / ((intra_gbps if inside else inter_gbps) * 1e9)
        if not inside:
            cross_node += moved
    return {"seconds_per_step": seconds, "cross_node_bytes_per_rank": cross_node}


def bytes_by_group(summary: Summary, kind: str, phase: Optional[str] = None) -> Dict[int, int]:
    """Bytes of ``kind`` (optionally of one phase) per group size."""
    out: Dict[int, int] = {}
    for key, entry in summary.items():
        k, ph, group = key.split("/")
        if k == kind and (phase is None or ph == phase):
            n = int(group.split("=")[1])
            out[n] = out.get(n, 0) + entry["bytes"]
    return out
