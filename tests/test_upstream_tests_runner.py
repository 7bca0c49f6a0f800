# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""tools/upstream_tests/run.sh, on a small stand-in for an upstream checkout (docs/maintaining.rst).

The stand-in has what matters about the real one: a ``fairscale/`` of its own at the root (which must not shadow
this checkout), a ``tests/`` package with a conftest, and tests that pass, skip, xfail, and fail either for a known
environment limit or for real.
"""

import os
import subprocess
import sys
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "tools", "upstream_tests", "run.sh")

# One test of each outcome; the failing one fails the way pytest>=8 fails upstream's pytest.warns(None) tests.
KNOWN_OUTCOMES = """
import pytest

from fairscale.nn.pipe import Pipe  # upstream's own fairscale/ raises on import: this must be the checkout's


def test_passes():
    assert Pipe.__module__.startswith("fairscale.")


def test_skips():
    pytest.skip("cuda required")


@pytest.mark.xfail(strict=True)
def test_xfails():
    assert False


def test_fails_for_the_environment():
    raise TypeError("exceptions must be derived from Warning, not <class 'NoneType'>")
"""

REAL_FAILURE = """
def test_fails_for_real():
    assert 1 == 2, "a real incompatibility"
"""


def _write(root: Any, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(str(root), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def _run(upstream: Any, *targets: str) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ, PYTHON=sys.executable, UPSTREAM_TESTS_TIMEOUT="300")
    return subprocess.run(
        ["bash", RUN_SH, str(upstream), *targets], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )


def _row(stdout: str, path: str) -> list:
    rows = [line.split() for line in stdout.splitlines() if line.startswith(path + " ")]
    assert len(rows) == 1, stdout
    return [int(n) for n in rows[0][1:]]


def test_counts_per_file_and_explains_environment_failures(tmp_path: Any) -> None:
    _write(
        tmp_path,
        {
            "fairscale/__init__.py": "raise ImportError('upstream checkout shadowed the fairscale under test')\n",
            "tests/__init__.py": "",
            "tests/conftest.py": "",
            "tests/nn/pipe/test_outcomes.py": KNOWN_OUTCOMES,
        },
    )
    result = _run(tmp_path, "tests/nn/pipe")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fairscale under test: " + os.path.join(ROOT, "fairscale") in result.stdout
    # passed, failed, skipped, xfailed
    assert _row(result.stdout, "tests/nn/pipe/test_outcomes.py") == [1, 1, 1, 1]
    assert "pytest>=8 removed pytest.warns(None)" in result.stdout
    assert "FAILED:" not in result.stdout


def test_real_failures_and_missing_targets_fail_the_run(tmp_path: Any) -> None:
    _write(tmp_path, {"tests/__init__.py": "", "tests/nn/pipe/test_real.py": REAL_FAILURE})
    result = _run(tmp_path, "tests/nn/pipe", "tests/experimental/nn/not_there")
    assert result.returncode == 1, result.stdout + result.stderr
    assert _row(result.stdout, "tests/nn/pipe/test_real.py") == [0, 1, 0, 0]
    assert "FAILED:" in result.stdout and "a real incompatibility" in result.stdout
    assert "TARGET NOT RUN: tests/experimental/nn/not_there missing" in result.stdout


def test_refuses_a_path_without_tests(tmp_path: Any) -> None:
    result = _run(tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr
