# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Named sub-tests inside one test (usually one started world): :func:`run_cases` and :func:`subtest`.

Starting a world costs more than most cases in it, so option matrices run as cases of one world.
Both helpers name the failing case in the error; :func:`run_cases` also keeps going after a failure
so that one run lists every failing case. Re-exported by :mod:`fairscale.fair_dev.testing.engine`.

In a world of several ranks, :func:`run_cases` makes the ranks agree on each case's outcome before any of them
starts the next case. The agreement goes through the default group's key-value store, not a collective: a rank
whose case failed half-way may have skipped a collective that a peer is still blocked in, and a collective issued
now would pair with that one (gloo then hangs or aborts). Store keys never pair with anything.
"""

import contextlib
import itertools
import time
import traceback
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import pytest
import torch.distributed as dist

from .engine_rank import rebuild_exception, user_frames

__all__ = ["run_cases", "subtest"]


def run_cases(cases: Iterable[Tuple[str, Callable[[], Any]]]) -> None:
    """Run every ``(name, case)`` in turn, then fail once, listing each failing case with its error.

    Meant for option matrices inside one started world (one world per case costs a start each).
    Every rank must run the same cases in the same order. With a default process group of several
    ranks, the ranks agree on each case's outcome before any of them starts the next case (through
    the group's store, see the module docstring):

    * every rank passed (or skipped): the next case starts;
    * the case failed on every rank: it is recorded and the next case starts, as in one process;
    * it failed on some ranks only: every rank raises now. A rank whose peers do not report within
      a few seconds (they are blocked in a collective that the failing rank skipped) raises its
      failure at once, and the test engine then ends the world: never a timeout.

    Args:
        cases: pairs of a unique case name and a callable taking no arguments.

    Raises:
        AssertionError: one or more cases failed; the message names each with its error.
        ValueError: a case name is repeated.
        TypeError: an item is not a ``(str, callable)`` pair.
        RuntimeError: the ranks ran different cases (a desynchronised test).
    """
    seen: Dict[str, None] = {}
    failures: List[str] = []
    skips: List[str] = []
    agreement = _CaseAgreement.for_world()
    for index, item in enumerate(cases):
        name, case = _check_case(item)
        if name in seen:
            raise ValueError(f"run_cases: case name {name!r} is used twice; give every case a unique name")
        seen[name] = None
        failure: Optional[str] = None
        try:
            case()
        except pytest.skip.Exception as e:
            skips.append(f"{name}: {e}")
        except (Exception, pytest.fail.Exception) as e:
            failure = _describe_case_failure(name, e)
            failures.append(failure)
        if agreement is not None:
            agreement.settle(index, name, failure, failures)
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


# How long a rank whose case failed waits for its peers' outcomes. Peers that passed report at once when the case
# has no collective after the failure point; peers that are not back by then are blocked in a collective that this
# rank skipped, and only ending the world frees them.
_FAILED_RANK_WAIT_S = 5.0
# How long a rank whose case passed waits for its peers (a slow case on another rank); the engine's world timeout
# is usually shorter, and a failing peer ends the world much sooner.
_PASSED_RANK_WAIT_S = 600.0
_POLL_S = 0.005
# One number per run_cases call of this process: every rank calls run_cases in the same order, so equal numbers
# name the same call on every rank (and several calls in one world never read each other's keys).
_calls = itertools.count()


class _CaseAgreement:
    """Each rank's outcome of each case, exchanged through the default group's store."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"fairscale.run_cases/{next(_calls)}"

    @classmethod
    def for_world(cls) -> Optional["_CaseAgreement"]:
        """The agreement of this process's default group, or ``None`` alone (no group, or a 1-rank world)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:  # a torch without the helper, or a group without a store: no agreement possible
            return None
        return cls(store, dist.get_rank(), dist.get_world_size())

    def settle(self, index: int, name: str, failure: Optional[str], failures: List[str]) -> None:
        """Publish this rank's outcome of case ``index``, read the others', raise unless they all match."""
        outcome = "failed" if failure is not None else "passed"
        short = (failure or "").splitlines()[0][:300] if failure else ""
        self.store.set(f"{self.prefix}/{index}/{self.rank}", f"{outcome}|{name}|{short}")
        keys = [f"{self.prefix}/{index}/{r}" for r in range(self.world_size)]
        # A counter of the ranks that published, read with add(0): every store has add (torch 2.1's PrefixStore,
        # the default group's, has no check()).
        published = f"{self.prefix}/{index}/published"
        self.store.add(published, 1)
        deadline = time.monotonic() + (_FAILED_RANK_WAIT_S if failure is not None else _PASSED_RANK_WAIT_S)
        while self.store.add(published, 0) < self.world_size:
            if time.monotonic() > deadline:
                if failure is not None:
                    raise AssertionError(
                        f"case {name!r} failed on rank {self.rank} while its peers did not finish it within "
                        f"{_FAILED_RANK_WAIT_S:g} s (they wait in a collective this rank skipped):\n"
                        + "\n".join(failures)
                    )
                raise RuntimeError(f"run_cases: the peers of rank {self.rank} did not finish case {name!r} in time")
            time.sleep(_POLL_S)
        reports = [self.store.get(k).decode().split("|", 2) for k in keys]
        names = {r[1] for r in reports}
        if names != {name}:
            raise RuntimeError(
                f"run_cases: the ranks ran different cases at position {index}: "
                + ", ".join(f"rank {r} {rep[1]!r}" for r, rep in enumerate(reports))
                + "; every rank must run the same cases in the same order"
            )
        failed = [r for r, rep in enumerate(reports) if rep[0] == "failed"]
        if failed and len(failed) < self.world_size:
            if failure is not None:
                raise AssertionError(
                    f"case {name!r} failed on ranks {failed} only (passed on the others):\n" + "\n".join(failures)
                )
            raise AssertionError(
                f"case {name!r} passed on rank {self.rank} but failed on ranks {failed}: "
                + "; ".join(f"rank {r}: {reports[r][2]}" for r in failed)
            )
