#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Does prefetch hide communication? Step time of a 4-unit FSDP model on a simulated link, prefetch off and on.

Both the link (``fairscale.internal.simulated_link``) and the compute (each unit sleeps ``--compute-ms`` in its
forward and again in its backward) are simulated with sleeps, so the result does not depend on the load of the
machine: with 2 CPU ranks it shows what the overlap is worth when communication per unit is comparable to compute per
unit. Run ``python benchmarks/overlap.py`` (about a minute); see docs/overlap.rst.
"""

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import simulated_link  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # noqa: E402

DIM = 1024  # one unit: a 1024x1024 linear, 4.2 MB of fp32 parameters
UNITS = 4
MODES: List[Tuple[str, bool, bool]] = [
    ("prefetch off", False, False),
    ("backward prefetch (default)", False, True),
    ("forward + backward prefetch", True, True),
]


class _Sleep(torch.autograd.Function):
    """Simulated compute: sleeps in forward and in backward (no CPU, so machine load does not matter)."""

    seconds = 0.0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(_Sleep.seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(_Sleep.seconds)
        return grad


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(self.lin(x))


def _step_ms(gbps: float, latency_us: float, forward: bool, backward: bool, steps: int) -> float:
    torch.manual_seed(0)
    units = [FSDP(Unit(), forward_prefetch=forward, backward_prefetch=backward) for _ in range(UNITS)]
    model = FSDP(nn.Sequential(*units), forward_prefetch=forward, backward_prefetch=backward)
    x = torch.randn(4, DIM)
    times = []
    for step in range(steps + 2):  # the first step records the unit order, the second warms up
        if step == 1 and gbps > 0:
            simulated_link.set_simulated_link(gbps, latency_us)
        start = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - start)
    simulated_link.clear_simulated_link()
    measured = sorted(times[2:])
    return 1000 * measured[len(measured) // 2]


def _body(rank: int, world_size: int, cfg: Dict[str, Any]) -> Dict[str, float]:
    torch.set_num_threads(1)
    _Sleep.seconds = cfg["compute_ms"] / 1000
    out: Dict[str, float] = {}
    for gbps in cfg["link_gbps"] + [0.0]:
        for name, forward, backward in MODES if gbps > 0 else MODES[:1]:
            out[f"{gbps}|{name}"] = _step_ms(gbps, cfg["link_latency_us"], forward, backward, cfg["steps"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[0.1, 0.2, 0.8], help="link bandwidths, GB/s")
    parser.add_argument("--link-latency-us", type=float, default=50.0, help="per-collective latency, microseconds")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute per unit and pass")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration (median reported)")
    args = parser.parse_args()
    cfg = {k: getattr(args, k) for k in ("link_gbps", "link_latency_us", "compute_ms", "steps")}
    result = run_function(_body, 2, cfg, timeout=900)[0]
    floor = result["0.0|prefetch off"]
    print(f"2 ranks, {UNITS} units of {DIM * DIM * 4 / 1e6:.1f} MB, {args.compute_ms:g} ms compute per unit and pass")
    print(f"no communication delay (floor): {floor:.0f} ms per step")
    print(f"{'GB/s':>6} {'ms per gather':>14} " + " ".join(f"{name:>28}" for name, _, _ in MODES) + "  speed-up")
    for gbps in args.link_gbps:
        row = [result[f"{gbps}|{name}"] for name, _, _ in MODES]
        gather_ms = (DIM * DIM + DIM) * 4 / (gbps * 1e9) * 1000 + args.link_latency_us / 1000
        cells = " ".join(f"{ms:>28.0f}" for ms in row)
        print(f"{gbps:>6g} {gather_ms:>14.1f} {cells}  {row[0] / row[-1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
