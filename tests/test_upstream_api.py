# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""This checkout's public API against upstream fairscale 0.4.13's recorded surface (docs/maintaining.rst).

Every upstream module and public name must exist here with a compatible signature, unless the reviewed allow-list
``tools/upstream_api/allowlist.txt`` names the difference with a reason. The checkout is dumped in a subprocess
(importing every module of the package must not leak into the test process).
"""

import json
import os
import shlex
import subprocess
import sys
from typing import Any, Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tools/ is not installed with the package

from tools.upstream_api import compare as cmp  # noqa: E402
from tools.upstream_api import surface  # noqa: E402


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: Any) -> Dict[str, Any]:
    out = str(tmp_path_factory.mktemp("api") / "checkout.json")
    result = subprocess.run(
        [sys.executable, "-m", "tools.upstream_api", "dump", out], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def upstream() -> Dict[str, Any]:
    with open(cmp.SNAPSHOT) as f:
        return json.load(f)


def test_checkout_matches_upstream_api(checkout: Dict[str, Any], upstream: Dict[str, Any]) -> None:
    assert upstream["fairscale_version"] == "0.4.13"
    # (A module that does not import here is a "module-error" difference.)
    entries = cmp.read_allowlist()
    bad, _ = cmp.split_allowed(cmp.compare(upstream, checkout), entries)
    stale, pending = cmp.unused_entries(entries)
    if pending:  # subsystems being ported: informative only
        print("'not yet ported' allow-list entries that match nothing now (prune them):")
        print("\n".join(f"  {e}" for e in pending))
    text = cmp.report(bad, stale, upstream, os.path.relpath(cmp.ALLOWLIST, ROOT))
    assert not bad and not stale, "\n" + text


def test_allowlist_entries_have_reasons() -> None:
    entries = cmp.read_allowlist()  # raises on a line without a reason or with an unknown kind
    assert entries and all(len(e.reason) >= 10 for e in entries), [str(e) for e in entries if len(e.reason) < 10]


# ---------------------------------------------------------------------------------------------- the comparison rules

P = "POSITIONAL_OR_KEYWORD"


def _dump(names: Dict[str, Any]) -> Dict[str, Any]:
    return {"fairscale_version": "x", "modules": {"fairscale.m": {"names": names, "other": ["torch"]}}}


def _fn(*params: Any) -> Dict[str, Any]:
    return {"kind": "function", "signature": [list(p) for p in params]}


@pytest.mark.parametrize(
    "candidate, problem",
    [
        (_fn(("a", P), ("b", P, "1")), None),
        (_fn(("a", P), ("b", P, "1"), ("c", "KEYWORD_ONLY", "None"), ("kw", "VAR_KEYWORD")), None),
        (_fn(("a", P), ("b", P, "2")), "'b' defaults to 2, upstream 1"),
        (_fn(("a", P), ("x", P), ("b", P, "1")), "position 1 is 'x'"),
        (_fn(("a", P)), "parameter 'b' (position 1) is missing"),
        (_fn(("a", P), ("b", "KEYWORD_ONLY", "1")), "'b' is KEYWORD_ONLY"),
        (_fn(("a", P), ("b", P, "1"), ("c", P)), "added parameter 'c' has no default"),
    ],
)
def test_signature_rules(candidate: Dict[str, Any], problem: Any) -> None:
    reference = _dump({"f": _fn(("a", P), ("b", P, "1"))})
    diffs = cmp.compare(reference, _dump({"f": candidate}))
    if problem is None:
        assert diffs == []
    else:
        assert [d.key for d in diffs] == ["signature fairscale.m:f"] and problem in diffs[0].detail, diffs


def test_module_defaults_compare_by_name() -> None:
    # A module's repr names its file, which depends on the Python version and install (upstream's snapshot was taken
    # on 3.11; Python 3.12 then saw a difference in RemoteModuleTracer's `autowrap_modules=(math,)`).
    reference = _dump({"f": _fn(("m", P, "(<module 'math' from '/py3.11/math.cpython-311.so'>,)"))})
    assert cmp.compare(reference, _dump({"f": _fn(("m", P, "(<module 'math' from '/py3.12/m.so'>,)"))})) == []
    diffs = cmp.compare(reference, _dump({"f": _fn(("m", P, "(<module 'cmath' from '/py3.12/m.so'>,)"))}))
    assert len(diffs) == 1 and "'m' defaults to (<module 'cmath'>,), upstream (<module 'math'>,)" in diffs[0].detail
    assert surface._stable_repr((surface,)) == "(<module 'tools.upstream_api.surface'>,)"


def test_names_members_and_allowlist(tmp_path: Any) -> None:
    cls = {"kind": "class", "mro": [], "signature": [], "members": {"step": _fn(("self", P))}}
    reference = _dump({"f": _fn(), "C": cls, "E": {"kind": "enum", "enum_members": ["A", "B"]}, "torch": _fn()})
    reference["modules"]["fairscale.gone"] = {"names": {"g": _fn()}, "other": []}
    candidate = _dump({"C": dict(cls, members={}), "E": {"kind": "enum", "enum_members": ["A"]}})
    diffs = cmp.compare(reference, candidate)
    assert sorted(d.key for d in diffs) == [
        "enum-member fairscale.m:E",
        "missing-member fairscale.m:C.step",
        "missing-module fairscale.gone",
        "missing-name fairscale.m:f",
    ]  # "torch" is in the candidate's "other" names: present, from another library
    allow = tmp_path / "allow.txt"
    allow.write_text(
        "* fairscale.gone -- removed on purpose\n"
        "missing-member fairscale.m:C -- members of C\n"
        "## not yet ported\n"
        "* fairscale.later -- coming\n"
        "missing-name fairscale.unused:x -- stale\n"
    )
    entries = cmp.read_allowlist(str(allow))
    bad, ok = cmp.split_allowed(diffs, entries)
    assert sorted(d.key for d in bad) == ["enum-member fairscale.m:E", "missing-name fairscale.m:f"]
    assert len(ok) == 2
    stale, pending = cmp.unused_entries(entries)
    assert [e.pattern for e in stale] == [] and [e.pattern for e in pending] == [
        "fairscale.later",
        "fairscale.unused:x",
    ]
    text = cmp.report(bad, stale, reference, "allow.txt")
    assert "missing-name     fairscale.m:f" in text and "upstream: function ()" in text
    allow.write_text("missing-name fairscale.m:f\n")
    with pytest.raises(ValueError, match="expected '<kind> <target> -- <reason>'"):
        cmp.read_allowlist(str(allow))


def test_surface_of_a_module() -> None:
    """The dump records fairscale objects with their parameters and other libraries' objects by name only."""
    import fairscale.internal.containers as containers

    entry = surface.module_entry(containers)
    assert entry["names"]["unpack_kwargs"] == {
        "kind": "function",
        "signature": [["kwarg_keys", P], ["flat_args", P]],
    }
    assert "PackedSequence" in entry["other"] and "torch" in entry["other"]
    assert surface.signature_of(lambda a, *b, c=1, **d: None) == [
        ["a", P],
        ["b", "VAR_POSITIONAL"],
        ["c", "KEYWORD_ONLY", "1"],
        ["d", "VAR_KEYWORD"],
    ]


