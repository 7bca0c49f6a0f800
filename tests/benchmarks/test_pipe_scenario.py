# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``pipe`` scenario of the main job (``benchmarks/pipe_scenario.py``): command-line split and a tiny run.

No timing assertions: the run checks that Pipe, AsyncPipe and torch.distributed.pipelining train identically from
the same weights and that every number of the table is produced.
"""

import os
import sys

import pytest

# Imported once here, not once per forked rank; the scenario compares with it.
pytest.importorskip("torch.distributed.pipelining", reason="this torch has no torch.distributed.pipelining")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.config import parse_args  # noqa: E402
from pipe_scenario import CHUNKS_ENV, VARIANTS, _rank_body, format_table, split_scenario, summarize  # noqa: E402

from fairscale.fair_dev.testing import run_distributed  # noqa: E402

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--batch", "4"]


def test_split_scenario() -> None:
    assert split_scenario(["--steps", "3"]) == (["--steps", "3"], None)
    assert split_scenario(["--scenario", "pipe", "--steps", "3"]) == (None, ["--steps", "3"])
    assert split_scenario(["--scenario", "train", "pipe"]) == (["--scenario", "train"], [])


def test_tiny_run(monkeypatch) -> None:
    monkeypatch.setenv(CHUNKS_ENV, "2")
    cfg = parse_args(TINY + ["--steps", "2", "--warmup", "0"])
    rows = summarize(run_distributed(_rank_body, 2, cfg)[0])
    assert list(rows) == list(VARIANTS)
    for row in rows.values():
        assert row["max_loss_diff_vs_torch"] < 1e-5 and len(row["losses"]) == 2
        assert 0.0 <= row["bubble_stage0"] <= 1.0 and 0.0 <= row["bubble_stage1"] <= 1.0
    assert "AsyncPipe" in format_table(rows)
