#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``oss`` scenario of the main job: optimizer-state and gradient sharding against their peers.

Trains the benchmark's GPT with AdamW four ways in one world and reports them side by side:

* ``ddp``: PyTorch DDP + ``torch.optim.AdamW`` (every rank holds all optimizer state);
* ``oss+ddp``: DDP + :class:`fairscale.optim.OSS` (ZeRO-1);
* ``oss+sdp``: :class:`fairscale.nn.data_parallel.ShardedDataParallel` + OSS (ZeRO-2), default gradient buckets
  (every rank keeps a bucket per owner: gradient memory as DDP's);
* ``oss+sdp,rbs=0``: the same without buckets (``reduce_buffer_size=0``): non-owned gradients are dropped after
  their reduction, so a rank keeps about ``1 / world_size`` of them;
* ``zero+ddp``: DDP + PyTorch's ``ZeroRedundancyOptimizer`` (ZeRO-1).

Per run: median step time (slowest rank), optimizer-state bytes per rank (measured from the state tensors), bytes
of gradients a rank still holds after backward, peak accelerator memory (CUDA only), and the loss curve (all four
train the same model on the same data, so the losses must agree).

Run through the main job (``python benchmarks/fsdp.py --scenario oss``, with its model and world options) or on
its own (``python benchmarks/oss_scenario.py --world-size 2 --steps 10``).
"""

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.scenario_args import split_scenario_args  # noqa: E402
from _fsdp_bench.config import BenchConfig, parse_args  # noqa: E402
from _fsdp_bench.corpus import Corpus  # noqa: E402
from _fsdp_bench.model import build_model, lm_loss  # noqa: E402

from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import collectives  # noqa: E402
from fairscale.internal.device import DeviceHandle  # noqa: E402
from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: E402
from fairscale.optim import OSS  # noqa: E402

VARIANTS = ("ddp", "oss+ddp", "oss+sdp", "oss+sdp,rbs=0", "zero+ddp")
SCENARIO = "oss"


def split_scenario(argv: Sequence[str]) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line for the ``oss`` scenario (see :func:`split_scenario_args`)."""
    return split_scenario_args(argv, SCENARIO)


def _build(variant: str, cfg: BenchConfig, device: torch.device) -> Tuple[nn.Module, Any]:
    model = build_model(cfg, device)
    ids = [device.index] if device.type == "cuda" else None
    if variant.startswith("oss+sdp"):
        oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=cfg.lr)
        buffer = 0 if variant.endswith("rbs=0") else 2**23
        return ShardedDataParallel(model, oss, reduce_buffer_size=buffer), oss
    ddp = DDP(model, device_ids=ids)
    if variant == "ddp":
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)
    if variant == "oss+ddp":
        return ddp, OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=cfg.lr)
    if variant == "zero+ddp":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=cfg.lr)
    raise ValueError(f"unknown variant {variant!r}")


def _state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors of this rank's optimizer state (OSS and ZeRO keep theirs in ``.optim``)."""
    inner = optimizer.optim if isinstance(optimizer, (OSS, ZeroRedundancyOptimizer)) else optimizer
    seen, total = set(), 0
    for state in inner.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of gradient storage this rank holds (buckets counted once)."""
    storages: Dict[int, int] = {}
    for p in model.parameters():
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _run_variant(variant: str, cfg: BenchConfig, corpus: Corpus, rank: int, world_size: int) -> Dict[str, Any]:
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    handle = DeviceHandle.for_device(device)
    handle.reset_peak_memory_stats()
    model, optimizer = _build(variant, cfg, device)
    times: List[float] = []
    losses: List[float] = []
    grad_bytes = 0
    for step in range(cfg.warmup + cfg.steps):
        handle.synchronize()
        start = time.perf_counter()
        (model if variant.startswith("oss+sdp") else optimizer).zero_grad()
        inputs, targets = corpus.batch(step, 0, rank, world_size, cfg.batch)
        loss = lm_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        grad_bytes = _grad_bytes(model)
        optimizer.step()
        handle.synchronize()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "step_s": statistics.median(times),
        "state_bytes": _state_bytes(optimizer),
        "grad_bytes": grad_bytes,
        "peak_bytes": handle.max_memory_allocated(),
        "losses": losses,
    }


def _rank_body(rank: int, world_size: int, cfg: BenchConfig) -> Optional[Dict[str, Any]]:
    corpus = Corpus(cfg.vocab, cfg.seq_len, cfg.seed)
    results: Dict[str, Any] = {}
    for variant in VARIANTS:
        mine = _run_variant(variant, cfg, corpus, rank, world_size)
        results[variant] = collectives.all_gather_object(mine)
    return results if rank == 0 else None


def summarize(per_rank: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """One row per variant: slowest rank's median step, mean per-rank bytes, ratios against ddp / zero+ddp."""
    rows: Dict[str, Dict[str, Any]] = {}
    for variant, ranks in per_rank.items():
        rows[variant] = {
            "step_ms": 1e3 * max(r["step_s"] for r in ranks),
            "state_mb_per_rank": statistics.mean(r["state_bytes"] for r in ranks) / 2**20,
            "grad_mb_per_rank": statistics.mean(r["grad_bytes"] for r in ranks) / 2**20,
            "peak_mb": max(r["peak_bytes"] for r in ranks) / 2**20,
            "losses": ranks[0]["losses"],
        }
    ddp, zero = rows["ddp"], rows["zero+ddp"]
    for row in rows.values():
        row["state_vs_ddp"] = row["state_mb_per_rank"] / ddp["state_mb_per_rank"] if ddp["state_mb_per_rank"] else 0.0
        row["step_vs_zero"] = row["step_ms"] / zero["step_ms"] if zero["step_ms"] else 0.0
        row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(row["losses"], ddp["losses"]))
    return rows


def format_table(rows: Dict[str, Dict[str, Any]], world_size: int) -> str:
    header = (
        f"{'run':<14} {'step ms':>9} {'vs zero':>8} {'opt state MB/rank':>18} {'vs ddp':>7} "
        f"{'grads MB/rank':>14} {'peak MB':>8} {'loss diff':>10}"
    )
    lines = [f"oss scenario: AdamW, world size {world_size} (target: oss+sdp state 1/{world_size} of ddp's)", header]
    for name, r in rows.items():
        lines.append(
            f"{name:<14} {r['step_ms']:>9.1f} {r['step_vs_zero']:>7.2f}x {r['state_mb_per_rank']:>18.2f} "
            f"{r['state_vs_ddp']:>6.2f}x {r['grad_mb_per_rank']:>14.2f} {r['peak_mb']:>8.1f} "
            f"{r['max_loss_diff_vs_ddp']:>10.2e}"
        )
    return "\n".join(lines)


def run(argv: Sequence[str]) -> int:
    """Parse the shared options, run the four variants in one world, print the table, write the JSON."""
    cfg = parse_args(list(argv))
    device = "cuda" if cfg.device == "cuda" else "cpu"
    results = run_function(_rank_body, cfg.world_size, cfg, device=device, timeout=cfg.timeout)[0]
    rows = summarize(results)
    print("\n" + format_table(rows, cfg.world_size))
    if cfg.out:
        root, ext = os.path.splitext(cfg.out)
        path = f"{root}_oss{ext or '.json'}"
        with open(path, "w") as f:
            json.dump({"world_size": cfg.world_size, "config": vars(cfg), "runs": rows}, f, indent=1, default=str)
        print(f"JSON: {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
