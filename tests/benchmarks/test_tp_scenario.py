# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``tp`` scenario of the main job (``benchmarks/tp_scenario.py``): command-line split and a tiny run.

No timing assertions: the run checks that fairscale's and PyTorch's tensor parallelism train identically from the
same weights, and that fairscale's model-parallel traffic is exactly the formula's.
"""

import os
import sys

import pytest
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank

# DTensor's import costs seconds: once here, not per rank; the scenario compares with its peers.
pytest.importorskip(
    "torch.distributed.tensor.debug", reason="this torch has no public torch.distributed.tensor (DTensor)"
)
pytest.importorskip("torch.distributed.tensor.parallel")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.config import parse_args  # noqa: E402
from tp_scenario import VARIANTS, _rank_body, check_config, formula_bytes, split_scenario, summarize  # noqa: E402

from fairscale.fair_dev.testing import run_distributed  # noqa: E402

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--batch", "2"]


def test_split_scenario() -> None:
    assert split_scenario(["--steps", "3"]) == (["--steps", "3"], None)
    assert split_scenario(["--scenario", "tp", "--steps", "3"]) == (None, ["--steps", "3"])
    assert split_scenario(["--scenario", "train", "tp"]) == (["--scenario", "train"], [])


def test_bad_world_size() -> None:
    with pytest.raises(SystemExit, match="multiple of 2"):
        check_config(parse_args(TINY + ["--world-size", "3"]))


def test_tiny_run() -> None:
    cfg = parse_args(TINY + ["--steps", "2", "--warmup", "0", "--world-size", "2"])
    rows = summarize(run_distributed(_rank_body, 2, cfg)[0], cfg)
    assert list(rows) == list(VARIANTS)
    assert rows["fairscale"]["max_loss_diff_vs_torch"] < 1e-5
    assert rows["fairscale"]["tp_all_reduces"] == 6 * cfg.layers
    assert rows["fairscale"]["tp_mb"] * 2**20 == formula_bytes(cfg)
    assert rows["torch"]["tp_all_reduces"] > 0
