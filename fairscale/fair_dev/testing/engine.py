# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The multi-process test engine: start a world of ranks, run a function on each, report per rank.

A test body runs in ``world_size`` processes, each with an initialised default process group::

    def _body(rank: int, world_size: int, scale: float) -> float:
        t = torch.full((1,), float(rank))
        torch.distributed.all_reduce(t)
        return t.item() * scale

    def test_sum() -> None:
        assert run_distributed(_body, 2, 10.0) == [10.0, 10.0]

How a world is started and ended:

* Rendezvous goes through a ``FileStore`` in a fresh temporary directory, so no ports are picked.
* ``fn`` and its ``args``/``kwargs`` must be picklable (``fn`` a module-level function or a
  ``functools.partial`` of one), whatever the start method: a test body must run the same on a CPU
  machine, where ranks are forked, and on a GPU machine, where they are spawned. This is checked
  before any rank starts, so a closure fails on CPU too, with a message that says what to change.
* How ranks start: a CUDA world always **spawns** them (a fresh interpreter per rank, about 2 s):
  a forked child cannot use CUDA once its parent has touched it, and on a GPU machine even
  ``torch.cuda.is_available()`` marks the parent so. A CPU world **forks** (tens of milliseconds) on a
  machine without CUDA devices; with one, its ranks come from a **fork server** (a fresh process with
  torch preloaded), because after any backward in this process torch refuses autograd in forked
  children there. :func:`run_ranks`, whose body may set up NCCL itself, spawns whenever a CUDA device
  is visible.
  ``FAIRSCALE_TEST_START_METHOD=spawn`` (or ``forkserver``) forces a method for every world; ``fork``
  forces it for CPU worlds only. Running the suite with ``spawn`` on CPU is how CI proves, without a
  GPU, that every test body can start on a GPU machine.
* Forked ranks run torch single-threaded. GNU OpenMP (libgomp, which the torch wheels use) is not
  fork-safe: a child that re-enters a multi-threaded parallel region after its parent has used one
  deadlocks. One thread per rank avoids that, and is what one wants with several ranks on few cores
  anyway; ``torch.set_num_threads(n > 1)`` inside a forked rank raises instead of hanging.
* Every rank is seeded with the same :data:`SEED` (torch, ``random``, numpy) before ``fn`` runs, so a
  model built before any rank-dependent code is identical on all ranks. Seed with the rank for
  per-rank data.
* After ``fn`` returns on a rank, the rank waits at a barrier before it destroys the group, so ranks
  with less to do do not break their peers' connections.
* The first rank that fails ends the world: the others are killed (after at most 0.2 s spent telling
  the cause from its consequences in the peers) and the caller gets the failing rank's exception
  with ``[rank r]`` and the rank's traceback in its message (same exception type when it can be
  rebuilt, else :class:`DistributedTestError`). ``pytest.skip`` in a rank skips the calling test.
* A world that is not done after ``timeout`` seconds (a rank stuck in a collective, say) is killed and
  reported as :class:`DistributedTestTimeout` with the ranks that were still running and their Python
  stacks. Ranks also die with the caller (``PR_SET_PDEATHSIG`` on Linux), so nothing is left behind.

