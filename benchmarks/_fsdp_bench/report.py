# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The human-readable report (tables on stdout) and the JSON file with every number."""

import json
import math
import os
from typing import Any, Dict, List, Optional

from .config import BenchConfig
from .hybrid import hybrid_text
from .latency import latency_text


def _mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _coll(summary: Dict[str, Dict[str, int]], kind: str, phase: str) -> str:
    """``count x MiB`` of one kind and phase, with the group size when it is not the only one."""
    parts = []
    for key, entry in sorted(summary.items()):
        k, ph, group = key.split("/")
        if k == kind and ph == phase:
            parts.append(f"{entry['count']}x{entry['bytes'] / 2**20:.2f}M@{group.split('=')[1]}")
    return "+".join(parts) or "0"


def _spread(quartiles: List[float]) -> str:
    return f"{quartiles[0] * 1e3:.0f}-{quartiles[2] * 1e3:.0f}"


def _loss_cell(r: Dict[str, Any]) -> str:
    if r.get("loss_matches") is None:
        return "-"
    return "match" if r["loss_matches"] else f"DIFF {r['loss_max_abs_diff']:.1e}"


def _formula_cell(r: Dict[str, Any]) -> str:
    if r.get("formula_matches") is None:
        return "-"
    return "=" if r["formula_matches"] else "differs"


