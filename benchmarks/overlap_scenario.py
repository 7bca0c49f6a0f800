#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``overlap`` scenario of the main job: step time against link bandwidth, prefetch off/on and FSDP2.

On one machine the link between ranks is memory, so communication costs nearly nothing and hiding it behind compute
shows nothing. This scenario trains the benchmark GPT (one microbatch per step) on a simulated link of each
``--overlap-gbps`` bandwidth (plus ``--link-latency-us``), the same delays for every peer (see
``_fsdp_bench/link.py``), three ways:

* ``fairscale no-prefetch``: ``forward_prefetch=False, backward_prefetch=False`` (upstream's behaviour);
* ``fairscale prefetch``: ``forward_prefetch=True, backward_prefetch=True``;
* ``fsdp2``: PyTorch's ``fully_shard`` (implicit prefetch).

The floor is each one's step time without any simulated link (the compute, plus the near-free local
communication), measured last. The models are built once and warmed up; the variants take their steps in turn, so
that machine load lands on all of them. Output:
a table, ``<out>_overlap.json`` and ``<plot>_overlap.png`` (with matplotlib).

Run through the main job (``python benchmarks/fsdp.py --scenario overlap``) or alone
(``python benchmarks/overlap_scenario.py``). The world has ``--world-size`` ranks (default 2).
"""

import dataclasses
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.scenario_args import split_scenario_args  # noqa: E402
from _fsdp_bench.config import BenchConfig, parse_args  # noqa: E402
from _fsdp_bench.corpus import Corpus  # noqa: E402
from _fsdp_bench.measure import TimedRun  # noqa: E402
from _fsdp_bench.launch import threads_per_rank  # noqa: E402
from _fsdp_bench.model import GPT  # noqa: E402
from _fsdp_bench.peers import RunSpec, skip_reason  # noqa: E402

from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import collectives  # noqa: E402

SCENARIO = "overlap"
FLOOR = "floor"
VARIANTS: Tuple[Tuple[str, str, Optional[bool]], ...] = (
    ("fairscale no-prefetch", "fairscale", False),
    ("fairscale prefetch", "fairscale", True),
    ("fsdp2", "fsdp2", None),
)


def split_scenario(argv: Sequence[str]) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line for the ``overlap`` scenario (see :func:`split_scenario_args`)."""
    return split_scenario_args(argv, SCENARIO)


def _specs(cfg: BenchConfig) -> List[Tuple[str, RunSpec]]:
    specs = [(name, RunSpec(SCENARIO, peer, True, 1, prefetch=prefetch)) for name, peer, prefetch in VARIANTS]
    return [(name, spec) for name, spec in specs if skip_reason(spec, cfg) is None]


def _rank_body(rank: int, world_size: int, cfg: BenchConfig) -> Dict[str, Any]:
    """Every bandwidth (then the floor) for every variant; per run the slowest rank's step times.

    The models are built once and warmed up by one step; then each bandwidth's steps run, the variants in turn.
    """
    torch.set_num_threads(threads_per_rank(cfg, world_size))
    device = torch.device("cpu") if cfg.device == "cpu" else torch.device("cuda", rank)
    cfg = dataclasses.replace(cfg, world_size=world_size, microbatches=1)
    corpus = Corpus(cfg.vocab, cfg.seq_len, cfg.seed)
    named = _specs(cfg)
    runs = [
        TimedRun(spec, dataclasses.replace(cfg, link_gbps=None), corpus, rank, world_size, device) for _, spec in named
    ]
    out: Dict[str, Any] = {"variants": [name for name, _ in named], "runs": {}}
    step = 0
    for run in runs:  # warm-up (lazy initialisation, the recorded unit order), untimed
        run.step(step)
    for gbps in tuple(cfg.overlap_gbps) + (None,):
        first = len(runs[0].step_s)
        for run in runs:
            run.cfg = dataclasses.replace(cfg, link_gbps=gbps)
        for step in range(step + 1, step + 1 + cfg.overlap_steps):
            for i in range(len(runs)):
                runs[(step + i) % len(runs)].step(step)
        for (name, _), run in zip(named, runs):
            gathered = collectives.all_gather_object(run.step_s[first:])
            slowest = [max(per_rank) for per_rank in zip(*gathered)]
            out["runs"].setdefault(FLOOR if gbps is None else f"{gbps:g}", {})[name] = {
                "median_step_ms": 1000 * statistics.median(slowest),
                "step_ms": [1000 * s for s in slowest],
                "loss": run.losses[first:],
            }
    for run in runs:
        run.close()
    return out


