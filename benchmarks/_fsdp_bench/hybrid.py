# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The hybrid scenario's section: full vs hybrid sharding on a simulated node layout, and the 64-rank cost model.

The runs (see runner.specs_for): fairscale full sharding over every rank, fairscale hybrid (``process_group`` =
one node, ``replicate_process_group`` = the same local rank on every node), FSDP2 HSDP (``fully_shard`` on a
(nodes, ranks per node) mesh) and FSDP1 ``HYBRID_SHARD``, all on a simulated link whose bandwidth per group follows
from its ranks (link.NodeLayout), and fairscale full sharding without the link (the compute floor).
"""

from typing import Any, Dict, List, Optional, Tuple

from .cluster import group_role, predict_layout_step
from .config import BenchConfig

Summary = Dict[str, Dict[str, int]]
#: Issue 29's bounds: hybrid step / full-sharding step, and hybrid step / FSDP2 HSDP's step.
FULL_RATIO_LIMIT = 0.8
HSDP_RATIO_LIMIT = 1.0


def _runs(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [r for r in records if r["scenario"] == "hybrid" and not r.get("skipped")]


def _find(runs: List[Dict[str, Any]], peer: str, hybrid: bool, floor: bool = False) -> Optional[Dict[str, Any]]:
    return next((r for r in runs if r["peer"] == peer and r["hybrid"] == hybrid and r["floor"] == floor), None)


def per_group(by_ranks: Summary, world: int, ranks_per_node: int) -> Dict[str, Summary]:
    """A run's collectives per group: ``{"shard 0,1": {"all_gather/forward": {count, bytes}}, ...}``."""
    out: Dict[str, Summary] = {}
    for key, entry in sorted(by_ranks.items()):
        kind, phase, group = key.split("/")
        ranks = tuple(int(r) for r in group.split("=")[1].split(",") if r)
        name = f"{group_role(ranks, world, ranks_per_node)} {','.join(map(str, ranks))}"
        out.setdefault(name, {})[f"{kind}/{phase}"] = dict(entry)
    return out


def _compute_basis(runs: List[Dict[str, Any]], cfg: BenchConfig) -> Dict[str, Tuple[float, Tuple[float, float]]]:
    """Compute seconds per step and (intra, inter) GB/s of each basis of the cost model.

    ``"simulated"``: the floor run's median step (no link) with the simulated link's bandwidths: the machine
    balance of the 2 x 2 run, scaled to the big cluster. ``"cluster"`` (with ``--cost-model-unit-ms``): that
    compute per unit with ``--intra-node-gbps`` / ``--inter-node-gbps``.
    """
    out: Dict[str, Tuple[float, Tuple[float, float]]] = {}
    floor = _find(runs, "fairscale", False, floor=True)
    if floor is not None:
        out["simulated"] = (floor["median_step_s"], (cfg.hybrid_intra_gbps, cfg.hybrid_inter))
    if cfg.cost_model_unit_ms is not None and runs:
        out["cluster"] = (runs[0]["units"] * cfg.cost_model_unit_ms / 1e3, (cfg.intra_node_gbps, cfg.inter_node_gbps))
    return out


def _model(runs: List[Dict[str, Any]], cfg: BenchConfig, measured: Tuple[int, int]) -> Dict[str, Any]:
    """Per basis and run: the model at the measured layout (link's convention) and at the big cluster (rings)."""
    target = (cfg.hybrid_model_nodes, cfg.hybrid_model_ranks_per_node)
    out: Dict[str, Any] = {"target_nodes": target[0], "target_ranks_per_node": target[1], "bases": {}}
    for basis, (compute, bws) in _compute_basis(runs, cfg).items():
        rows: Dict[str, Any] = {}
        for r in runs:
            if r["floor"]:
                continue
            summary, mb = r["collectives_per_group"], r["microbatches"]
            rows[r["label"]] = {
                "measured_layout": predict_layout_step(summary, mb, compute, measured, measured, bws, ring=False),
                "target": predict_layout_step(summary, mb, compute, measured, target, bws),
            }
        out["bases"][basis] = {"compute_s": compute, "intra_gbps": bws[0], "inter_gbps": bws[1], "runs": rows}
    return out