This module is the calling (parent) side. What runs inside a rank is in :mod:`.engine_rank`, and the
named sub-tests :func:`run_cases` / :func:`subtest` are in :mod:`.subtests`; both are re-exported here.
"""

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from fairscale.internal.device import accelerator_initialized

from .engine_rank import (
    ENGINE_FILES,
    SEED,
    START_METHOD_ENV,
    ProcessGroupBody,
    RemoteFailure,
    rank_main,
    rebuild_exception,
    seed_everything,
    use_loopback_for_gloo,
    init_gloo_world,
)
from .subtests import run_cases, subtest

__all__ = [
    "DEFAULT_TIMEOUT",
    "SEED",
    "START_METHOD_ENV",
    "DistributedTestError",
    "DistributedTestTimeout",
    "run_distributed",
    "run_ranks",
    "run_cases",
    "subtest",
    "seed_everything",
    "use_loopback_for_gloo",
    "init_gloo_world",
]

#: Seconds a world may run before it is killed and reported as a timeout.
DEFAULT_TIMEOUT = 120.0

# How long the parent waits for hung ranks to write their stacks before it kills them.
_STACK_DUMP_WAIT_S = 0.3
# After a first failure, how long to keep reading reports to find which failure came first.
_FAILURE_GRACE_S = 0.2
# How long spawned ranks may take to start (interpreter, imports) before the world's timeout starts counting.
_SPAWN_START_LIMIT_S = 180.0
# How long a rank that reported its result may take to exit, even past the deadline.
_EXIT_GRACE_S = 5.0
# Keep timeout messages readable: at most this many lines of stack per hung rank.
_STACK_DUMP_MAX_LINES = 60
# Beyond the engine's own timeout, the process group's collective timeout only has to make sure
# that gloo/NCCL never fire first and turn a clear "timeout" into a confusing transport error.
_PG_TIMEOUT_MARGIN_S = 60.0


class DistributedTestError(RuntimeError):
    """A rank failed in a way that cannot be re-raised with the original exception type.

    Attributes:
        rank: the failing rank, or ``None`` when the failure concerns several ranks.
    """

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


class DistributedTestTimeout(DistributedTestError):
    """The world did not finish within its timeout; ``ranks`` lists the ranks still running then."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


# ----------------------------------------------------------------------------------------------
# Public entry points


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    backend: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a fresh process-group world.

    Args:
        fn: the test body: a module-level function or a ``functools.partial`` of one (it must pickle).
        world_size: number of ranks (>= 1).
        *args: passed to ``fn`` after ``rank`` and ``world_size``.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank; the calling test is skipped
            when there are fewer GPUs than ranks).
        backend: process-group backend; default gloo for CPU and nccl for CUDA.
        timeout: seconds before the whole world is killed and :class:`DistributedTestTimeout` raised.
        **kwargs: passed to ``fn``.

    Returns:
        The per-rank return values of ``fn``, indexed by rank. They must be picklable.

    Raises:
        DistributedTestTimeout: the world was still running after ``timeout`` seconds.
        DistributedTestError: a rank failed with an exception that could not be rebuilt, or died.
        Exception: the first failing rank's exception type, with ``[rank r]`` and its traceback.
    """
    __tracebackhide__ = True  # pytest: show the test, not the engine
    device_type = _check_device(device)
    _check_world(world_size, timeout)
    if device_type == "cuda":
        available = _cuda_device_count()
        if available < world_size:
            pytest.skip(f"needs {world_size} CUDA devices for a {world_size}-rank world, found {available}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_distributed: this process already has a default process group (a test that called "
            "dist_init or init_process_group without teardown?); destroy it first, forked ranks would inherit it"
        )
    chosen_backend = backend if backend is not None else ("nccl" if device_type == "cuda" else "gloo")
    with _world_directory() as directory:
        body = ProcessGroupBody(
            fn=fn,
            args=tuple(args),
            kwargs=dict(kwargs),
            world_size=world_size,
            device_type=device_type,
            backend=chosen_backend,
            store_path=os.path.join(directory, "store"),
            pg_timeout_s=timeout + _PG_TIMEOUT_MARGIN_S,
        )
        return _run_world(body, world_size, timeout, directory, device_type)


def run_ranks(fn: Callable[[int], Any], world_size: int, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(rank)`` in ``world_size`` engine-managed processes *without* a process group.

    Same start, failure, timeout and seeding rules as :func:`run_distributed`; the body sets up
    whatever it needs itself (the upstream helpers ``spawn_for_all_world_sizes`` and ``torch_spawn``
    use this with ``dist_init``).

    Args:
        fn: called with the rank; its return value must be picklable.
        world_size: number of processes (>= 1).
        timeout: seconds before all processes are killed and :class:`DistributedTestTimeout` raised.

    Returns:
        The per-rank return values, indexed by rank.
    """
    __tracebackhide__ = True  # pytest: show the test, not the engine
    _check_world(world_size, timeout)
    with _world_directory() as directory:
        return _run_world(fn, world_size, timeout, directory)


# ----------------------------------------------------------------------------------------------
# Argument checks and small helpers


def _check_device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (rank r then uses cuda:r), got {device!r}")
    return device


