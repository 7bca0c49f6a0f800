# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The zero2 section's cluster prediction: step time on N nodes x G GPUs, with and without overlap.

Inputs: a run's collectives per step (count and full-buffer bytes per kind, phase and group size, from fairscale's
counter or the c10d spy) and its compute time per step (the measured median step time, or ``--cost-model-unit-ms``
x units). Assumptions (stated next to the table in docs/zero2.rst):

* weak scaling: every GPU keeps its batch, so compute per step and per unit do not change with N, and neither do
  the collectives' full-buffer bytes (padding aside);
* ring collectives: one over n ranks moves ``(n - 1) / n`` of its full buffer through each rank's link; a group of
  at most G ranks (the zero2 group) is inside a node (``intra_gbps``), a bigger one crosses nodes (``inter_gbps``);
  with one node everything is intra-node; latency is ignored;
* compute is split 1/3 forward, 2/3 backward, evenly over the units;
* without overlap every collective waits for the one before and for compute (sum of everything); with overlap
  (prefetch one unit ahead) each phase takes ``max(compute, link time) + min(compute, link time) / units``: the
  longer of the two plus one unit of the shorter that cannot hide (pipeline fill/drain); in backward, gathers and
  reduce-scatters share a link when both use the same kind of link (both inside the node, or both across) and
  use the two links in parallel otherwise (zero2 on several nodes: the gathers stay inside the node).
