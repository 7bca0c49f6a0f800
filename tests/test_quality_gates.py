# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Quality gates that run with the test suite: formatting, typing and the two choke points.

Only ``fairscale/internal/device.py`` may touch ``torch.cuda`` and only the package ``fairscale/internal/collectives/``
may call ``torch.distributed`` collectives; everything else goes through those layers so that the CPU build works and
the collective counter sees every byte.
"""

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tokenize

import pytest

from fairscale.internal import torch_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fairscale")

CUDA_OWNER = os.path.join("fairscale", "internal", "device.py")
# A package: every file under this directory (the trailing separator keeps e.g. collectives_extra.py outside).
COLLECTIVES_OWNER = os.path.join("fairscale", "internal", "collectives") + os.sep
# Testing helpers may start worlds and sanity-check them directly.
EXEMPT_DIRS = (os.path.join("fairscale", "fair_dev") + os.sep,)

CUDA_PATTERN = re.compile(r"\btorch\.cuda\b|\bcuda\.(Stream|Event|synchronize|current_stream)\b")
COLLECTIVE_PATTERN = re.compile(
    r"\b(dist|distributed|torch\.distributed)\.(all_gather\w*|reduce_scatter\w*|all_reduce\w*|broadcast\w*|"
    r"_all_gather_base|_reduce_scatter_base|barrier|gather\w*|scatter\w*|all_to_all\w*|send|recv|isend|irecv)\("
)


def _python_files():
    for dirpath, _, filenames in os.walk(PACKAGE):
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, ROOT), path


# Python 3.12 tokenizes an f-string into pieces (PEP 701): its literal text comes as FSTRING_MIDDLE tokens (3.14 adds
# template strings, TSTRING_MIDDLE); the expressions in its braces stay code.
_PROSE_TOKENS = {tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE} | {
    getattr(tokenize, name) for name in ("FSTRING_MIDDLE", "TSTRING_MIDDLE") if hasattr(tokenize, name)
}


def _code_lines(path):
    """Each line's code with strings, docstrings and comments removed (so prose may name torch.cuda)."""
    lines = {}
    with open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type in _PROSE_TOKENS:
                continue
            lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: "".join(parts) for n, parts in lines.items()}


def _is_owner(rel, owner):
    """Whether the file ``rel`` belongs to ``owner``: that file, or anywhere under it when it is a directory."""
    return rel.startswith(owner) if owner.endswith(os.sep) else rel == owner


def _offenders(pattern, owner):
    found = []
    for rel, path in _python_files():
        if _is_owner(rel, owner) or rel.startswith(EXEMPT_DIRS):
            continue
        for lineno, code in sorted(_code_lines(path).items()):
            if pattern.search(code):
                found.append(f"{rel}:{lineno}: {code}")
    return found


def test_torch_cuda_only_in_device_layer():
    offenders = _offenders(CUDA_PATTERN, CUDA_OWNER)
    assert not offenders, "torch.cuda/stream use outside fairscale/internal/device.py:\n" + "\n".join(offenders)


def test_collectives_only_in_collectives_layer():
    offenders = _offenders(COLLECTIVE_PATTERN, COLLECTIVES_OWNER)
    assert not offenders, "torch.distributed collectives outside fairscale/internal/collectives/:\n" + "\n".join(
        offenders
    )


def test_collectives_owner_is_the_package_only():
    """The exemption covers the collectives package and nothing beside it (so the gate above still bites)."""
    assert os.path.isdir(os.path.join(ROOT, COLLECTIVES_OWNER))
    inside = os.path.join("fairscale", "internal", "collectives", "flat.py")
    assert _is_owner(inside, COLLECTIVES_OWNER)
    for outside in (
        os.path.join("fairscale", "internal", "collectives_extra.py"),
        os.path.join("fairscale", "internal", "parallel.py"),
        os.path.join("fairscale", "nn", "collectives", "x.py"),
    ):
        assert not _is_owner(outside, COLLECTIVES_OWNER), outside
    assert _is_owner(CUDA_OWNER, CUDA_OWNER) and not _is_owner(CUDA_OWNER + "x", CUDA_OWNER)
    offending = {"dist.all_reduce(t)", "torch.distributed.send(t, 1)", "dist.barrier()"}
    assert all(COLLECTIVE_PATTERN.search(code) for code in offending)


def test_code_lines_skip_prose(tmp_path):
    """Strings, f-strings' literal text (separate tokens since Python 3.12) and comments are prose; an f-string's
    expressions are code."""
    source = tmp_path / "sample.py"
    source.write_text(
        "x = 1  # torch.cuda in a comment\n"
        "s = 'torch.cuda in a string'\n"
        'f = f"""torch.cuda in an f-string {x}\n'
        'torch.cuda on its second line"""\n'
        "g = f'{torch.cuda.is_available()}'\n"
    )
    offending = {n: code for n, code in _code_lines(str(source)).items() if CUDA_PATTERN.search(code)}
    # Before 3.12 an f-string is one STRING token, expressions included: the gate cannot see code inside one there.
    assert list(offending) == ([5] if sys.version_info >= (3, 12) else []), offending