def _trend(section: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Whether the model's hybrid/full ratio on the big cluster is < 1 as the measured 2 x 2 ratio is (or is not)."""
    measured = section.get("fairscale_hybrid_over_full")
    basis = section["cost_model"]["bases"].get("simulated")
    full, hybrid = section.get("labels", {}).get("full"), section.get("labels", {}).get("hybrid")
    if measured is None or basis is None or full not in basis["runs"] or hybrid not in basis["runs"]:
        return None
    rows = basis["runs"]
    out: Dict[str, Any] = {"measured_2x2": measured}
    for name in ("no_overlap_s", "overlap_s"):
        out[f"model_measured_layout_{name[:-2]}"] = (
            rows[hybrid]["measured_layout"][name] / rows[full]["measured_layout"][name]
        )
        out[f"model_target_{name[:-2]}"] = rows[hybrid]["target"][name] / rows[full]["target"][name]
    out["agrees"] = (out["model_target_overlap"] < 1) == (measured < 1)
    return out


def hybrid_section(records: List[Dict[str, Any]], cfg: BenchConfig) -> Optional[Dict[str, Any]]:
    """Step times and their ratios, memory, collectives per group, and the cost model with its trend check."""
    runs = _runs(records)
    if not runs:
        return None
    world, g = runs[0]["world_size"], cfg.hybrid_ranks_per_node
    full, hybrid = _find(runs, "fairscale", False), _find(runs, "fairscale", True)
    hsdp = _find(runs, "fsdp2", True)
    out: Dict[str, Any] = {
        "world_size": world,
        "ranks_per_node": g,
        "nodes": world // g,
        "intra_node_gbps": cfg.hybrid_intra_gbps,
        "inter_node_gbps": cfg.hybrid_inter,
        "latency_us": cfg.link_latency_us,
        "labels": {k: r["label"] for k, r in (("full", full), ("hybrid", hybrid), ("fsdp2_hsdp", hsdp)) if r},
        "runs": {},
    }
    for r in runs:
        row: Dict[str, Any] = {
            "median_step_s": r["median_step_s"],
            "step_s_quartiles": r["step_s_quartiles"],
            "peak_memory_bytes": r["peak_memory_bytes"],
            "steady_memory_bytes": r["steady_memory_bytes"],
            "loss_matches": r.get("loss_matches"),
            "collectives_source": r["collectives_source"],
            "collectives_per_group": per_group(r["collectives_per_group"], world, g),
        }
        for name, ref in (("vs_full", full), ("vs_fsdp2_hsdp", hsdp)):
            if ref is not None and ref is not r:
                row[f"step_ratio_{name}"] = r["median_step_s"] / ref["median_step_s"]
        out["runs"][r["label"]] = row
    if full is not None and hybrid is not None:
        out["fairscale_hybrid_over_full"] = hybrid["median_step_s"] / full["median_step_s"]
    if hsdp is not None and hybrid is not None:
        out["fairscale_hybrid_over_fsdp2_hsdp"] = hybrid["median_step_s"] / hsdp["median_step_s"]
    out["cost_model"] = _model(runs, cfg, (world // g, g))
    out["trend"] = _trend(out)
    return out


def hybrid_targets(section: Optional[Dict[str, Any]], records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Issue 29's targets (``met`` is ``None`` when not measured)."""
    if section is None:
        return []
    out: List[Dict[str, Any]] = []
    labels = section["labels"]
    quartiles = {label: row["step_s_quartiles"] for label, row in section["runs"].items()}
    for key, ref, limit in (
        ("fairscale_hybrid_over_full", "full", FULL_RATIO_LIMIT),
        ("fairscale_hybrid_over_fsdp2_hsdp", "fsdp2_hsdp", HSDP_RATIO_LIMIT),
    ):
        ratio = section.get(key)
        name = f"hybrid: step fairscale hybrid / {labels.get(ref, ref)} <= {limit:g}"
        if ratio is None:
            out.append({"target": name, "value": "not measured", "met": None})
            continue
        a, b = quartiles[labels["hybrid"]], quartiles[labels[ref]]
        noisy = a[0] <= b[2] and b[0] <= a[2]
        value = f"{ratio:.3f}" + (" (interquartile ranges overlap: within noise)" if noisy else "")
        out.append({"target": name, "value": value, "ratio": ratio, "met": ratio <= limit, "within_noise": noisy})
    memory = {label: row["peak_memory_bytes"] for label, row in section["runs"].items()}
    out.append(
        {
            "target": "hybrid: peak memory reported for every run",
            "value": ", ".join(f"{k} {v / 2**20:.1f} MiB" if v else f"{k} -" for k, v in memory.items()),
            "met": all(v is not None for v in memory.values()),
        }
    )
    hybrid = next((r for r in _runs(records) if r["label"] == labels.get("hybrid")), None)
    if hybrid is not None:
        out.append(
            {
                "target": "hybrid: fairscale hybrid's losses match full sharding's",
                "value": f"max |diff| {hybrid['loss_max_abs_diff']:.1e}",
                "met": bool(hybrid.get("loss_matches")),
            }
        )
    trend = section.get("trend")
    model = section["cost_model"]
    out.append(
        {
            "target": f"hybrid: cost model on {model['target_nodes']} x {model['target_ranks_per_node']} ranks agrees "
            "with the 2 x 2 run (hybrid/full < 1 in both)",
            "value": (
                "not measured"
                if trend is None
                else f"model {trend['model_target_overlap']:.3f} (no overlap {trend['model_target_no_overlap']:.3f}), "
                f"measured {trend['measured_2x2']:.3f}"
            ),
            "met": None if trend is None else bool(trend["agrees"] and trend["measured_2x2"] < 1),
        }
    )
    for t in out:
        t["issue"] = 29
    return out


def _mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _groups_cell(groups: Dict[str, Summary]) -> str:
    """``shard 0,1: AG 10x4.1M RS 1x2.0M | replicate 0,2: AR 1x1.0M`` (count x MiB per step, all phases)."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}
    cells = []
    for name, kinds in groups.items():
        totals: Dict[str, List[int]] = {}
        for key, entry in kinds.items():
            kind = key.split("/")[0]
            if kind in short:
                t = totals.setdefault(short[kind], [0, 0])
                t[0], t[1] = t[0] + entry["count"], t[1] + entry["bytes"]
        if totals:
            cells.append(f"{name}: " + " ".join(f"{k} {c}x{b / 2**20:.2f}M" for k, (c, b) in totals.items()))
    return " | ".join(cells) or "-"


def hybrid_text(section: Dict[str, Any]) -> str:
    """The hybrid section: step times and ratios, memory, collectives per group, cost model."""
    lines = [
        f"hybrid: {section['nodes']} nodes x {section['ranks_per_node']} ranks, simulated link "
        f"{section['intra_node_gbps']:g} GB/s inside a node, {section['inter_node_gbps']:g} GB/s across, "
        f"{section['latency_us']:g} us per collective",
        f"  {'run':<34} {'step ms':>8} {'/full':>6} {'/hsdp':>6} {'peak MiB':>8} {'state MiB':>9} {'loss':>5}  "
        "collectives per step per group (rank 0's groups)",
    ]
    for label, row in section["runs"].items():
        ratios = [row.get(k) for k in ("step_ratio_vs_full", "step_ratio_vs_fsdp2_hsdp")]
        cells = " ".join("     -" if x is None else f"{x:6.3f}" for x in ratios)
        loss = "-" if row["loss_matches"] is None else ("match" if row["loss_matches"] else "DIFF")
        lines.append(
            f"  {label:<34} {row['median_step_s'] * 1e3:8.1f} {cells} {_mib(row['peak_memory_bytes']):>8} "
            f"{_mib(row['steady_memory_bytes']):>9} {loss:>5}  {_groups_cell(row['collectives_per_group'])}"
        )
    lines.append("  (full = every rank, shard = one node's ranks, replicate = one rank per node; full-buffer bytes)")
    model = section["cost_model"]
    for basis, data in model["bases"].items():
        lines.append(
            f"  cost model ({basis}: compute {data['compute_s'] * 1e3:.1f} ms/step, {data['intra_gbps']:g} / "
            f"{data['inter_gbps']:g} GB/s intra / inter): predicted step ms, no overlap / overlap"
        )
        big = f"{model['target_nodes']} x {model['target_ranks_per_node']} ranks (rings)"
        lines.append(f"  {'run':<34} {'this layout (link convention)':>30} {big:>30} {'inter-node ms':>13}")
        for label, pred in data["runs"].items():
            here, there = pred["measured_layout"], pred["target"]
            lines.append(
                f"  {label:<34} {here['no_overlap_s'] * 1e3:>14.1f} / {here['overlap_s'] * 1e3:<13.1f} "
                f"{there['no_overlap_s'] * 1e3:>14.1f} / {there['overlap_s'] * 1e3:<13.1f} "
                f"{there['inter_node_s'] * 1e3:>13.1f}"
            )
    trend = section.get("trend")
    if trend is not None:
        lines.append(
            f"  trend: hybrid/full measured {trend['measured_2x2']:.3f} on {section['nodes']} x "
            f"{section['ranks_per_node']}; model {trend['model_measured_layout_overlap']:.3f} there, "
            f"{trend['model_target_overlap']:.3f} on {model['target_nodes']} x {model['target_ranks_per_node']} "
            f"(overlap) -> {'agrees' if trend['agrees'] else 'DISAGREES'}"
        )
    return "\n".join(lines)
