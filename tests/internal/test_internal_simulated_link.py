# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The opt-in simulated link of the collectives layer, on a real 2-rank gloo world."""

import time
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives, simulated_link

NUMEL = 2**20  # fp32: a 4 MiB gathered output on 2 ranks (2 MiB per rank)
GBPS = 0.02  # 4 MiB / 0.02 GB/s = 0.21 s


def _timed_gather(async_op: bool, group: object = None) -> Dict[str, float]:
    ws = collectives.group_size(group)  # type: ignore[arg-type]
    out = torch.empty(NUMEL)
    inp = torch.full((NUMEL // ws,), float(dist.get_rank()))
    collectives.barrier()
    wall, cpu = time.monotonic(), time.process_time()
    handle = collectives.all_gather_into_flat(out, inp, group, async_op=async_op)  # type: ignore[arg-type]
    pending = handle is not None and not handle.is_completed()
    if handle is not None:
        handle.wait()
    result = {"wall": time.monotonic() - wall, "cpu": time.process_time() - cpu, "pending": float(pending)}
    assert torch.equal(out.view(ws, -1)[:, 0], torch.arange(ws, dtype=torch.float32))  # the data still arrives
    return result


def _link_body(rank: int, world_size: int) -> Dict[str, Dict[str, float]]:
    assert simulated_link.link_for(None) is None  # never on by default
    out = {"off": _timed_gather(False)}
    zero2 = dist.new_group([0, 1])
    with simulated_link.simulated_link(GBPS, latency_us=1000.0):
        out["sync"] = _timed_gather(False)
        out["async"] = _timed_gather(True)
        # A group's own link wins over the all-groups one: 10x faster (an intra-node zero2 group).
        simulated_link.set_simulated_link(10 * GBPS, group=zero2)
        out["zero2"] = _timed_gather(False, zero2)
    assert simulated_link.link_for(None) is None and simulated_link.link_for(zero2) is None
    with pytest.raises(ValueError, match="bandwidth_gbps must be > 0"):
        simulated_link.set_simulated_link(0.0)
    return out


def test_simulated_link_delays_without_cpu() -> None:
    nbytes = NUMEL * 4
    expected = 1e-3 + nbytes / (GBPS * 1e9)
    for result in run_distributed(_link_body, 2, timeout=60.0):
        assert result["off"]["wall"] < expected / 2
        for name in ("sync", "async"):
            wall, cpu = result[name]["wall"], result[name]["cpu"]
            assert expected <= wall < expected + 1.0, (name, wall)
            assert cpu < 0.5 * expected, (name, cpu)  # slept, did not spin
        assert result["async"]["pending"] == 1.0  # the handle completes late, not the issuing call
        zero2 = result["zero2"]["wall"]
        assert nbytes / (10 * GBPS * 1e9) <= zero2 < expected / 2, zero2