# ---------------------------------------------------------------------------------------------- docs/maintaining.rst


def _maintaining_blocks() -> List[str]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_docs_examples import blocks_of

    return [code for _, code in blocks_of("docs/maintaining.rst")]


def _lines(code: str) -> List[str]:
    return [line.strip() for line in code.splitlines() if line.strip()]


def _run(argv: List[str], cwd: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.skip_under_python_O
def test_maintaining_commands(tmp_path: Any) -> None:
    """The commands of docs/maintaining.rst, with this interpreter standing in for the throwaway environment."""
    venv, dump, compare_block, check, fixtures = _maintaining_blocks()
    # 1. A venv, and pip installing the release and wgit's optional dependencies, with the pins of this project.
    create, install = (shlex.split(line) for line in _lines(venv))
    assert create[:3] == ["python", "-m", "venv"] and install[0] == create[3] + "/bin/pip"
    assert install[1:] == ["install", "fairscale==0.4.13", "torch==2.13.0", "pygit2", "pgzip"]
    assert "torch==2.13.0" in open(os.path.join(ROOT, "README.md")).read()  # the set-up commands CI runs
    # 2. The dump from outside the checkout (here: of this checkout's installed package).
    cd, run = (shlex.split(part) for part in dump.split("&&"))
    assert cd == ["cd", "/tmp"] and run[0] == install[0].replace("/pip", "/python")
    script = run[1].replace("$REPO", ROOT)
    new = str(tmp_path / run[2])
    result = _run([sys.executable, script, new], cwd=str(tmp_path))
    assert result.returncode == 0 and "modules written to" in result.stdout, result.stdout + result.stderr
    # 3. The three comparison commands, run in the checkout.
    outputs = []
    for line in _lines(compare_block):
        argv = [a.replace("/tmp/", str(tmp_path) + "/") for a in shlex.split(line)]
        assert argv[:3] == ["python", "-m", "tools.upstream_api"]
        result = _run([sys.executable] + argv[1:], cwd=ROOT)
        assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: differences found
        outputs.append(result.stdout)
    assert "addition(s):" in outputs[0] and "difference(s)" in outputs[0]
    assert "modules written to" in outputs[1]
    assert ": 0 difference(s)" in outputs[2], outputs[2]  # both dumps are of this checkout
    # 6. The check: the CLI's verdict is this test module's (run here by test_checkout_matches_upstream_api).
    check_cli, pytest_cmd = (shlex.split(line) for line in _lines(check))
    assert check_cli == ["python", "-m", "tools.upstream_api", "check"]
    assert pytest_cmd == ["python", "-m", "pytest", os.path.relpath(__file__, ROOT)]
    result = _run([sys.executable] + check_cli[1:], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    # 5. The fixture script exists where the page says, and says how it was made.
    cd, run = (shlex.split(part) for part in fixtures.split("&&"))
    path = run[1].replace("$REPO", ROOT)
    assert cd == ["cd", "/tmp"] and os.path.isfile(path), path
    readme = os.path.join(os.path.dirname(path), "README.md")
    assert "make_fixtures.py" in open(readme).read()