def _check_world(world_size: int, timeout: float) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


@contextlib.contextmanager
def _world_directory() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="fairscale_world_")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_START_METHODS = ("fork", "spawn", "forkserver")


def _start_method(device_type: Optional[str]) -> str:
    """The multiprocessing start method for a world's ranks.

    Args:
        device_type: ``"cpu"`` for a CPU world (its ranks set ``FAIRSCALE_CPU_ONLY`` and never touch CUDA),
            ``"cuda"``, or ``None`` when unknown (:func:`run_ranks`: the body may set up NCCL itself).

    Returns:
        ``"fork"``, ``"spawn"`` or ``"forkserver"``.
    """
    forced = os.environ.get(START_METHOD_ENV, "")
    if forced and forced not in _START_METHODS:
        raise ValueError(f"{START_METHOD_ENV} must be one of {', '.join(_START_METHODS)}, got {forced!r}")
    if device_type != "cpu":
        # A forked child cannot create a CUDA context once the parent has initialised CUDA, and on a GPU machine
        # even the device checks (cudaGetDeviceCount) mark forked children as unable to: never fork a CUDA world.
        # A body of unknown kind forks only where no CUDA device is visible.
        if forced in ("spawn", "forkserver"):
            return forced
        if device_type == "cuda" or accelerator_initialized() or _cuda_device_count() > 0:
            return "spawn"
        return "fork"
    if forced:
        return forced
    # CPU ranks never use CUDA, but a forked copy of a process holding a CUDA context is not safe to run either. And
    # on a machine with a CUDA device, the first backward of this process (on CPU tensors too) starts autograd's
    # per-device threads, after which torch refuses every backward in a forked child ("Unable to handle autograd's
    # threading in combination with fork-based multiprocessing": the whole suite next to an H200 failed so). Ranks
    # then come from a fork server, a fresh process that never ran autograd (fork-fast, with torch preloaded).
    return CPU_WORLD_METHOD_NEXT_TO_GPU if accelerator_initialized() or _cuda_device_count() > 0 else "fork"


#: How a CPU world's ranks start on a machine with a CUDA device (see :func:`_start_method`); spawn where the
#: platform has no fork server.
CPU_WORLD_METHOD_NEXT_TO_GPU = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


#: What the fork server imports before it forks any rank (see :func:`_run_world`).
FORKSERVER_PRELOAD = [
    "torch",
    "torch._dynamo",
    "fairscale.nn",
    "fairscale.optim",
    "fairscale.fair_dev.testing.engine_rank",
]


def _cuda_device_count() -> int:
    """CUDA devices on this machine, whatever ``FAIRSCALE_CPU_ONLY`` says (a CUDA world's ranks drop it)."""
    # device_count() asks NVML first and does not initialise CUDA in this process.
    return int(torch.cuda.device_count())


def _pickled_body(body: Any, method: str) -> Optional[bytes]:
    """The body pickled for ranks that are not forked, checked before any rank starts (under fork too).

    Returns:
        ``None`` under fork (the ranks inherit the body; the check still runs, so a test that passes here also
        passes where ranks are spawned) and for bodies that only pickle while a process starts, else the bytes
        each rank unpickles into its own copy. Plain pickle copies
        tensors; multiprocessing's own pickling would put them in memory shared by all ranks and the caller, where
        one rank's in-place update (an optimizer state loaded from an argument, say) would change the others'.
    """
    try:
        payload = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"test bodies must be picklable so that the same test runs under fork (CPU) and spawn (CUDA worlds, "
            f"{START_METHOD_ENV}=spawn); this world would start with {method}: pass a module-level function "
            f"(or a functools.partial of one) and picklable arguments, not a closure or lambda ({e})"
        ) from e
    except Exception:
        # Objects that only pickle while a process is being started (multiprocessing queues, locks): the body
        # goes to the ranks as it is (fork inherits it; spawn pickles it on the way, sharing tensors' memory).
        return None
    return None if method == "fork" else payload


# ----------------------------------------------------------------------------------------------
# In the calling (parent) process


