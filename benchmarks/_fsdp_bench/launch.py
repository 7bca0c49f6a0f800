# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Starting the ranks: our own processes (fork on CPU, spawn with CUDA) or the ones torchrun started.

Self-started worlds rendezvous through a ``FileStore`` in a temporary directory (no ports to pick) and gloo talks
over the loopback interface. If a rank fails, the others are stopped and its traceback is in the output; a world
that runs past ``--timeout`` is killed.
"""

import datetime
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from fairscale.internal.device import hide_accelerators_from_torch

from .config import BenchConfig
from .runner import run_world


def torchrun_rank() -> Optional[Tuple[int, int, int]]:
    """``(rank, world_size, local_rank)`` when started by torchrun (or any launcher setting RANK/WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


def threads_per_rank(cfg: BenchConfig, world_size: int) -> int:
    """``--threads``, or the cores shared evenly between the ranks of this machine."""
    return cfg.threads or max(1, (os.cpu_count() or 1) // world_size)


def _device(cfg: BenchConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu":
        # fairscale's device layer would otherwise see the machine's GPUs (default devices, pinned memory), and
        # torch >= 2.13 would open a CUDA context in each rank at its first AdamW step.
        hide_accelerators_from_torch()
        return torch.device("cpu")
    if not hasattr(torch, "accelerator") or not torch.accelerator.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is available; run with --device cpu")
    count = torch.accelerator.device_count()
    if local_rank >= count:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): say so before it does, in plain words.
        raise RuntimeError(
            f"--device cuda runs one rank per GPU, but local rank {local_rank} has no GPU of its own ({count} "
            "visible); lower --world-size (and --zero2-world-size for the zero2 scenario) or use --device cpu"
        )
    torch.accelerator.set_device_index(local_rank)
    return torch.device("cuda", local_rank)


def _init_rank(
    cfg: BenchConfig, rank: int, world_size: int, local_rank: int, store_path: Optional[str]
) -> torch.device:
    torch.set_num_threads(threads_per_rank(cfg, world_size))
    device = _device(cfg, local_rank)
    backend = "gloo" if device.type == "cpu" else "nccl"
    timeout = datetime.timedelta(seconds=cfg.timeout)
    if store_path is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return device


def _rank_main(cfg: BenchConfig, scenarios: List[str], rank: int, world_size: int, directory: str) -> None:
    try:
        device = _init_rank(cfg, rank, world_size, rank, os.path.join(directory, "store"))
        records = run_world(cfg, scenarios, rank, world_size, device)
        if rank == 0:
            with open(os.path.join(directory, "records.json"), "w") as f:
                json.dump(records, f)
        dist.destroy_process_group()
    except BaseException:
        sys.stdout.flush()
        sys.stderr.write(f"[rank {rank}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


def launch_world(cfg: BenchConfig, scenarios: List[str], world_size: int) -> List[Dict[str, Any]]:
    """Start ``world_size`` ranks on this machine, run ``scenarios`` in them, return rank 0's run records."""
    if cfg.device == "cuda" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        gpus = torch.accelerator.device_count()  # counts without creating a context: spawn/fork stay safe
        if world_size > gpus:
            raise SystemExit(
                f"--device cuda runs one rank per GPU: a {world_size}-rank world ({', '.join(scenarios)}) needs "
                f"{world_size} GPUs, {gpus} visible. Lower --world-size / --zero2-world-size, or pick scenarios "
                "that fit (e.g. --scenario train accum)."
            )
    # Forking is safe here: this parent process never runs torch compute (so no OpenMP pool to inherit); a CUDA
    # context cannot cross a fork, hence spawn for CUDA.
    method = "fork" if cfg.device == "cpu" and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx: Any = multiprocessing.get_context(method)
    directory = tempfile.mkdtemp(prefix="fsdp_bench_")
    procs = [
        ctx.Process(target=_rank_main, args=(cfg, scenarios, rank, world_size, directory), daemon=True)
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        wait_ranks(procs, cfg.timeout)
        with open(os.path.join(directory, "records.json")) as f:
            records: List[Dict[str, Any]] = json.load(f)
        return records
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(directory, ignore_errors=True)


def wait_ranks(procs: List[Any], timeout: float) -> None:
    """Return once every rank exited 0; raise as soon as one failed, or when the world runs past ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(
                f"rank {failed[0]} failed (exit code {procs[failed[0]].exitcode}); see its traceback above"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"the benchmark world did not finish within --timeout {timeout:g} s; killed it")
        time.sleep(0.05)
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"rank {failed[0]} failed (exit code {procs[failed[0]].exitcode}); see its traceback above")


def run_in_torchrun(cfg: BenchConfig, scenarios: List[str]) -> Tuple[int, int, List[Dict[str, Any]]]:
    """Run in the world torchrun started; returns ``(rank, world_size, records)`` (records only on rank 0)."""
    found = torchrun_rank()
    assert found is not None
    rank, world_size, local_rank = found
    device = _init_rank(cfg, rank, world_size, local_rank, None)
    try:
        records = run_world(cfg, scenarios, rank, world_size, device)
    finally:
        dist.destroy_process_group()
    return rank, world_size, records
