# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``overlap`` scenario of the main job (``benchmarks/overlap_scenario.py``) and its simulated link.

A tiny run on a link slow enough that each step's collectives take a known minimum time: every variant (fairscale
through its collectives layer's link, FSDP2 through the benchmark's c10d link mode) must take at least that long,
which fails if either delay is missing; without a link they are faster. Prefetch must not change the losses.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.config import parse_args  # noqa: E402
from overlap_scenario import FLOOR, _rank_body, bytes_per_step, format_table, split_scenario  # noqa: E402

from fairscale.fair_dev.testing import run_distributed  # noqa: E402

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--batch", "2"]


def test_split_scenario() -> None:
    assert split_scenario(["--steps", "3"]) == (["--steps", "3"], None)
    assert split_scenario(["--scenario", "overlap", "--link-gbps", "1"]) == (None, ["--link-gbps", "1"])
    assert split_scenario(["--scenario", "train,overlap"]) == (["--scenario", "train"], [])


def test_link_options_are_validated() -> None:
    cfg = parse_args(["--link-gbps", "2", "--link-latency-us", "30", "--link-intra-gbps", "20"])
    assert (cfg.link_gbps, cfg.link_latency_us, cfg.link_intra_gbps) == (2.0, 30.0, 20.0)
    assert parse_args([]).link_gbps is None  # off by default
    for bad in (
        ["--link-gbps", "0"],
        ["--link-intra-gbps", "5"],
        ["--overlap-gbps", "-1"],
        ["--link-latency-us", "-1"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_tiny_run() -> None:
    gbps = 0.001
    cfg = parse_args(TINY + ["--overlap-gbps", str(gbps), "--overlap-steps", "2", "--link-latency-us", "100"])
    result = run_distributed(_rank_body, 2, cfg)[0]
    names = result["variants"]
    assert names[:2] == ["fairscale no-prefetch", "fairscale prefetch"]
    slow, floor = result["runs"][f"{gbps:g}"], result["runs"][FLOOR]
    # One step moves bytes_per_step() on the link: fairscale's counter and the c10d link mode delay it all.
    minimum_ms = 1000 * bytes_per_step(cfg) / (gbps * 1e9)
    for name in names:
        # A lower bound only: load makes steps slower, never faster than the link allows. (Comparing the floor's
        # and the link's step times, two timings, failed on a loaded machine.)
        assert min(slow[name]["step_ms"]) >= 0.9 * minimum_ms, (name, slow[name], minimum_ms)
        assert floor[name]["median_step_ms"] > 0, name
    assert slow["fairscale no-prefetch"]["loss"] == slow["fairscale prefetch"]["loss"]
    if "fsdp2" in names:
        assert slow["fsdp2"]["loss"] == pytest.approx(slow["fairscale no-prefetch"]["loss"], rel=1e-4)
    assert "prefetch speed-up" in format_table(result, cfg)


def test_cluster_prediction_with_and_without_overlap() -> None:
    from _fsdp_bench.cluster import predict_step

    mb = 1_000_000
    # 4 units, 1 microbatch: 4 forward gathers, 4 backward gathers, 1 bucketed reduce-scatter (8 GB/s links below).
    summary = {
        "all_gather/forward/gs=4": {"count": 4, "bytes": 4 * mb},
        "all_gather/backward/gs=4": {"count": 4, "bytes": 4 * mb},
        "reduce_scatter/backward/gs=4": {"count": 1, "bytes": 4 * mb},
    }
    one_node = predict_step(summary, 1, 3e-3, 1, 8, 8.0, 1.0, zero2=False)
    link = 3 * 4 * mb * 7 / 8 / 8e9  # three transfers, ring over 8 ranks, intra-node
    assert one_node["units"] == 4 and one_node["no_overlap_s"] == pytest.approx(3e-3 + link)
    assert one_node["overlap_s"] < one_node["no_overlap_s"]
    # Compute-bound: overlap leaves compute plus one unit's worth of communication per phase.
    assert one_node["overlap_s"] == pytest.approx(3e-3 + link / 4)
    plain = predict_step(summary, 1, 3e-3, 4, 8, 8.0, 1.0, zero2=False)
    grouped = predict_step(summary, 1, 3e-3, 4, 8, 8.0, 1.0, zero2=True)
    assert grouped["communication_s"] < plain["communication_s"] and grouped["overlap_s"] < plain["overlap_s"]
    # Communication-bound across nodes: overlap is bounded below by the link.
    assert plain["overlap_s"] >= plain["communication_s"] * (2 / 3) and plain["overlap_s"] < plain["no_overlap_s"]