def bytes_per_step(cfg: BenchConfig) -> int:
    """Bytes one rank's fairscale step moves (full-buffer convention): 2 all-gathers + 1 reduce-scatter a unit."""
    params = sum(p.numel() for p in GPT(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab).parameters())
    return 3 * 4 * params


def format_table(result: Dict[str, Any], cfg: BenchConfig) -> str:
    """Step time (ms) per bandwidth and variant, the floor, and prefetch's speed-up."""
    names: List[str] = result["variants"]
    runs = result["runs"]
    mb = bytes_per_step(cfg) / 1e6
    lines = [
        f"overlap: step time (ms, median, slowest rank) vs simulated link; {mb:.1f} MB of collectives per step, "
        f"latency {cfg.link_latency_us:g} us",
        f"{'GB/s':>8} {'comm ms':>8} " + " ".join(f"{n:>22}" for n in names) + "  prefetch speed-up",
    ]
    for key, row in runs.items():
        comm = "0" if key == FLOOR else f"{mb / 1e3 / float(key) * 1e3:.0f}"
        cells = " ".join(f"{row[n]['median_step_ms']:>22.1f}" for n in names)
        speedup = ""
        if "fairscale prefetch" in row and "fairscale no-prefetch" in row:
            ratio = row["fairscale no-prefetch"]["median_step_ms"] / row["fairscale prefetch"]["median_step_ms"]
            speedup = f"{ratio:.2f}x"
        lines.append(f"{'none' if key == FLOOR else key:>8} {comm:>8} {cells}  {speedup:>17}")
    lines.append("'none' = no simulated link: the compute floor. comm ms = bytes per step / bandwidth (serial).")
    return "\n".join(lines)


def write_plot(path: str, result: Dict[str, Any]) -> Optional[str]:
    """Step time against bandwidth per variant, the floor as dashed lines; ``None`` or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    runs = result["runs"]
    keys = [k for k in runs if k != FLOOR]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in result["variants"]:
        line = ax.plot([float(k) for k in keys], [runs[k][name]["median_step_ms"] for k in keys], "o-", label=name)
        ax.axhline(runs[FLOOR][name]["median_step_ms"], linestyle="--", linewidth=0.8, color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("simulated link bandwidth (GB/s)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("overlap: step time vs bandwidth (dashed: no link)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _suffixed(path: str, default_ext: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}_{SCENARIO}{ext or default_ext}"


def run(argv: Sequence[str]) -> int:
    """Parse the shared options, run every bandwidth in one world, print the table, write the JSON and plot."""
    cfg = parse_args(list(argv))
    device = "cuda" if cfg.device == "cuda" else "cpu"
    print(f"\n[{SCENARIO}] world size {cfg.world_size}, bandwidths {list(cfg.overlap_gbps)} GB/s", flush=True)
    result = run_function(_rank_body, cfg.world_size, cfg, device=device, timeout=cfg.timeout)[0]
    try:
        result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        result["load_average"] = None
    print("\n" + format_table(result, cfg))
    if cfg.out:
        path = _suffixed(cfg.out, ".json")
        with open(path, "w") as f:
            json.dump({"config": vars(cfg), **result}, f, indent=1, default=str)
        print(f"JSON: {os.path.abspath(path)}")
    if cfg.plot:
        path = _suffixed(cfg.plot, ".png")
        skipped = write_plot(path, result)
        print(f"plot: {skipped}" if skipped else f"plot: {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
