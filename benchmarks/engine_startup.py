#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How long the test engine takes to start a world, run one all_reduce and tear the world down.

Run ``python benchmarks/engine_startup.py`` (options: ``--world-size``, ``--repeats``). It prints the
median, min and max wall time of ``run_distributed`` over the repeats (after one warm-up world that is
not counted) and writes nothing else. Nothing asserts on these numbers; they are for people.
"""

import argparse
import statistics
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from fairscale.fair_dev.testing import run_distributed


def _one_all_reduce(rank: int, world_size: int) -> float:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def _time_worlds(world_size: int, repeats: int) -> List[float]:
    expected = float(sum(range(world_size)))
    run_distributed(_one_all_reduce, world_size)  # warm-up: first-use costs of the parent process
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = run_distributed(_one_all_reduce, world_size)
        times.append(time.perf_counter() - start)
        if results != [expected] * world_size:
            raise RuntimeError(f"all_reduce gave {results}, expected {expected} on every rank")
    return times


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks per world (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed worlds (default 7)")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.repeats < 1:
        parser.error("--world-size and --repeats must be at least 1")
    times = _time_worlds(args.world_size, args.repeats)
    print(
        f"engine startup, {args.world_size}-rank world + one all_reduce (gloo, CPU): "
        f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, "
        f"max {max(times) * 1e3:.1f} ms over {args.repeats} worlds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