"""

from typing import Any, Dict, List, Tuple

from .config import BenchConfig

Summary = Dict[str, Dict[str, int]]
#: The clusters of the prediction: N nodes x 8 GPUs.
CLUSTER_NODES = (1, 2, 8, 32)
GPUS_PER_NODE = 8


def _link_seconds(
    summary: Summary, kind: str, phase: str, world: int, zero2: bool, gpus: int, bws: Tuple[float, float]
) -> Tuple[float, bool]:
    """Seconds of one kind/phase's collectives at the cluster's world size, and whether they cross nodes."""
    intra, inter = bws
    total = 0.0
    crosses = False
    for key, entry in summary.items():
        k, ph, _ = key.split("/")
        if k != kind or (phase and ph != phase):
            continue
        n = gpus if zero2 and kind == "all_gather" and phase == "backward" else world
        if n <= 1:
            continue
        inside = n <= gpus
        crosses = crosses or not inside
        total += entry["bytes"] * (n - 1) / n / ((intra if inside else inter) * 1e9)
    return total, crosses


def _units(summary: Summary, microbatches: int) -> int:
    # Resharded units gather in every microbatch's forward, the root once per step: round up.
    gathers = sum(e["count"] for key, e in summary.items() if key.startswith("all_gather/forward/"))
    return max(1, -(-gathers // max(1, microbatches)))


def _phase(compute: float, link: float, units: int) -> float:
    return max(compute, link) + min(compute, link) / units


def predict_step(
    summary: Summary,
    microbatches: int,
    compute_s: float,
    nodes: int,
    gpus_per_node: int,
    intra_gbps: float,
    inter_gbps: float,
    zero2: bool,
) -> Dict[str, Any]:
    """Predicted seconds per step on ``nodes`` x ``gpus_per_node`` GPUs without and with overlap (see the module)."""
    world = nodes * gpus_per_node
    bws = (intra_gbps, inter_gbps)
    ag_fwd, _ = _link_seconds(summary, "all_gather", "forward", world, zero2, gpus_per_node, bws)
    ag_bwd, bwd_crosses = _link_seconds(summary, "all_gather", "backward", world, zero2, gpus_per_node, bws)
    rs, rs_crosses = _link_seconds(summary, "reduce_scatter", "", world, zero2, gpus_per_node, bws)
    units = _units(summary, microbatches)
    fwd_compute, bwd_compute = compute_s / 3, 2 * compute_s / 3
    # Backward gathers and reduce-scatters share a link when both are on the same kind of link.
    backward_link = ag_bwd + rs if bwd_crosses == rs_crosses else max(ag_bwd, rs)
    return {
        "nodes": nodes,
        "world_size": world,
        "units": units,
        "compute_s": compute_s,
        "communication_s": ag_fwd + ag_bwd + rs,
        "no_overlap_s": compute_s + ag_fwd + ag_bwd + rs,
        "overlap_s": _phase(fwd_compute, ag_fwd, units) + _phase(bwd_compute, backward_link, units),
    }


def predictions(run: Dict[str, Any], cfg: BenchConfig) -> Dict[str, List[Dict[str, Any]]]:
    """A zero2-scenario run's predictions per compute basis: ``"measured"`` (its median step time) and, with
    ``--cost-model-unit-ms``, ``"unit_ms"``; a run with a zero2 group keeps the backward gathers inside the node."""
    summary = run["collectives_per_step"]
    zero2 = not isinstance(run["reshard_after_forward"], bool)
    units = _units(summary, run["microbatches"])
    bases = {"measured": run["median_step_s"]}
    if cfg.cost_model_unit_ms is not None:
        bases["unit_ms"] = units * cfg.cost_model_unit_ms / 1e3
    return {
        name: [
            predict_step(
                summary, run["microbatches"], compute, n, GPUS_PER_NODE, cfg.intra_node_gbps, cfg.inter_node_gbps, zero2
            )
            for n in CLUSTER_NODES
        ]
        for name, compute in bases.items()
    }


# The hybrid scenario's model: the groups of a node layout, from a run's collectives per group (global ranks).
#
# Each group of the measured world is given a role: "full" (every rank), "shard" (inside one node) or "replicate"
# (across nodes, not every rank). On ``nodes x ranks_per_node`` ranks a full group has every rank and crosses nodes,
# a shard group is one node, a replicate group has one rank per node. Weak scaling as above: an all-gather or
# reduce-scatter keeps its full-buffer bytes (a unit's parameters or gradients); an all-reduce over the replicate
# group reduces one shard, which shrinks as the shard group grows (bytes x measured / modelled ranks per node).
# Ring collectives: (n-1)/n of the buffer per rank for an all-gather or reduce-scatter, 2(n-1)/n for an all-reduce.
# With ``ring=False`` every collective moves its full buffer instead: the simulated link's own convention, to set
# the model next to the simulated run. With overlap the intra-node and the inter-node link work in parallel in
# backward (a bucket's all-reduce across nodes runs while the next reduce-scatter runs inside the node).
LINK_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def group_role(ranks: Tuple[int, ...], world: int, ranks_per_node: int) -> str:
    """``"full"``, ``"shard"`` (one node) or ``"replicate"`` (across nodes) for a group of these global ranks."""
    if len({r // ranks_per_node for r in ranks}) <= 1:
        return "shard"
    return "full" if len(ranks) == world else "replicate"


def _parse_ranks(key: str) -> Tuple[str, str, Tuple[int, ...]]:
    kind, phase, group = key.split("/")
    return kind, phase, tuple(int(r) for r in group.split("=")[1].split(",") if r)


def layout_link_seconds(
    by_ranks: Summary,
    measured: Tuple[int, int],
    target: Tuple[int, int],
    bws: Tuple[float, float],
    ring: bool = True,
) -> Dict[str, float]:
    """Seconds per step on each link, per phase, of a run's collectives moved to the ``target`` layout.

    Args:
        by_ranks: collectives per step per group (``"kind/phase/ranks=0,1"``), one rank's view.
        measured: (nodes, ranks per node) of the run.
        target: (nodes, ranks per node) of the modelled cluster.
        bws: (intra-node, inter-node) GB/s.
        ring: ring collectives' bytes per rank; ``False``: the full buffer (the simulated link's convention).

    Returns:
        ``{"forward_intra", "forward_inter", "backward_intra", "backward_inter"}`` seconds (other phases, e.g. the
        optimizer's, count as backward).
    """
    world = measured[0] * measured[1]
    nodes, per_node = target
    out = {f"{ph}_{link}": 0.0 for ph in ("forward", "backward") for link in ("intra", "inter")}
    for key, entry in by_ranks.items():
        kind, phase, ranks = _parse_ranks(key)
        if kind not in LINK_KINDS or len(ranks) <= 1:
            continue
        role = group_role(ranks, world, measured[1])
        n = {"full": nodes * per_node, "shard": per_node, "replicate": nodes}[role]
        nbytes = float(entry["bytes"])
        if kind == "all_reduce" and role == "replicate":
            nbytes *= measured[1] / per_node  # the shard it reduces shrinks with a bigger shard group
        factor = (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n if ring else 1.0
        link = "intra" if role == "shard" else "inter"
        seconds = nbytes * factor / ((bws[0] if link == "intra" else bws[1]) * 1e9)
        out[f"{'forward' if phase == 'forward' else 'backward'}_{link}"] += seconds
    return out


def predict_layout_step(
    by_ranks: Summary,
    microbatches: int,
    compute_s: float,
    measured: Tuple[int, int],
    target: Tuple[int, int],
    bws: Tuple[float, float],
    ring: bool = True,
) -> Dict[str, Any]:
    """Predicted seconds per step of a run's collectives on the ``target`` layout, without and with overlap."""
    links = layout_link_seconds(by_ranks, measured, target, bws, ring)
    units = _units(by_ranks, microbatches)
    fwd = links["forward_intra"] + links["forward_inter"]
    bwd_serial = links["backward_intra"] + links["backward_inter"]
    return {
        "nodes": target[0],
        "ranks_per_node": target[1],
        "world_size": target[0] * target[1],
        "units": units,
        "compute_s": compute_s,
        "intra_node_s": links["forward_intra"] + links["backward_intra"],
        "inter_node_s": links["forward_inter"] + links["backward_inter"],
        "communication_s": fwd + bwd_serial,
        "no_overlap_s": compute_s + fwd + bwd_serial,
        "overlap_s": _phase(compute_s / 3, fwd, units)
        + _phase(2 * compute_s / 3, max(links["backward_intra"], links["backward_inter"]), units),
    }