def _narrows_optional(test: ast.expr) -> bool:
    """``x is not None`` (or an ``and`` of such): an assert that only tells mypy an internal Optional is set."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return all(_narrows_optional(v) for v in test.values)
    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _debug_only_code(source: str, rel: str) -> list:
    """The statements of ``source`` that ``python -O`` removes or changes: asserts other than bare Optional
    narrowings (a message means somebody is meant to read it), and any use of ``__debug__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert) and not (_narrows_optional(node.test) and node.msg is None):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id == "__debug__":
            found.append(f"{rel}:{node.lineno}: __debug__")
    return found


def test_package_code_behaves_the_same_under_python_dash_o():
    """``python -O`` strips ``assert``: in package code an assert may only narrow an internal Optional for mypy
    (``assert x is not None``); every check of user input, state or an invariant is an explicit raise. With this, a
    whole-suite rerun under -O cannot find a check that vanishes: CI (.ci/run) reruns under -O only the tests of
    errors, and per-area tests start -O subprocesses of their own."""
    found = []
    for rel, path in _python_files():
        with open(path) as f:
            found += _debug_only_code(f.read(), rel)
    assert not found, "raise explicitly instead (python -O strips these):\n" + "\n".join(found)


def test_debug_only_code_finds_what_dash_o_strips():
    """The gate above accepts bare Optional narrowings only."""
    assert _debug_only_code("assert a is not None\nassert a is not None and b.c is not None\n", "f") == []
    src = "assert x\nassert x is not None, 'msg'\nassert x is None\nassert a is not None or b\nif __debug__: pass\n"
    assert [line.split(":")[1] for line in _debug_only_code(src, "f")] == ["1", "2", "3", "4", "5"]


def _missing(module: str) -> bool:
    # The gates run `sys.executable -m TOOL`: what counts is whether this interpreter can import the tool, not whether
    # a `TOOL` command is on PATH (a venv's python run without activating the venv has no PATH entry, and the gates
    # were skipped with the tools installed). In CI a missing tool fails the gate instead of skipping it.
    return importlib.util.find_spec(module) is None and not os.environ.get("CI")


def _pinned(tool: str) -> str:
    """The version of ``tool`` that requirements-dev.txt pins (``tool==X``, with or without an environment marker)."""
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        for line in f:
            match = re.match(rf"{re.escape(tool)}==([^\s;#]+)", line.strip())
            if match:
                return match.group(1)
    raise AssertionError(f"requirements-dev.txt pins no version of {tool}")


def _other_version(tool: str) -> str:
    """Why this interpreter's ``tool`` cannot judge the checkout ('' when it is the pinned release, or in CI).

    The format and the type errors are those of the pinned releases: another black lays out some lines differently (its
    stable style changes every year) and another mypy finds other errors, so neither can say the checkout is wrong. The
    pins carry ``python_version >= "3.10"`` (the releases need it); on 3.9 the tools are absent and the gates skip
    (in CI, which runs 3.11, a missing tool fails the gate).
    """
    try:
        installed = importlib.metadata.version(tool)
    except importlib.metadata.PackageNotFoundError:  # importable without metadata, or (in CI) not installed at all
        installed = "(no release metadata)"
    pinned = _pinned(tool)
    if installed == pinned or os.environ.get("CI"):
        return ""
    return f"{tool} {installed} is installed; the checkout is kept to {tool} {pinned} (requirements-dev.txt)"


def _run(cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_gate_tools_are_pinned():
    """black and mypy are pinned to one release each (a range would let next year's black fail an unchanged checkout)."""
    for tool in ("black", "mypy"):
        assert re.fullmatch(r"\d+(\.\d+)+", _pinned(tool)), tool
    with pytest.raises(AssertionError, match="pins no version of pytest"):
        _pinned("pytest")


@pytest.mark.skipif(_missing("black"), reason="black not installed for this interpreter")
def test_black_formatting():
    if _other_version("black"):
        pytest.skip(_other_version("black"))
    result = _run([sys.executable, "-m", "black", "--check", "-l", "120", "fairscale", "tests", "benchmarks"])
    assert result.returncode == 0, "black would reformat files (run `black fairscale tests benchmarks`):\n" + (
        result.stdout + result.stderr
    )


# pyproject's strict settings hold for the FSDP benchmark's package too: in the same run it costs about a second.
MYPY_TARGETS = ("fairscale", os.path.join("benchmarks", "_fsdp_bench"), os.path.join("benchmarks", "unit_profile.py"))


@pytest.mark.skipif(_missing("mypy"), reason="mypy not installed for this interpreter")
@pytest.mark.skipif(
    torch_version() < (2, 13, 0),
    reason="strict mypy follows the type stubs of torch >= 2.13 (CI's release); older stubs lack or mistype names",
)
def test_mypy_strict_on_package():
    if _other_version("mypy"):
        pytest.skip(_other_version("mypy"))
    result = _run([sys.executable, "-m", "mypy", *MYPY_TARGETS])
    assert result.returncode == 0, "mypy found type errors:\n" + result.stdout[-6000:] + result.stderr[-2000:]
