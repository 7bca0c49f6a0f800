# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``benchmarks/unit_profile.py`` (kernel launches and CPU time per unit, obc off/on, prefetch off/on) on a tiny model.

Run as a user runs it, in its own process (it makes a default process group): every variant is measured, the JSON
holds the figures the docs report, and the 1-rank window proves the flag on and off give bitwise-equal gradients
while the flag-on backward runs no concatenation (the flag-off one runs one per flat parameter).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--batch", "2"]


def test_unit_profile_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "unit_profile.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, str(ROOT / "benchmarks" / "unit_profile.py"), *TINY, "--accum-microbatches", "3"]
    proc = subprocess.run(
        [*args, "--steps", "2", "--warmup", "1", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["errors"] == {} and doc["device"] == "cpu"
    labels = [(r["part"], r["label"]) for r in doc["rows"]] + [tuple(k.split("/", 1)) for k in doc["skipped"]]
    assert sorted(labels) == sorted(
        [("obc", "fairscale obc off"), ("obc", "fairscale obc on"), ("obc", "fsdp2")]
        + [("prefetch", "fairscale prefetch off"), ("prefetch", "fairscale prefetch on"), ("prefetch", "fsdp2")]
    )
    for row in doc["rows"]:
        assert row["wall_ms"] > 0 and row["cpu_us_per_unit"] > 0 and len(row["wall_ms_all"]) == 2
        assert row["units"] == 3  # two blocks + the root
        assert row["kernel_launches"] == 0 and row["peak_bytes"] is None  # CPU: no launches, no device allocator
        assert row["microbatches"] == (3 if row["part"] == "obc" else 1)
    exact = doc["bitwise"]
    assert exact["bitwise_equal"] and exact["control_equal"] and exact["gradients"] > 0
    assert exact["cat_ops_off"] == 3 and exact["cat_ops_on"] == 0  # one per flat parameter without the flag
    assert "obc on" in proc.stdout and "bitwise equal: True" in proc.stdout


def test_unit_profile_refuses_bad_options() -> None:
    script = str(ROOT / "benchmarks" / "unit_profile.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for bad, says in (
        (["--heads", "3"], "--heads (3) must divide --hidden (128)"),
        (["--world-size", "1"], "--world-size must be >= 2"),
        (["--steps", "0"], "--steps and --warmup must be >= 1"),
    ):
        proc = subprocess.run([sys.executable, script, *bad], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr, (bad, proc.stderr)