def runs_table(records: List[Dict[str, Any]]) -> str:
    """One line per run: times, throughput, memory, collectives per step, formula check, cats, loss parity."""
    head = (
        f"{'run':<30} {'step ms':>8} {'(p25-p75)':>11} {'window ms':>9} {'tok/s/rank':>10} {'tok/s all':>9} {'state MiB':>9} {'peak MiB':>8} "
        f"{'all-gather fwd':>16} {'all-gather bwd':>16} {'reduce-scatter':>16} {'formula':>7} {'cat/mb':>6} loss"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        if r.get("skipped"):
            lines.append(f"{r['label']:<30} skipped: {r['skipped']}")
            continue
        s = r["collectives_per_step"]
        cats = r["cat_per_microbatch"]
        lines.append(
            f"{r['label']:<30} {r['median_step_s'] * 1e3:8.1f} {_spread(r['step_s_quartiles']):>11} "
            f"{r['median_window_s'] * 1e3:9.1f} "
            f"{r['tokens_per_s_per_rank']:10.0f} {r['tokens_per_s_total']:9.0f} {_mib(r['steady_memory_bytes']):>9} {_mib(r['peak_memory_bytes']):>8} "
            f"{_coll(s, 'all_gather', 'forward'):>16} {_coll(s, 'all_gather', 'backward'):>16} "
            f"{_coll(s, 'reduce_scatter', 'backward'):>16} {_formula_cell(r):>7} "
            f"{(sum(cats) / len(cats)) if cats else 0:6.1f} {_loss_cell(r)}"
        )
    return "\n".join(lines)


def ratios_text(records: List[Dict[str, Any]]) -> str:
    """Step-time and peak-memory ratios of each run to the others of its configuration."""
    lines = []
    for r in records:
        if r.get("skipped") or not r.get("step_time_ratio"):
            continue
        cells = []
        for other, ratio in r["step_time_ratio"].items():
            mem = r["peak_memory_ratio"].get(other)
            cells.append(f"{other}: {ratio:.2f}x time" + (f", {mem:.2f}x mem" if mem is not None else ""))
        lines.append(f"  {r['label']:<30} vs " + "; ".join(cells))
    return "\n".join(lines)


def accum_text(accum: Dict[str, Any]) -> str:
    """The optimize_backward_concat section."""
    lines = [
        f"optimize_backward_concat, {accum['microbatches']}-microbatch window (fairscale, "
        f"{accum['tokens_per_microbatch_per_rank']} tokens per rank per microbatch, "
        f"reshard_after_forward={accum['reshard_after_forward']}):"
    ]
    for name in ("off", "on"):
        row = accum[name]
        lines.append(
            f"  {name:<3} window {row['median_window_s'] * 1e3:8.1f} ms  peak {_mib(row['peak_memory_bytes']):>8} MiB  "
            f"cat ops per microbatch {row['cat_per_microbatch']}  (total {row['cat_total']})"
        )
    lines.append(
        f"  window time on/off: {accum['window_time_ratio_on_off']:.3f}x; loss curves "
        f"{'match' if accum['loss_matches'] else 'DIFFER'}"
    )
    return "\n".join(lines)


def zero2_text(zero2: Dict[str, Any]) -> str:
    """The zero2 section: bytes by group, cost model, memory."""
    lines = [
        f"zero2: world size {zero2['world_size']}, groups of {zero2['group_size']} (cost model: {zero2['group_size']} "
        f"ranks per node, {zero2['intra_node_gbps']:g} GB/s inside a node, {zero2['inter_node_gbps']:g} GB/s across)",
        f"  {'run':<28} {'AG fwd full':>11} {'AG bwd full':>11} {'AG bwd zero2':>12} {'RS full':>9} "
        f"{'x-node MiB/rank':>15} {'model ms':>8} {'peak MiB':>8} {'steady MiB':>10}",
    ]
    for label, row in zero2["runs"].items():
        cost = row["cost_model"]
        lines.append(
            f"  {label:<28} {_mib(row['all_gather_forward_full_group_bytes']):>11} "
            f"{_mib(row['all_gather_backward_full_group_bytes']):>11} {_mib(row['all_gather_backward_zero2_group_bytes']):>12} "
            f"{_mib(row['reduce_scatter_full_group_bytes']):>9} {_mib(cost['cross_node_bytes_per_rank']):>15} "
            f"{cost['seconds_per_step'] * 1e3:8.3f} {_mib(row['peak_memory_bytes']):>8} {_mib(row['steady_memory_bytes']):>10}"
        )
    lines.append("  (bytes per step in MiB, full-buffer sizes; model ms = modelled communication time per step)")
    if "cluster_nodes" in zero2:
        lines.append(_cluster_text(zero2))
    return "\n".join(lines)


def _cluster_text(zero2: Dict[str, Any]) -> str:
    """Predicted step time on N nodes x G GPUs, without / with overlap (assumptions: docs/zero2.rst)."""
    nodes, gpus = zero2["cluster_nodes"], zero2["cluster_gpus_per_node"]
    bases = {"measured": "compute = this run's measured step time", "unit_ms": "compute = --cost-model-unit-ms"}
    lines = []
    for basis, title in bases.items():
        rows = [(label, row["cluster"][basis]) for label, row in zero2["runs"].items() if basis in row["cluster"]]
        if not rows:
            continue
        lines.append(f"  predicted step ms on N nodes x {gpus} GPUs, no overlap / overlap ({title}):")
        lines.append(f"  {'run':<28} {'compute':>8} " + " ".join(f"{f'N={n}':>17}" for n in nodes))
        for label, preds in rows:
            cells = " ".join(f"{p['no_overlap_s'] * 1e3:>8.3f}/{p['overlap_s'] * 1e3:<8.3f}" for p in preds)
            lines.append(f"  {label:<28} {preds[0]['compute_s'] * 1e3:>8.3f} {cells}")
    return "\n".join(lines)


def targets_text(targets: List[Dict[str, Any]]) -> str:
    """The issue's targets with the measured value."""
    marks = {True: "met   ", False: "MISSED", None: "n/a   "}
    return "\n".join(f"  [{marks[t['met']]}] {t['target']}: {t['value']}" for t in targets)


def _accum_batch(cfg: BenchConfig) -> str:
    """The accum scenario's own microbatch size (``--accum-batch``), where it runs and differs."""
    if "accum" not in cfg.scenarios or cfg.accum_batch == cfg.batch:
        return ""
    return f" (accum: batch {cfg.accum_batch})"


def header(cfg: BenchConfig, env: Dict[str, Any]) -> str:
    """What was run, on what."""
    return (
        f"model: GPT {cfg.layers} layers x {cfg.hidden} hidden, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"{env['model_params'] / 1e6:.2f}M params; batch {cfg.batch} x seq {cfg.seq_len} per rank per microbatch{_accum_batch(cfg)}; "
        f"mixed precision {cfg.mixed_precision}; flatten {cfg.flatten}; auto-wrap {cfg.auto_wrap_policy}; "
        f"checkpointing {cfg.checkpoint_activations}\n"
        f"steps: {cfg.warmup} warmup + {cfg.steps} timed per run (latency scenario: {cfg.latency_steps}; +6 untimed "
        "probe steps on a fresh copy); "
        f"torch {env['torch']}, device {env['device']}, {env['threads_per_rank']} thread(s) per rank, "
        f"{env['cpu_count']} cores" + _link_line(cfg)
    )


def _link_line(cfg: BenchConfig) -> str:
    """The simulated link of the timed steps, when ``--link-gbps`` set one."""
    if cfg.link_gbps is None:
        return ""
    intra = f", zero2 group {cfg.link_intra_gbps:g} GB/s" if cfg.link_intra_gbps is not None else ""
    return (
        f"\nsimulated link in the timed steps (every peer): {cfg.link_gbps:g} GB/s{intra}, "
        f"{cfg.link_latency_us:g} us per collective (the probe steps run without it)"
    )


def full_text(cfg: BenchConfig, report: Dict[str, Any]) -> str:
    """Everything printed at the end of a benchmark."""
    parts = [header(cfg, report["environment"])]
    for scenario, world in report["worlds"].items():
        runs = [r for r in report["runs"] if r["scenario"] == scenario]
        parts.append(f"\n== {scenario} (world size {world}) ==\n" + runs_table(runs))
        ratios = ratios_text(runs)
        if ratios:
            parts.append("ratios to the other runs of the same configuration:\n" + ratios)
    if report.get("accum"):
        parts.append("\n" + accum_text(report["accum"]))
    if report.get("zero2"):
        parts.append("\n" + zero2_text(report["zero2"]))
    if report.get("latency"):
        parts.append("\n" + latency_text(report["latency"]))
    if report.get("hybrid"):
        parts.append("\n" + hybrid_text(report["hybrid"]))
    for issue in sorted({t.get("issue", 10) for t in report.get("targets") or []}):
        mine = [t for t in report["targets"] if t.get("issue", 10) == issue]
        parts.append(f"\ntargets (issue {issue}):\n" + targets_text(mine))
    parts.append(
        "\nnotes: step/window = median over the timed steps of the slowest rank (window = forward+backward of all "
        "microbatches); tok/s = tokens per step / step time; collectives per step as count x MiB @ group size "
        "(full-buffer bytes): fairscale from its collective counter, the others from a c10d dispatch spy; formula = "
        "the ZeRO-3 bytes for the configuration (fairscale only); state = live bytes between steps, peak = highest "
        f"during a step, per rank ({report['memory_method']}); cat/mb = aten::cat/_chunk_cat per microbatch backward; "
        f"load average during the run: {report['environment'].get('load_average')}."
    )
    return "\n".join(parts)


def _clean(obj: Any) -> Any:
    """JSON-safe copy (no NaN/inf, tuples as lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str, report: Dict[str, Any]) -> None:
    """Write ``report`` to ``path`` (directories are created)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(report), f, indent=1, sort_keys=False)
        f.write("\n")