def _run_world(
    body: Callable[[int], Any], world_size: int, timeout: float, directory: str, device_type: Optional[str] = None
) -> List[Any]:
    """Start one process per rank, collect their reports, and make sure none outlives this call."""
    __tracebackhide__ = True  # pytest: show the test, not the engine
    method = _start_method(device_type)
    payload = _pickled_body(body, method)
    ctx: Any = multiprocessing.get_context(method)
    if method == "forkserver":
        # Loaded once in the server, inherited by every rank it forks: a rank starts in milliseconds, not seconds.
        # Beside torch: torch._dynamo (imported by the first optimizer a process builds, about 2.5 s) and the
        # package's big namespaces, which nearly every test module imports (a 2-rank world: 0.87 s -> 0.05 s).
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    # A forked or spawned rank starts with this process's environment as it is now; one from the fork server would
    # start with the server's, from when it was started (a test's monkeypatch.setenv would not reach it).
    environ = dict(os.environ) if method == "forkserver" else None
    deadline = time.monotonic() + timeout
    ranks: List[_RankProcess] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            stack_path = os.path.join(directory, f"stack_rank{rank}.txt")
            process = ctx.Process(
                target=rank_main,
                args=(rank, writer, body if payload is None else payload, os.getpid(), stack_path, method, environ),
                name=f"fairscale-test-rank{rank}",
            )
            _start(process, method)
            writer.close()  # the child holds the only write end, so its death shows up as EOF
            ranks.append(_RankProcess(rank, process, reader, stack_path))
        return _collect(ranks, deadline, timeout, method)
    finally:
        for handle in ranks:
            handle.kill()


def _start(process: Any, method: str) -> None:
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns on every fork from a process with threads; torch's OpenMP pool is
            # the one that matters, and the ranks are made safe against it (single-threaded).
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
            process.start()
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if method == "fork":
            raise
        raise TypeError(
            f"ranks started with {method} receive the test body by pickling: pass a module-level function and "
            f"picklable arguments, not a closure ({e})"
        ) from e


@dataclass
class _RankProcess:
    rank: int
    process: Any  # multiprocessing.Process of either context
    conn: Any  # read end of the rank's report pipe
    stack_path: str
    done: bool = False
    result: Any = None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()

    def read_report(self) -> Tuple[str, Any]:
        """The rank's report, or a failure describing how it died without one."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.process.join(timeout=5.0)
            code = self.process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            return "died", DistributedTestError(f"[rank {self.rank}] {how} without reporting a result", rank=self.rank)
        kind, value = pickle.loads(data)
        return str(kind), value


def _collect(ranks: List[_RankProcess], deadline: float, timeout: float, method: str = "fork") -> List[Any]:
    __tracebackhide__ = True  # pytest: show the test, not the engine
    # A spawned rank spends seconds starting an interpreter and importing torch (more on a loaded machine): the
    # world's timeout counts from the moment every rank is up (its stack file exists), within a start-up limit.
    starting = method != "fork"
    start_limit = time.monotonic() + _SPAWN_START_LIMIT_S
    while not all(handle.done for handle in ranks):
        if starting and all(os.path.exists(h.stack_path) for h in ranks):
            starting = False
            deadline = max(deadline, time.monotonic() + timeout)
        remaining = (max(deadline, start_limit) if starting else deadline) - time.monotonic()
        if remaining <= 0:
            raise _timeout_error([h for h in ranks if not h.done], len(ranks), timeout)
        failures = _read_ready([h for h in ranks if not h.done], min(remaining, 0.2) if starting else remaining)
        if failures:
            # The peers of a failed rank fail right after it (broken connections), and the end of a
            # crashed rank can even be noticed after theirs: listen a moment longer, then blame the cause.
            grace_end = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            while not all(handle.done for handle in ranks) and time.monotonic() < grace_end:
                failures += _read_ready([h for h in ranks if not h.done], grace_end - time.monotonic())
            raise min(failures, key=lambda item: item[0])[1]
    _join_all(ranks, deadline)
    return [handle.result for handle in ranks]


def _read_ready(pending: List[_RankProcess], timeout: float) -> List[Tuple[float, BaseException]]:
    """Read the reports that arrive within ``timeout``; return the failures with their times."""
    ready = set(multiprocessing.connection.wait([h.conn for h in pending], timeout=max(0.0, timeout)))
    failures: List[Tuple[float, BaseException]] = []
    for handle in pending:
        if handle.conn not in ready:
            continue
        kind, value = handle.read_report()
        handle.done = True
        if kind == "ok":
            handle.result = _unpickle_result(handle.rank, value)
        elif kind == "error":
            failures.append((value.time, _failure_to_exception(value)))
        else:
            # A rank that died without a report crashed or was killed: a cause, never a consequence
            # (the peers of a dead rank get exceptions and report those), so it sorts first.
            failures.append((float("-inf"), value))
    return failures


def _failure_to_exception(failure: RemoteFailure) -> BaseException:
    """The exception to raise in the test for a rank's failure report."""
    if failure.is_skip:
        return pytest.skip.Exception(f"[rank {failure.rank}] {failure.message}")
    # The traceback ends with the full message; the headline only needs its first line.
    headline = failure.message.splitlines()[0] if failure.message else ""
    details = f"\n\nTraceback of rank {failure.rank}:\n{failure.traceback.rstrip()}"
    exc_type = failure.exception_type()
    rebuilt = (
        rebuild_exception(exc_type, f"[rank {failure.rank}] {headline}{details}") if exc_type is not None else None
    )
    if rebuilt is not None:
        return rebuilt
    return DistributedTestError(f"[rank {failure.rank}] {failure.type_name}: {headline}{details}", rank=failure.rank)


