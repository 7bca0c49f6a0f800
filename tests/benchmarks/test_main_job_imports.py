# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The main job runs with the ``benchmarks`` extra alone: it never imports pytest or the test engine.

A fresh interpreter in which ``import pytest`` and ``import fairscale.fair_dev`` fail (as on a machine where only
``pip install -e ".[benchmarks]"`` ran) imports ``benchmarks/fsdp.py`` and every scenario module it can run, and
runs ``--help``. (CI also runs the README's first command in a new empty venv; this test says which import broke.)
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")

_BLOCKED = textwrap.dedent("""
    import importlib.abc, runpy, sys

    BLOCKED = ("pytest", "_pytest", "fairscale.fair_dev")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: the benchmarks extra has no pytest)")
            return None

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, BENCH)
    import fsdp, oss_scenario, tp_scenario, pipe_scenario, overlap_scenario, overlap, collectives_overhead  # noqa
    import _fsdp_bench.worlds, _fsdp_bench.launch, _fsdp_bench.runner, _fsdp_bench.main
    leaked = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
    assert not leaked, leaked
    sys.argv = ["fsdp.py", "--help"]
    runpy.run_path(SCRIPT, run_name="__main__")
    """)


def test_main_job_needs_neither_pytest_nor_the_test_engine() -> None:
    code = f"BENCH = {BENCH_DIR!r}\nSCRIPT = {os.path.join(BENCH_DIR, 'fsdp.py')!r}\n" + _BLOCKED
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    # --help exits 0 through SystemExit inside run_path.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--scenario" in proc.stdout
