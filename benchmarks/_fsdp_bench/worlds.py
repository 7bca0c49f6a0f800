# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Run one function on every rank of a self-started world and collect what each rank returns.

The scenario scripts (``oss``, ``tp``, ``pipe``, ``overlap``) need the same thing the test engine gives tests, but
the main job must run with the ``benchmarks`` extra alone: nothing here imports pytest or
``fairscale.fair_dev.testing``. The rules are the test engine's, so that numbers do not change with the launcher:
fork on CPU (spawn for CUDA), one torch thread per rank, every rank seeded with 0, a ``FileStore`` rendezvous in a
fresh temporary directory, gloo over loopback, a barrier before the group is destroyed, and the first rank that fails
or a world past its timeout ends the run with an error (the failing rank's traceback is on stderr).
"""

import datetime
import multiprocessing
import os
import pickle
import random
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist

from fairscale.internal.device import hide_accelerators_from_torch

from .launch import wait_ranks

# The seed every rank starts from (the test engine's, so that scenario numbers do not depend on the launcher).
SEED = 0
# Beyond the world's own timeout: gloo/NCCL must never fire first and turn a clear timeout into a transport error.
_PG_TIMEOUT_MARGIN_S = 60.0


def _rank_main(
    fn: Callable[..., Any],
    args: Tuple[Any, ...],
    device: str,
    rank: int,
    world_size: int,
    directory: str,
    timeout: float,
) -> None:
    try:
        torch.set_num_threads(1)
        random.seed(SEED)
        torch.manual_seed(SEED)
        if device == "cuda":
            torch.accelerator.set_device_index(rank)
            backend = "nccl"
        else:
            # A CPU world stays on CPU on a machine with GPUs (FSDP's default compute device would be the GPU), and
            # torch >= 2.13 opens no CUDA context in it at an optimizer step.
            hide_accelerators_from_torch()
            if os.path.exists("/sys/class/net/lo"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "gloo"
        store = dist.FileStore(os.path.join(directory, "store"), world_size)  # type: ignore[attr-defined]
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout + _PG_TIMEOUT_MARGIN_S),
        )
        result = fn(rank, world_size, *args)
        # Written before the barrier: once every rank is past it, every result is on disk.
        with open(os.path.join(directory, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        if dist.is_initialized():
            dist.barrier()  # a rank with less to do must not tear down connections a peer still uses
            dist.destroy_process_group()
    except BaseException:
        sys.stdout.flush()
        sys.stderr.write(f"[rank {rank}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


def run_function(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu", timeout: float) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks with a default process group.

    Args:
        fn: a module-level function (spawned CUDA ranks unpickle it); its return value must pickle.
        world_size: number of ranks.
        *args: passed to ``fn`` after ``rank`` and ``world_size``.
        device: ``"cpu"`` (gloo, forked ranks) or ``"cuda"`` (NCCL, one GPU per rank, spawned ranks).
        timeout: seconds before the world is killed.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RuntimeError: a rank failed (its traceback is on stderr) or the world ran past ``timeout``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    # Forking is safe for CPU worlds: the parent of a benchmark never runs torch compute itself (no OpenMP pool to
    # inherit). A CUDA context cannot cross a fork.
    method = "fork" if device == "cpu" and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx: Any = multiprocessing.get_context(method)
    directory = tempfile.mkdtemp(prefix="fsdp_bench_world_")
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, tuple(args), device, rank, world_size, directory, timeout), daemon=True
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        wait_ranks(procs, timeout)
        results = []
        for rank in range(world_size):
            # Our own ranks wrote these files a moment ago, in a directory only this run knows.
            with open(os.path.join(directory, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(directory, ignore_errors=True)
