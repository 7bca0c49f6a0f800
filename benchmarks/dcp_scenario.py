#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints: fairscale's FSDP (``fairscale.nn.data_parallel.dcp``) against FSDP2's own path, same model.

Both peers train the benchmark GPT (``_fsdp_bench/model.py``, one sharding unit per block plus the root) with Adam
for one step, then save a model + optimizer checkpoint with ``torch.distributed.checkpoint`` and load it back:

* ``fairscale``: ``dcp.save(model, optim, checkpoint_id=...)`` / ``dcp.load(...)`` of
  :mod:`fairscale.nn.data_parallel.dcp` (the save hands DCP views of the flat shards, no copies; the load reads into
  views of a staging copy of the flat shards and copies it in, no exchange);
* ``fsdp2``: ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``get_optimizer_state_dict`` (views
  of the sharded parameters), ``dcp.save``; ``dcp.load`` into the same dicts and ``set_*_state_dict``.

Reported per peer (medians over ``--repeats`` interleaved runs, the slowest rank's time): save and load wall time
and CPU time (the process's, all threads), and, in ``--memory-passes`` separate passes (the sampler thread would
slow the timed ones), the peak of the C heap in use (``_fsdp_bench/heap.py``) above what the rank held before the
call, the highest of the passes and ranks. For reference: the rank's shards (parameters + optimizer state), the
bytes of its DCP state dicts, the full fp32 parameters of the largest unit, and fairscale's largest exchange (send
and receive buffers, from the collective counter; none since the load copies locally). ``extra over FSDP2 beyond its
copies`` is fairscale's peak minus FSDP2's minus fairscale's state-dict bytes (its copies of the shards, the load's
staging, which FSDP2 does not need: its parameters are stored in the checkpoint's layout): what else it holds (DCP
reading its larger chunks), to compare with the largest unit.

Run alone: ``python benchmarks/dcp_scenario.py [--layers 6 --hidden 384 --world-size 2 --repeats 5]``. Output: a
table on stdout and ``--out`` (JSON, default ``dcp_benchmark.json``; an empty string skips it).
"""

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.heap import HEAP_METHOD_PREFIX, HeapSampler, heap_in_use  # noqa: E402
from _fsdp_bench.model import GPT  # noqa: E402
from _fsdp_bench.peers import fsdp2_cpu_problem  # noqa: E402
from _fsdp_bench.scenario_args import split_scenario_args  # noqa: E402
from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import collectives  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # noqa: E402
from fairscale.nn.data_parallel import dcp as fsdp_dcp  # noqa: E402

SCENARIO = "dcp"
PEERS = ("fairscale", "fsdp2")
MB = 1e6


@dataclasses.dataclass(frozen=True)
class DcpConfig:
    layers: int = 6
    hidden: int = 384
    heads: int = 6
    seq_len: int = 64
    vocab: int = 8192
    batch: int = 2
    world_size: int = 2
    repeats: int = 5
    memory_passes: int = 3
    directory: str = ""
    out: str = "dcp_benchmark.json"
    timeout: float = 1800.0


INT_OPTIONS = ("layers", "hidden", "heads", "seq_len", "vocab", "batch", "world_size", "repeats", "memory_passes")


def split_scenario(argv: Sequence[str]) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line for ``--scenario dcp`` (see :func:`split_scenario_args`)."""
    return split_scenario_args(argv, SCENARIO)


def parse_args(argv: Sequence[str]) -> DcpConfig:
    d = DcpConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    for name in INT_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--dir", dest="directory", default="", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--out", default=d.out, help="JSON output ('' to skip)")
    p.add_argument("--timeout", type=float, default=d.timeout)
    args, _ = p.parse_known_args(list(argv))  # the main job's other options are shared, not errors
    cfg = DcpConfig(**vars(args))
    for name in INT_OPTIONS:
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.hidden % cfg.heads:
        p.error("--hidden must be a multiple of --heads")
    return cfg


# ------------------------------------------------------------------------------------------------------ ranks


def _gpt(cfg: DcpConfig) -> nn.Module:
    torch.manual_seed(0)
    return GPT(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, cfg: DcpConfig, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len), generator=gen)
    optim.zero_grad()
    logits = model(idx)
    nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), idx.reshape(-1)).backward()
    optim.step()


def _fairscale_peer(cfg: DcpConfig) -> Tuple[nn.Module, torch.optim.Optimizer]:
    model = _gpt(cfg)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block)
    fsdp = FSDP(model)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-3)


