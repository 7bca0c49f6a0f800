# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Turn the per-rank measurements of each run into one record, then compare runs and check the targets.

Conventions: the step time of a step is the slowest rank's; a run's step time is the median over its timed steps
(warmup excluded). Memory is per rank. Collectives per step come from fairscale's counter for fairscale runs and
from the c10d spy of the probe step for every run (the two must agree for fairscale).
"""

import statistics
from typing import Any, Dict, List, Optional

import torch

from .config import BenchConfig
from .formula import compare, zero3_per_step
from .heap import HEAP_METHOD_PREFIX
from .model import build_model, unit_param_numels, wrap_plan
from .peers import DTYPES, RunSpec
from .probes import cat_count, split_backward_count

#: Loss curves of two runs match when every step differs by at most ``atol + rtol * |loss|``.
LOSS_TOLERANCE = {"none": (1e-4, 1e-4), "bf16": (5e-2, 2e-2), "fp16": (2e-2, 1e-2)}


def _rank_summary(values: List[Optional[int]], method: str, steady: bool = False) -> Optional[int]:
    """One rank's figure for a run whose ranks hold equal shards.

    A sampled C heap can only miss a short peak, never invent one: for a peak, the largest rank's value. The steady
    figure is one reading at the end of a step, which a buffer that torch has not released yet can inflate on one
    rank (on torch 2.1.2, gloo's worker thread sometimes still held a gathered-parameter buffer there): the median
    rank's value. The profiler's allocator events can only inflate a rank's figure (see probes.py): the smallest
    rank's value.
    """
    known = [v for v in values if v is not None]
    if not known:
        return None
    if not method.startswith(HEAP_METHOD_PREFIX):
        return min(known)
    return int(statistics.median_low(known)) if steady else max(known)


def spec_fields(spec: RunSpec) -> Dict[str, Any]:
    """The run's identity, as stored in the JSON."""
    return {
        "key": spec.key,
        "scenario": spec.scenario,
        "peer": spec.peer,
        "label": spec.label,
        "config": spec.config_label,
        "reshard_after_forward": spec.reshard,
        "microbatches": spec.microbatches,
        "optimize_backward_concat": spec.optimize_backward_concat if spec.peer == "fairscale" else None,
        "hybrid": spec.hybrid,
        "floor": spec.floor,
    }


def skipped_record(spec: RunSpec, reason: str) -> Dict[str, Any]:
    """A run that did not run, and why."""
    return {**spec_fields(spec), "skipped": reason}


def expected_collectives(spec: RunSpec, cfg: BenchConfig, world_size: int) -> Optional[Dict[str, Dict[str, int]]]:
    """The ZeRO-3 formula of a fairscale run (``None`` for the peers: each pads and groups its own way, e.g. FSDP2
    pads every parameter along dim 0 and gathers a unit in one call, so their bytes are only reported)."""
    if spec.peer != "fairscale":
        return None
    model = build_model(cfg, torch.device("cpu"))
    units = unit_param_numels(model, wrap_plan(cfg, model))
    dtype = DTYPES[cfg.mixed_precision] or torch.float32
    element = torch.empty((), dtype=dtype).element_size()
    # Hybrid sharding shards over one node (then all-reduces the shards across nodes, which the formula leaves out).
    shard_size = cfg.hybrid_ranks_per_node if spec.hybrid else world_size
    return zero3_per_step(units, shard_size, spec.reshard, spec.microbatches, element, cfg.flatten)


def count_units(cfg: BenchConfig) -> int:
    """Sharding units of the configuration: the wrapped submodules and the root."""
    return len(wrap_plan(cfg, build_model(cfg, torch.device("cpu")))) + 1


def _quartiles(values: List[float]) -> List[float]:
    """25th, 50th and 75th percentiles (the median itself when there are fewer than 2 values)."""
    if len(values) < 2:
        return [values[0]] * 3
    q = statistics.quantiles(values, n=4)
    return [q[0], statistics.median(values), q[2]]


def aggregate(spec: RunSpec, cfg: BenchConfig, world_size: int, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One run's record from every rank's ``{"timed": ..., "probe": ...}``."""
    timed = [r["timed"] for r in ranks]
    probe = [r["probe"] for r in ranks]
    steps = len(timed[0]["step_s"])
    step_s = [max(t["step_s"][i] for t in timed) for i in range(steps)]
    window_s = [max(t["window_s"][i] for t in timed) for i in range(steps)]
    loss = [statistics.fmean(t["loss"][i] for t in timed) for i in range(steps)]
    timed_steps = slice(min(cfg.warmup, steps - 1), steps)
    median_step = statistics.median(step_s[timed_steps])
    # CPU time per step: the ranks hold equal shards and run the same code; the busiest rank's, like step time.
    cpu_s = [max(t["cpu_s"][i] for t in timed) for i in range(steps)]
    thread_cpu_s = [max(t["thread_cpu_s"][i] for t in timed) for i in range(steps)]
    tokens = cfg.tokens_per_microbatch * spec.microbatches
    counter = timed[0]["collectives"][timed_steps]
    ops = probe[0]["backward_ops"]
    expected = expected_collectives(spec, cfg, world_size)
    peaks = [p["memory"]["peak_bytes"] if p["memory"] else None for p in probe]
    steadies = [p["memory"]["steady_bytes"] if p["memory"] else None for p in probe]
    measured = counter[-1] if spec.peer == "fairscale" else probe[0]["spy"]
    diffs = compare(measured, expected) if expected is not None else None
    record = {
        **spec_fields(spec),
        "skipped": None,
        "world_size": world_size,
        "how": timed[0]["notes"],
        "tokens_per_step_per_rank": tokens,
        "loss": loss,
        "step_s": step_s,
        "window_s": window_s,
        "step_s_per_rank": [t["step_s"] for t in timed],
        "median_step_s": median_step,
        # Spread of the timed steps: on a shared machine the ratios are only as good as this.
        "step_s_quartiles": _quartiles(step_s[timed_steps]),
        "median_window_s": statistics.median(window_s[timed_steps]),
        "window_s_quartiles": _quartiles(window_s[timed_steps]),
        "cpu_s": cpu_s,
        "median_cpu_s": statistics.median(cpu_s[timed_steps]),
        "cpu_s_quartiles": _quartiles(cpu_s[timed_steps]),
        "thread_cpu_s": thread_cpu_s,
        "median_thread_cpu_s": statistics.median(thread_cpu_s[timed_steps]),
        "units": count_units(cfg),
        "hidden": cfg.hidden,
        "warmup": min(cfg.warmup, steps - 1),
        "c10d_calls_per_step": sum(entry["count"] for entry in probe[0]["spy"].values()),
        "python_calls_per_step": probe[0].get("calls"),
        "median_optimizer_s": statistics.median([s - w for s, w in zip(step_s, window_s)][timed_steps]),
        "tokens_per_s_per_rank": tokens / median_step,
        "tokens_per_s_total": tokens * world_size / median_step,
        "peak_memory_bytes_per_rank": peaks,
        "steady_memory_bytes_per_rank": steadies,
        # The ranks hold equal shards; one figure per run: see _rank_summary for which rank's.
        "peak_memory_bytes": _rank_summary(peaks, probe[0]["memory_method"]),
        "steady_memory_bytes": _rank_summary(steadies, probe[0]["memory_method"], steady=True),
        "memory_method": probe[0]["memory_method"],
        "collectives_source": "fairscale collective counter" if spec.peer == "fairscale" else "c10d dispatch spy",
        "collectives_per_step": measured,
        "counter_per_step": counter[-1] if spec.peer == "fairscale" else None,
        "counter_constant_across_steps": all(c == counter[-1] for c in counter) if spec.peer == "fairscale" else None,
        "spy_per_step": probe[0]["spy"],
        # Rank 0's collectives per group (key "kind/phase/ranks=..."): groups of one size told apart.
        "collectives_per_group": (
            timed[0]["collectives_by_ranks"] if spec.peer == "fairscale" else probe[0]["spy_by_ranks"]
        ),
        "formula_per_step": expected,
        "formula_differences": diffs,
        "formula_matches": (not diffs) if diffs is not None else None,
        "backward_ops_per_microbatch": ops,
        "cat_per_microbatch": [cat_count(o) for o in ops],
        "split_backward_per_microbatch": [split_backward_count(o) for o in ops],
    }
    return record


def add_comparisons(records: List[Dict[str, Any]], cfg: BenchConfig) -> None:
    """Per run: ratios to every other run of its scenario and configuration, and loss parity with the first run of
    its scenario (every run of a scenario trains the same model on the same data)."""
    atol, rtol = LOSS_TOLERANCE[cfg.mixed_precision]
    done = [r for r in records if not r.get("skipped")]
    for r in done:
        peers = [
            p
            for p in done
            if p is not r
            and p["scenario"] == r["scenario"]
            and (p["config"] == r["config"] or "replicated" in (p["config"], r["config"]))
        ]
        r["step_time_ratio"] = {p["label"]: r["median_step_s"] / p["median_step_s"] for p in peers}
        mine = r["peak_memory_bytes"]
        r["peak_memory_ratio"] = {
            p["label"]: mine / p["peak_memory_bytes"] for p in peers if mine is not None and p["peak_memory_bytes"]
        }
        reference = next(p for p in done if p["scenario"] == r["scenario"])
        diff = max(abs(a - b) for a, b in zip(r["loss"], reference["loss"]))
        ok = all(abs(a - b) <= atol + rtol * abs(b) for a, b in zip(r["loss"], reference["loss"]))
        r["loss_reference"] = reference["label"]
        r["loss_max_abs_diff"] = diff
        r["loss_matches"] = bool(ok and all(torch.isfinite(torch.tensor(r["loss"])).tolist()))
