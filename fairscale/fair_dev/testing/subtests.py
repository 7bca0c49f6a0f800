# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Named sub-tests inside one test (usually one started world): :func:`run_cases` and :func:`subtest`.

Starting a world costs more than most cases in it, so option matrices run as cases of one world.
Both helpers name the failing case in the error; :func:`run_cases` also keeps going after a failure
so that one run lists every failing case. Re-exported by :mod:`fairscale.fair_dev.testing.engine`.
"""

import contextlib
import traceback
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

import pytest

from .engine_rank import rebuild_exception, user_frames

__all__ = ["run_cases", "subtest"]


def run_cases(cases: Iterable[Tuple[str, Callable[[], Any]]]) -> None:
    """Run every ``(name, case)`` in turn, then fail once, listing each failing case with its error.

    Meant for option matrices inside one started world (one world per case costs a start each).
    Every rank should run the same cases in the same order; a case that fails on one rank only can
    leave the others waiting in a collective, which the world's timeout then reports.

    Args:
        cases: pairs of a unique case name and a callable taking no arguments.

    Raises:
        AssertionError: one or more cases failed; the message names each with its error.
        ValueError: a case name is repeated.
        TypeError: an item is not a ``(str, callable)`` pair.
    """
    seen: Dict[str, None] = {}
    failures: List[str] = []
    skips: List[str] = []
    for item in cases:
        name, case = _check_case(item)
        if name in seen:
            raise ValueError(f"run_cases: case name {name!r} is used twice; give every case a unique name")
        seen[name] = None
        try:
            case()
        except pytest.skip.Exception as e:
            skips.append(f"{name}: {e}")
        except (Exception, pytest.fail.Exception) as e:
            failures.append(_describe_case_failure(name, e))
    if failures:
        lines = [f"{len(failures)} of {len(seen)} cases failed:"] + failures
        if skips:
            lines.append("skipped cases: " + "; ".join(skips))
        raise AssertionError("\n".join(lines))
    if seen and len(skips) == len(seen):
        pytest.skip("every case skipped: " + "; ".join(skips))


@contextlib.contextmanager
def subtest(name: str) -> Iterator[None]:
    """Prefix any exception raised in the block with ``[name]``, keeping its type and traceback.

    Args:
        name: the case name, e.g. ``"mixed_precision=True"``.
    """
    try:
        yield
    except pytest.skip.Exception:
        raise
    except (Exception, pytest.fail.Exception) as e:
        renamed = rebuild_exception(type(e), f"[{name}] {e}")
        if renamed is None:
            # The type cannot be rebuilt from a message; keep the object and attach the name as a note.
            add_note = getattr(e, "add_note", None)
            if add_note is not None:
                add_note(f"in subtest [{name}]")
            raise
        raise renamed.with_traceback(e.__traceback__) from e.__cause__


def _check_case(item: Any) -> Tuple[str, Callable[[], Any]]:
    if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) or not callable(item[1]):
        raise TypeError(f"run_cases expects (name, callable) pairs, got {item!r}")
    return item[0], item[1]


def _describe_case_failure(name: str, error: BaseException) -> str:
    formatted = "".join(traceback.format_exception(type(error), error, user_frames(error.__traceback__))).rstrip()
    indented = "\n".join("    " + line for line in formatted.splitlines())
    return f"- {name}: {type(error).__name__}: {error}\n{indented}"