def _fsdp2_peer(cfg: DcpConfig, world_size: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _gpt(cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _fsdp2_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    from torch.distributed.checkpoint import state_dict as dsd

    return {"model": dsd.get_model_state_dict(model), "optimizer": dsd.get_optimizer_state_dict(model, optim)}


def _fsdp2_save(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_fsdp2_state(model, optim), checkpoint_id=path)


def _fsdp2_load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    state = _fsdp2_state(model, optim)
    dcp.load(state, checkpoint_id=path)
    dsd.set_model_state_dict(model, state["model"])
    dsd.set_optimizer_state_dict(model, optim, state["optimizer"])


def _fairscale_save(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    fsdp_dcp.save(model, optim, checkpoint_id=path)


def _fairscale_load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    fsdp_dcp.load(model, optim, checkpoint_id=path)


def _local_bytes(value: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict; DTensors count their local part."""
    if isinstance(value, dict):
        return sum(_local_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_local_bytes(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return int(local.numel() * local.element_size())
    return 0


def _shard_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """This rank's parameters and optimizer state."""
    params = sum(_local_bytes(p.data) for p in model.parameters())
    return params + _local_bytes([s for s in optim.state.values()])


def _largest_unit_bytes(model: nn.Module) -> int:
    """The full fp32 parameters of the largest FSDP unit (what gathering one unit at a time may hold)."""
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    return max(sum(h.padded_numel * 4 for h in m._handles) for m in units)


def _timed(fn: Callable[[], None]) -> Tuple[float, float]:
    """Wall time (between barriers) and this process's CPU time (all its threads) of ``fn``."""
    collectives.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    collectives.barrier()
    return time.perf_counter() - start, cpu


def _peak_above(fn: Callable[[], None]) -> int:
    gc.collect()
    collectives.barrier()
    before = heap_in_use() or 0
    with HeapSampler() as sampler:
        fn()
    collectives.barrier()
    return max(0, sampler.peak - before)


def _rank_body(rank: int, world_size: int, cfg: DcpConfig, directory: str) -> Dict[str, Any]:
    peers: Dict[str, Tuple[nn.Module, torch.optim.Optimizer]] = {
        "fairscale": _fairscale_peer(cfg),
        "fsdp2": _fsdp2_peer(cfg, world_size),
    }
    for model, optim in peers.values():
        _train_step(model, optim, cfg, rank)
    ops = {
        "fairscale": (_fairscale_save, _fairscale_load),
        "fsdp2": (_fsdp2_save, _fsdp2_load),
    }
    out: Dict[str, Any] = {
        name: {
            "save_s": [],
            "load_s": [],
            "save_cpu_s": [],
            "load_cpu_s": [],
            "save_peak_bytes": [],
            "load_peak_bytes": [],
        }
        for name in PEERS
    }
    for name, (model, optim) in peers.items():
        out[name]["shard_bytes"] = _shard_bytes(model, optim)
    fs_model, fs_optim = peers["fairscale"]
    out["fairscale"]["state_dict_bytes"] = _local_bytes(
        [fsdp_dcp.get_model_state_dict(fs_model), fsdp_dcp.get_optimizer_state_dict(fs_model, fs_optim)]
    )
    out["fsdp2"]["state_dict_bytes"] = _local_bytes(_fsdp2_state(*peers["fsdp2"]))
    out["largest_unit_bytes"] = _largest_unit_bytes(fs_model)

    def path(name: str, run: str) -> str:
        return os.path.join(directory, f"{name}-{run}")

    def clean(p: str) -> None:
        collectives.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True)
        collectives.barrier()

    for r in range(cfg.repeats):  # timed passes, peers interleaved (and alternating who goes first)
        order = PEERS if r % 2 == 0 else tuple(reversed(PEERS))
        for name in order:
            model, optim = peers[name]
            save, load = ops[name]
            p = path(name, f"t{r}")
            for op, fn in (("save", save), ("load", load)):
                wall, cpu = _timed(lambda: fn(model, optim, p))
                out[name][f"{op}_s"].append(wall)
                out[name][f"{op}_cpu_s"].append(cpu)
            clean(p)
    for r in range(cfg.memory_passes):  # memory passes (a sampled peak can be missed, never invented: keep the highest)
        for name in PEERS:
            model, optim = peers[name]
            save, load = ops[name]
            p = path(name, f"m{r}")
            with collectives.count_collectives() as counter:
                out[name]["save_peak_bytes"].append(_peak_above(lambda: save(model, optim, p)))
                out[name]["load_peak_bytes"].append(_peak_above(lambda: load(model, optim, p)))
            # fairscale's largest exchange, if any: its send and receive buffers, both this size (neither peer exchanges
            # values in save() or load(); FSDP2 never does).
            exchanged = [rec.bytes for rec in counter.records if rec.kind == "all_to_all"]
            out[name]["exchange_bytes"] = 2 * max(exchanged, default=0)
            clean(p)
    return out


# ------------------------------------------------------------------------------------------------------ report


def summarize(per_rank: List[Dict[str, Any]], cfg: DcpConfig) -> Dict[str, Any]:
    """Medians of the slowest rank's times; the highest rank's peaks; the goals' ratios."""
    result: Dict[str, Any] = {"peers": {}}
    for name in PEERS:
        slowest_save = [max(r[name]["save_s"][i] for r in per_rank) for i in range(cfg.repeats)]
        slowest_load = [max(r[name]["load_s"][i] for r in per_rank) for i in range(cfg.repeats)]
        cpu = {
            op: statistics.median([max(r[name][f"{op}_cpu_s"][i] for r in per_rank) for i in range(cfg.repeats)])
            for op in ("save", "load")
        }
        result["peers"][name] = {
            "save_s": statistics.median(slowest_save),
            "load_s": statistics.median(slowest_load),
            "save_cpu_s": cpu["save"],
            "load_cpu_s": cpu["load"],
            "save_s_all": slowest_save,
            "load_s_all": slowest_load,
            "save_peak_mb": max(max(r[name]["save_peak_bytes"]) for r in per_rank) / MB,
            "load_peak_mb": max(max(r[name]["load_peak_bytes"]) for r in per_rank) / MB,
            "shards_mb": max(r[name]["shard_bytes"] for r in per_rank) / MB,
            "state_dict_mb": max(r[name]["state_dict_bytes"] for r in per_rank) / MB,
            "exchange_buffers_mb": max(r[name]["exchange_bytes"] for r in per_rank) / MB,
        }
    fs, f2 = result["peers"]["fairscale"], result["peers"]["fsdp2"]
    unit_mb = max(r["largest_unit_bytes"] for r in per_rank) / MB
    result["largest_unit_mb"] = unit_mb
    result["save_time_ratio"] = fs["save_s"] / f2["save_s"]
    result["load_time_ratio"] = fs["load_s"] / f2["load_s"]
    result["save_cpu_ratio"] = fs["save_cpu_s"] / f2["save_cpu_s"]
    result["load_cpu_ratio"] = fs["load_cpu_s"] / f2["load_cpu_s"]
    result["save_extra_over_fsdp2_beyond_copies_mb"] = fs["save_peak_mb"] - f2["save_peak_mb"] - fs["state_dict_mb"]
    result["load_extra_over_fsdp2_beyond_copies_mb"] = fs["load_peak_mb"] - f2["load_peak_mb"] - fs["state_dict_mb"]
    return result


def format_table(result: Dict[str, Any], cfg: DcpConfig) -> str:
    peers = result["peers"]
    lines = [
        f"dcp: GPT {cfg.layers}x{cfg.hidden} (vocab {cfg.vocab}), Adam, {cfg.world_size} ranks, "
        f"median of {cfg.repeats} (slowest rank); memory: peak C heap above the call's start, highest rank",
        f"{'peer':<10} {'save s':>7} {'(cpu)':>6} {'load s':>7} {'(cpu)':>6} {'save peak MB':>13} {'load peak MB':>13} "
        f"{'shards MB':>10} {'state dict MB':>14}",
    ]
    for name in PEERS:
        p = peers[name]
        lines.append(
            f"{name:<10} {p['save_s']:>7.3f} {p['save_cpu_s']:>6.2f} {p['load_s']:>7.3f} {p['load_cpu_s']:>6.2f} "
            f"{p['save_peak_mb']:>13.1f} {p['load_peak_mb']:>13.1f} {p['shards_mb']:>10.1f} {p['state_dict_mb']:>14.1f}"
        )
    lines.append(
        f"fairscale/fsdp2 wall time: save {result['save_time_ratio']:.2f}x, load {result['load_time_ratio']:.2f}x; "
        f"cpu time: save {result['save_cpu_ratio']:.2f}x, load {result['load_cpu_ratio']:.2f}x"
    )
    lines.append(
        f"largest unit (full fp32 params) {result['largest_unit_mb']:.1f} MB; fairscale's extra over FSDP2 beyond "
        f"its state-dict copies: save {result['save_extra_over_fsdp2_beyond_copies_mb']:.1f} MB, load "
        f"{result['load_extra_over_fsdp2_beyond_copies_mb']:.1f} MB; its largest exchange (send + receive "
        f"buffers) {peers['fairscale']['exchange_buffers_mb']:.1f} MB"
    )
    return "\n".join(lines)


def run(argv: Sequence[str]) -> int:
    """Run the scenario with the command line ``argv``; returns the exit code."""
    cfg = parse_args(argv)
    problem = fsdp2_cpu_problem()
    if problem is not None:  # every row of this scenario is measured side by side with FSDP2's
        print(f"the dcp scenario compares with FSDP2, and {problem}; nothing was measured", file=sys.stderr)
        return 2
    directory = cfg.directory or tempfile.mkdtemp(prefix="dcp_benchmark_")
    os.makedirs(directory, exist_ok=True)
    try:
        per_rank = run_function(_rank_body, cfg.world_size, cfg, directory, timeout=cfg.timeout)
    finally:
        if not cfg.directory:
            shutil.rmtree(directory, ignore_errors=True)
    result = summarize(per_rank, cfg)
    result["config"] = dataclasses.asdict(cfg)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "memory_method": f"{HEAP_METHOD_PREFIX} (peak sampled above the call's start)",
    }
    print(format_table(result, cfg))
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
