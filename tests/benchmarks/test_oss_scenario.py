# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``oss`` scenario of the main job (``benchmarks/oss_scenario.py``): command-line split and a tiny run.

No timing assertions: the run checks that the four peers train identically (same losses), that OSS keeps about
``1 / world_size`` of DDP's optimizer state per rank, and that unbucketed ShardedDataParallel drops non-owned
gradients.
"""

import os
import sys

import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.config import parse_args  # noqa: E402
from oss_scenario import VARIANTS, _rank_body, split_scenario, summarize  # noqa: E402

from fairscale.fair_dev.testing import run_distributed  # noqa: E402

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--batch", "2"]


def test_split_scenario() -> None:
    assert split_scenario(["--steps", "3"]) == (["--steps", "3"], None)
    assert split_scenario(["--scenario", "train", "accum"]) == (["--scenario", "train", "accum"], None)
    assert split_scenario(["--scenario", "oss", "--steps", "3"]) == (None, ["--steps", "3"])
    assert split_scenario(["--steps", "3", "--scenario", "train", "oss"]) == (
        ["--steps", "3", "--scenario", "train"],
        ["--steps", "3"],
    )
    assert split_scenario(["--scenario", "oss,zero2"]) == (["--scenario", "zero2"], [])


def test_tiny_run() -> None:
    cfg = parse_args(TINY + ["--steps", "2", "--warmup", "0", "--world-size", "2"])
    rows = summarize(run_distributed(_rank_body, 2, cfg, timeout=300)[0])
    assert list(rows) == list(VARIANTS)
    for name, row in rows.items():
        assert row["max_loss_diff_vs_ddp"] < 1e-5, name
        if name != "ddp":
            assert 0.4 < row["state_vs_ddp"] < 0.6, (name, row["state_vs_ddp"])
    assert rows["oss+sdp,rbs=0"]["grad_mb_per_rank"] < 0.7 * rows["ddp"]["grad_mb_per_rank"]