def _unpickle_result(rank: int, payload: bytes) -> Any:
    try:
        return pickle.loads(payload)
    except Exception as e:
        raise DistributedTestError(f"[rank {rank}] its return value cannot be unpickled here: {e!r}", rank=rank)


def _join_all(ranks: List[_RankProcess], deadline: float) -> None:
    """Wait for ranks that reported success to exit; a crash on the way out is still a failure."""
    __tracebackhide__ = True  # pytest: show the test, not the engine
    for handle in ranks:
        # At least a short grace even at the deadline: a rank that already reported only has to exit.
        handle.process.join(timeout=max(_EXIT_GRACE_S, deadline - time.monotonic()))
    stuck = [h.rank for h in ranks if h.process.is_alive()]
    if stuck:
        raise DistributedTestTimeout(f"ranks {stuck} reported a result but did not exit before the timeout", stuck)
    for handle in ranks:
        if handle.process.exitcode != 0:
            raise DistributedTestError(
                f"[rank {handle.rank}] returned a result but then exited with code {handle.process.exitcode}",
                rank=handle.rank,
            )


def _timeout_error(pending: List[_RankProcess], world_size: int, timeout: float) -> DistributedTestTimeout:
    running = [h.rank for h in pending]
    stacks = _dump_stacks(pending)
    message = (
        f"ranks {running} of a {world_size}-rank world were still running after the {timeout:g} s timeout "
        f"(a hung collective, a rank waiting on a peer that went another way, or a slow test); all ranks "
        f"were killed. Python stacks of the ranks at the timeout:\n{stacks}"
    )
    return DistributedTestTimeout(message, running)


def _without_engine_frames(lines: List[str]) -> List[str]:
    """Per thread (most recent call first), drop the frames from the first engine frame on.

    Those are the engine and, under fork, the stack inherited from the test process: noise here.
    """
    kept, skipping = [], False
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            skipping = False
        elif any(f'"{path}"' in line for path in ENGINE_FILES):
            skipping = True
        if not skipping:
            kept.append(line)
    return kept


def _dump_stacks(pending: List[_RankProcess]) -> str:
    for handle in pending:
        if handle.process.is_alive() and handle.process.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(handle.process.pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_WAIT_S)
    parts = []
    for handle in pending:
        try:
            with open(handle.stack_path) as f:
                lines = f.read().rstrip().splitlines()
        except OSError:
            lines = []
        lines = _without_engine_frames(lines)
        if len(lines) > _STACK_DUMP_MAX_LINES:
            lines = lines[:_STACK_DUMP_MAX_LINES] + ["  ..."]
        parts.append(f"--- rank {handle.rank} ---\n" + ("\n".join(lines) if lines else "  (no stack written)"))
    return "\n".join(parts)
