# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The benchmark's main(): run the worlds, assemble the report, print it, write the JSON and the plot."""

import os
import platform
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

from .config import SCENARIOS, BenchConfig, parse_args
from .launch import launch_world, run_in_torchrun, threads_per_rank, torchrun_rank
from .hybrid import hybrid_section, hybrid_targets
from .model import GPT
from .latency import latency_section
from .plot import write_plot
from .report import full_text, write_json
from .results import add_comparisons
from .sections import accum_section, targets, zero2_section


def worlds(cfg: BenchConfig, torchrun_world: Optional[int]) -> Dict[int, List[str]]:
    """Scenarios per world size, in run order (one world under torchrun)."""
    out: Dict[int, List[str]] = {}
    for scenario in cfg.scenarios:
        if torchrun_world is not None:
            size = torchrun_world
        else:
            sizes = {"zero2": cfg.zero2_world_size, "hybrid": cfg.hybrid_world_size}
            size = sizes.get(scenario, cfg.world_size)
        out.setdefault(size, []).append(scenario)
    return out


def build_report(
    cfg: BenchConfig, records: List[Dict[str, Any]], scenario_worlds: Dict[str, int], argv: Sequence[str]
) -> Dict[str, Any]:
    """Every number of the invocation, as written to the JSON file."""
    add_comparisons(records, cfg)
    accum = accum_section(records)
    zero2 = zero2_section(records, cfg)
    latency = latency_section(records)
    hybrid = hybrid_section(records, cfg)
    done = [r for r in records if not r.get("skipped")]
    params = sum(p.numel() for p in GPT(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab).parameters())
    first_world = next(iter(scenario_worlds.values()), cfg.world_size)
    return {
        "command": "python benchmarks/fsdp.py " + " ".join(argv),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": cfg.device,
            "cpu_count": os.cpu_count(),
            "threads_per_rank": threads_per_rank(cfg, first_world),
            "model_params": params,
        },
        "worlds": scenario_worlds,
        "memory_method": done[0]["memory_method"] if done else None,
        "runs": records,
        "accum": accum,
        "zero2": zero2,
        "latency": latency,
        "hybrid": hybrid,
        "targets": targets(records, accum, zero2, latency) + hybrid_targets(hybrid, records),
    }


def _load_average() -> Optional[List[float]]:
    """1/5/15-minute load averages: other work on the machine makes step times noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(args)
    found = torchrun_rank()
    plan = worlds(cfg, found[1] if found else None)
    records: List[Dict[str, Any]] = []
    scenario_worlds: Dict[str, int] = {}
    load_before = _load_average()
    if found is not None:
        rank, _, records = run_in_torchrun(cfg, [s for group in plan.values() for s in group])
        if rank != 0:
            return 0
        scenario_worlds = {s: found[1] for s in cfg.scenarios}
    else:
        for size, scenarios in plan.items():
            records += launch_world(cfg, scenarios, size)
            scenario_worlds.update({s: size for s in scenarios})
    scenario_worlds = {s: scenario_worlds[s] for s in cfg.scenarios if s in scenario_worlds}
    report = build_report(cfg, records, scenario_worlds, args)
    report["environment"]["load_average"] = {"before": load_before, "after": _load_average()}
    print("\n" + full_text(cfg, report))
    if cfg.out:
        write_json(cfg.out, report)
        print(f"\nJSON: {os.path.abspath(cfg.out)}")
    if cfg.plot:
        skipped = write_plot(cfg.plot, report)
        print(f"plot: {skipped}" if skipped else f"plot: {os.path.abspath(cfg.plot)}")
    missing = [s for s in SCENARIOS if s not in cfg.scenarios]
    if missing:
        print(
            f"(not run: {', '.join(missing)}; --scenario all adds the accumulation-window, zero2, latency and hybrid "
            "sections)"
        )
    return 0
