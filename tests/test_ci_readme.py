# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""CI runs the README's set-up commands exactly as written, each in a new empty virtual environment.

``.ci/run`` reads the commands from README.md through ``.ci/readme_commands.py``; these tests pin that wiring, so
that the README and CI cannot drift apart (a README edit that breaks the parser fails here, not silently in CI).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI_RUN = os.path.join(ROOT, ".ci", "run")
PARSER = os.path.join(ROOT, ".ci", "readme_commands.py")


def _readme_command(n: str) -> str:
    proc = subprocess.run([sys.executable, PARSER, n], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_readme_has_the_two_setup_commands() -> None:
    assert _readme_command("--count") == "2"
    main_job, tests = _readme_command("1"), _readme_command("2")
    # Command 1 installs only the benchmarks extra and runs the main job; command 2 the dev extra and the tests.
    assert '".[benchmarks]"' in main_job and "dev" not in main_job and main_job.endswith("python benchmarks/fsdp.py")
    assert '".[dev]"' in tests and tests.endswith("python -m pytest")
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert main_job in readme and tests in readme


def test_ci_runs_both_readme_commands_in_new_venvs() -> None:
    with open(CI_RUN) as f:
        script = f.read()
    lines = [line.strip() for line in script.splitlines() if not line.strip().startswith("#")]
    assert "run_readme_command 1" in lines and "run_readme_command 2" in lines
    assert lines.index("run_readme_command 1") < lines.index("run_readme_command 2")  # the main job first
    assert any(".ci/readme_commands.py" in line for line in lines)
    assert any("-m venv" in line for line in lines)
    # Nothing installs the project outside those venvs.
    assert not any(line.startswith("pip install") for line in lines)


def test_parser_rejects_a_readme_without_the_block(tmp_path: object) -> None:
    sys.path.insert(0, os.path.dirname(PARSER))
    try:
        import readme_commands  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    good = "# T\n\n## Set-up\n\n```bash\n# 1. a\npip install x\n# 2. b\npython -m pytest\n```\n\n## Next\n"
    assert readme_commands.setup_commands(good) == ["pip install x", "python -m pytest"]
    for bad in ("# T\n## Other\n", "## Set-up\nno block\n## Next\n", "## Set-up\n```bash\n# 1. a\n```\n## Next\n"):
        try:
            readme_commands.setup_commands(bad)
        except SystemExit:
            continue
        raise AssertionError(f"accepted {bad!r}")
