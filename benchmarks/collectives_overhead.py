#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What fairscale's collectives layer costs per call above the raw ``torch.distributed`` call it makes.

A 1-element all-reduce, ``--calls`` times per block, raw (``torch.distributed.all_reduce``) and through
``fairscale.internal.collectives`` (collective counter off, then on), at ``--world-size`` ranks on gloo; then the
same calls and FSDP's flat all-gather and reduce-scatter on a group of torch's "fake" backend, which runs torch's
whole call path without communicating, so that the difference is the layer's own cost whatever the other ranks do.
The latency scenario of the main job (``python benchmarks/fsdp.py --scenario latency``) runs the same measurement;
see docs/benchmarks.rst. Run ``python benchmarks/collectives_overhead.py`` (about 10 s on 2 cores).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.latency import collective_overhead  # noqa: E402
from _fsdp_bench.worlds import run_function  # noqa: E402


def _rank(rank: int, world_size: int, calls: int, repeats: int) -> Dict[str, Any]:
    return collective_overhead(calls, repeats)


def text(result: Dict[str, Any]) -> str:
    """The measurement as a short table (us per call)."""
    real, dispatch, over = result["real"], result["dispatch_only"], result["overhead_us"]
    lines = [
        f"1-element all_reduce at world size {result['world_size']}, {result['calls']} calls x {result['repeats']} "
        "blocks, median us per call:"
    ]
    for name in ("raw", "ours", "ours_counted", "raw_plus_10us"):
        lines.append(f"  {name:<13} wall {real[name]['wall_us'][1]:8.1f}   thread CPU {real[name]['cpu_us'][1]:7.1f}")
    lines.append(
        f"  layer - raw (counter off): wall {over['wall']:+.1f}, thread CPU {over['cpu']:+.1f} "
        "(raw_plus_10us: what 10 us more CPU per call costs on this machine)"
    )
    lines.append(f"dispatch only, us per call ({dispatch['method']}):")
    for kind, row in dispatch.items():
        if kind == "method":
            continue
        lines.append(
            f"  {kind:<15} raw {row['raw_us']:6.2f}   ours {row['ours_us']:6.2f}   counter on {row['ours_counted_us']:6.2f}"
            f"   layer - raw {row['overhead_us']:+6.2f}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks started on this machine")
    p.add_argument("--calls", type=int, default=1000, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=5, help="blocks per variant")
    p.add_argument("--out", default="", help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    results: List[Dict[str, Any]] = run_function(_rank, args.world_size, args.calls, args.repeats, timeout=600)
    print(text(results[0]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results[0], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
