# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``benchmarks/dcp_scenario.py`` (DCP save/load, fairscale against FSDP2) runs on a tiny model and reports sane
numbers: both peers save and load, the state dicts hold this rank's shards, neither peer exchanges values (fairscale's
save hands DCP views of its shards, its load copies what DCP read locally), and the table and JSON fields are
there."""

import json
import os
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from fairscale.fair_dev.testing.engine import run_distributed  # noqa: E402

try:
    import torch.distributed.fsdp  # noqa: F401
    from dcp_scenario import _rank_body, format_table, parse_args, split_scenario, summarize  # noqa: E402
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:  # pragma: no cover - torch without FSDP2
    _rank_body = None

pytestmark = pytest.mark.skipif(_rank_body is None, reason="needs torch with FSDP2 (fully_shard)")
if _rank_body is not None:
    from _fsdp_bench.peers import fsdp2_cpu_problem  # noqa: E402


TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "64", "--repeats", "1"]
TINY += ["--memory-passes", "1"]


def test_options() -> None:
    assert split_scenario(["--scenario", "dcp", "--layers", "2"]) == (None, ["--layers", "2"])
    assert split_scenario(["--steps", "3"]) == (["--steps", "3"], None)
    cfg = parse_args(TINY + ["--steps", "3"])  # the main job's other options are accepted
    assert (cfg.layers, cfg.hidden, cfg.repeats) == (2, 16, 1)
    for bad in (["--repeats", "0"], ["--hidden", "10", "--heads", "3"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_tiny_run(tmp_path: Any) -> None:
    if fsdp2_cpu_problem() is not None:
        pytest.skip(str(fsdp2_cpu_problem()))
    cfg = parse_args(TINY)
    per_rank = run_distributed(_rank_body, 2, cfg, str(tmp_path))
    result = summarize(per_rank, cfg)
    fs, f2 = result["peers"]["fairscale"], result["peers"]["fsdp2"]
    for peer in (fs, f2):
        assert peer["save_s"] > 0 and peer["load_s"] > 0 and peer["save_cpu_s"] > 0
        # The DCP state dicts hold exactly this rank's parameters and optimizer state (the same for both peers).
        assert peer["state_dict_mb"] == pytest.approx(fs["state_dict_mb"], rel=0.05)
    assert fs["state_dict_mb"] == pytest.approx(fs["shards_mb"], rel=0.05)
    assert fs["exchange_buffers_mb"] == 0 and f2["exchange_buffers_mb"] == 0
    table = format_table(result, cfg)
    assert "fairscale" in table and "fsdp2" in table and "largest exchange" in table
    json.dumps(result)
