# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A minimal fork-based multi-process runner for the tests of ``fairscale.internal``.

``run_world(fn, world_size)`` forks ``world_size`` processes, joins them in a gloo group through
a file store in a temporary directory, and runs ``fn(rank, world_size)`` in each. The first
rank that fails ends the others and its traceback is re-raised with a ``[rank r]`` prefix; a
world that does not finish within ``timeout`` seconds is killed and reported. ``pytest.skip``
inside a rank skips the test.

Stand-in until the shared engine in ``fairscale.fair_dev.testing`` is available.
"""

import multiprocessing
import os
import re
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

__all__ = ["run_world"]


def _child(
    fn: Callable[[int, int], Any],
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    conn: Connection,
    init: bool,
) -> None:
    status: Tuple[str, int, str] = ("ok", rank, "")
    try:
        # Oversubscribed CPUs: intra-op threads per rank only add contention.
        torch.set_num_threads(1)
        if init:
            store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        fn(rank, world_size)
        if dist.is_initialized():
            # Nobody leaves before everyone is done: a rank exiting early can break connections
            # its peers are still setting up (e.g. the tail of a new_group handshake).
            dist.barrier()
    except pytest.skip.Exception as exc:
        status = ("skip", rank, str(exc.msg))
    except BaseException:  # noqa: B902 - report everything, including KeyboardInterrupt
        status = ("error", rank, traceback.format_exc())
    try:
        conn.send(status)
        conn.close()
    finally:
        # Skip atexit handlers and process-group teardown: peers may be dead, and a clean
        # destroy_process_group() could block on them. The parent owns the cleanup.
        os._exit(0 if status[0] != "error" else 1)


def run_world(fn: Callable[[int, int], Any], world_size: int, timeout: float = 60.0, init: bool = True) -> None:
    """Run ``fn(rank, world_size)`` on ``world_size`` forked gloo ranks; re-raise the first failure.

    Args:
        fn: the per-rank body (may be a closure: ``fork`` does not pickle it).
        world_size: number of ranks.
        timeout: seconds for the whole world, also used as the gloo collective timeout.
        init: ``False`` runs ``fn`` in fresh processes without ``torch.distributed`` initialised.
    """
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs: List[Any] = []
        conns: List[Connection] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(fn, rank, world_size, store_path, timeout, child_end, init), daemon=True
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        try:
            failure = _collect(procs, conns, time.monotonic() + timeout)
        finally:
            _kill_all(procs)
    if failure is None:
        return
    kind, rank, text = failure
    if kind == "skip":
        pytest.skip(f"[rank {rank}] {text}")
    raise RuntimeError(f"[rank {rank}] {text}")


# Errors a rank gets because a peer died or failed: reported only if nothing better explains it.
_COLLATERAL = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout", re.I)
_GRACE_S = 1.0


def _collect(procs: List[Any], conns: List[Connection], deadline: float) -> Optional[Tuple[str, int, str]]:
    pending = {conn: rank for rank, conn in enumerate(conns)}
    failures: List[Tuple[str, int, str]] = []
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for conn in wait(list(pending), timeout=min(remaining, 0.5)):
            assert isinstance(conn, Connection)
            failure = _receive(procs, pending.pop(conn), conn)
            if failure is not None and not failures:
                # The first failure stops the world, but peers of a crashed rank often report a
                # broken connection first: wait briefly for the root cause.
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            if failure is not None:
                failures.append(failure)
    if failures:
        # A skip or a real error beats a broken-connection error caused by another rank.
        return sorted(failures, key=lambda f: bool(_COLLATERAL.search(f[2])))[0]
    if pending:
        return ("error", min(pending.values()), f"timed out; ranks {sorted(pending.values())} did not finish")
    return None


def _receive(procs: List[Any], rank: int, conn: Connection) -> Optional[Tuple[str, int, str]]:
    try:
        status: Tuple[str, int, str] = conn.recv()
    except EOFError:
        procs[rank].join(timeout=5)  # reap it so the exit code is known
        return ("error", rank, f"process died without reporting (exit code {procs[rank].exitcode})")
    return None if status[0] == "ok" else status


def _kill_all(procs: List[Any]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(timeout=5)
