# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The latency scenario's instruments: Python calls per step, and the collectives layer's cost per call.

On a model whose compute is negligible (``--latency-layers`` tiny blocks, each its own unit) a training step costs
what the data-parallel wrapper does per unit and per collective: the regime where an accelerator waits for the CPU.
Step time alone mixes that cost with the wait for the other rank, so the scenario also reports:

* CPU time per step (``time.process_time``: every thread of the rank, gloo's included; and ``time.thread_time`` of
  the rank's own thread), from the timed loop (:mod:`.measure`);
* Python calls per step, from one step under ``cProfile`` (:func:`count_python_calls`): a count, so it does not
  depend on the load of the machine;
* the collectives layer's overhead per call (:func:`collective_overhead`): ``fairscale.internal.collectives``
  against the raw ``torch.distributed`` call it makes, for a 1-element all-reduce at the world's size, with the
  collective counter off (the default) and on. Measured twice: with real communication (wall and thread CPU time
  per call, which include the other rank's scheduling) and on a group of torch's "fake" backend, which runs
  torch's whole call path without communicating: the difference is the layer's own cost, not affected by the
  other rank.
"""

import cProfile
import pstats
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from fairscale.internal import collectives

__all__ = ["count_python_calls", "collective_overhead", "latency_section", "latency_text"]


def count_python_calls(fn: Callable[[], None]) -> Dict[str, int]:
    """Run ``fn`` under ``cProfile``; returns ``{"python": calls of Python functions, "all": with C builtins}``."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    stats: Dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    python = sum(nc for (filename, _, _), (_, nc, _, _, _) in stats.items() if filename != "~")
    return {"python": int(python), "all": int(sum(nc for (_, nc, _, _, _) in stats.values()))}


def _quartiles(values: List[float]) -> List[float]:
    if len(values) < 2:
        return [values[0]] * 3
    q = statistics.quantiles(values, n=4)
    return [q[0], statistics.median(values), q[2]]


def _time_calls(call: Callable[[], Any], calls: int) -> Dict[str, float]:
    """Seconds per call of ``call`` (wall and this thread's CPU) over ``calls`` calls."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        call()
    return {"wall": (time.perf_counter() - w0) / calls, "cpu": (time.thread_time() - c0) / calls}


def _spin(seconds: float) -> None:
    """Busy-wait (CPU, not sleep) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def collective_overhead(calls: int = 1000, repeats: int = 5) -> Dict[str, Any]:
    """Cost per call of fairscale's collectives layer above the raw ``torch.distributed`` call (every rank runs it).

    Real communication: blocks of ``calls`` 1-element all-reduces over the default group, raw
    (``dist.all_reduce(t)``), through the layer (``collectives.all_reduce(t)``) and through the layer with a
    collective counter open, in turn (the order rotating every repeat, a barrier before each block); medians over
    ``repeats`` blocks, and raw after 10 us of busy CPU per call (what 10 us costs on this machine). Dispatch only:
    the same calls, and an all-gather and a reduce-scatter into flat buffers (what FSDP issues), on a group of
    torch's "fake" backend (the whole torch call, no communication), timed by rank 0 alone in 4x as many blocks of
    2x the calls, the variants alternating; the best block of each (as ``timeit``: load from other processes only
    ever adds time). Only rank 0's figures are meaningful for this part.

    Returns:
        ``{"world_size", "calls", "repeats", "real": {variant: {"wall_us", "cpu_us": [p25, p50, p75]}},
        "dispatch_only": {collective: {"raw_us", "ours_us", "ours_counted_us", "overhead_us"}},
        "overhead_us": {"wall", "cpu", "dispatch_only"}}`` (the layer minus raw, counter off).
    """
    world = collectives.group_size()
    t = torch.ones(1)

    # The counter stays open over the whole block, as in a benchmark step (opening it per call would time the
    # context manager, not the recording).
    def raw_plus_10us() -> None:
        _spin(10e-6)
        dist.all_reduce(t)

    # raw_plus_10us calibrates the machine: what 10 us more CPU per call does to the wall time here. On a shared
    # machine with fewer cores than busy threads it costs far more than 10 us (the peer waits for a rank that lost
    # its core), so the wall-time difference between ours and raw only means something next to it.
    variants: Dict[str, Callable[[], Any]] = {
        "raw": lambda: dist.all_reduce(t),
        "ours": lambda: collectives.all_reduce(t),
        "ours_counted": lambda: collectives.all_reduce(t),
        "raw_plus_10us": raw_plus_10us,
    }
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            collectives.barrier()
            if name == "ours_counted":
                with collectives.count_collectives():
                    samples[name].append(_time_calls(variants[name], calls))
            else:
                samples[name].append(_time_calls(variants[name], calls))
    real = {
        name: {
            "wall_us": [v * 1e6 for v in _quartiles([s["wall"] for s in got])],
            "cpu_us": [v * 1e6 for v in _quartiles([s["cpu"] for s in got])],
        }
        for name, got in samples.items()
    }
    dispatch = _dispatch_only(calls * 2, repeats * 4)
    return {
        "world_size": world,
        "calls": calls,
        "repeats": repeats,
        "real": real,
        "dispatch_only": dispatch,
        "overhead_us": {
            "wall": real["ours"]["wall_us"][1] - real["raw"]["wall_us"][1],
            "cpu": real["ours"]["cpu_us"][1] - real["raw"]["cpu_us"][1],
            "dispatch_only": dispatch["all_reduce"]["overhead_us"] if "all_reduce" in dispatch else None,
            # The worst of the three: FSDP's calls are the flat all-gather and reduce-scatter.
            "dispatch_only_max": max(
                (row["overhead_us"] for kind, row in dispatch.items() if kind != "method"), default=None
            ),
        },
    }


def _fake_group() -> Any:
    """A group of every rank on torch's "fake" backend, whose collectives complete at once without communicating
    (``None`` where this torch has none). Collective: every rank creates it."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError:
        return None
    return dist.new_group(ranks=list(range(dist.get_world_size())), backend="fake")


def _dispatch_only(calls: int, repeats: int) -> Dict[str, Any]:
    """Seconds per call of the layer and of the raw torch call on a group that does not communicate.

    torch's "fake" backend runs the whole torch.distributed call path (its Python checks, the op dispatch, the
    process group) and completes at once: the difference is what the layer adds, whatever the other rank does.
    """
    group = _fake_group()
    if group is None:
        return {"method": "unavailable (this torch has no fake process group backend)"}
    world = collectives.group_size(group)
    t = torch.ones(1)
    shard, full = torch.ones(4), torch.ones(4 * world)
    # What the layer calls for flat buffers: torch's newest name of each.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    cases: Dict[str, Dict[str, Callable[[], Any]]] = {
        "all_reduce": {
            "raw": lambda: dist.all_reduce(t, group=group),
            "ours": lambda: collectives.all_reduce(t, group=group),
        },
        "all_gather": {
            "raw": lambda: gather(full, shard, group=group),
            "ours": lambda: collectives.all_gather_into_flat(full, shard, group=group),
        },
        "reduce_scatter": {
            "raw": lambda: scatter(shard, full, group=group),
            "ours": lambda: collectives.reduce_scatter_from_flat(shard, full, group=group),
        },
    }
    out: Dict[str, Any] = {
        "method": "torch's fake process group (no communication), rank 0 alone, best of alternating blocks"
    }
    if dist.get_rank() == 0:  # the others wait at the barrier below: two ranks timing at once share the cores
        for kind, fns in cases.items():
            fns["ours"]()  # the first call picks the strategy (once per backend, kind and dtype)
            got: Dict[str, List[float]] = {"raw": [], "ours": [], "ours_counted": []}
            for _ in range(repeats):
                got["raw"].append(_time_calls(fns["raw"], calls)["wall"])
                got["ours"].append(_time_calls(fns["ours"], calls)["wall"])
                with collectives.count_collectives():
                    got["ours_counted"].append(_time_calls(fns["ours"], calls)["wall"])
            best = {name: min(v) * 1e6 for name, v in got.items()}
            out[kind] = {
                "raw_us": best["raw"],
                "ours_us": best["ours"],
                "ours_counted_us": best["ours_counted"],
                "overhead_us": best["ours"] - best["raw"],
            }
    collectives.barrier()
    return out


def latency_section(records: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Per peer of the latency scenario: step time, CPU per step and per unit, c10d calls, Python calls per unit."""
    runs = [r for r in records if r["scenario"] == "latency" and not r.get("skipped")]
    if not runs:
        return None
    rows: Dict[str, Dict[str, Any]] = {}
    for r in runs:
        units = r["units"]
        calls = r.get("python_calls_per_step") or {}
        rows[r["label"]] = {
            "units": units,
            "median_step_s": r["median_step_s"],
            "step_s_quartiles": r["step_s_quartiles"],
            "median_cpu_s": r["median_cpu_s"],
            "cpu_s_quartiles": r["cpu_s_quartiles"],
            "median_thread_cpu_s": r["median_thread_cpu_s"],
            "cpu_s_per_unit": r["median_cpu_s"] / units,
            "thread_cpu_s_per_unit": r["median_thread_cpu_s"] / units,
            "c10d_calls_per_step": r["c10d_calls_per_step"],
            "python_calls_per_step": calls.get("python"),
            "python_calls_per_unit": calls["python"] / units if calls else None,
            "all_calls_per_unit": calls["all"] / units if calls else None,
        }
    fs = next((r for r in runs if r["peer"] == "fairscale"), None)
    first = runs[0]
    model = (
        f"{first['units'] - 1} blocks of a {first['hidden']}x{first['hidden']} linear, each its own unit, + root; "
        f"{first['tokens_per_step_per_rank']} tokens per rank per step, {len(first['step_s']) - first['warmup']} "
        "timed steps"
    )
    out: Dict[str, Any] = {
        "model": model,
        "runs": rows,
        "collective_overhead": fs.get("collective_overhead") if fs else None,
    }
    peer = rows.get("fsdp2 raf=True")
    mine = rows.get("fairscale raf=True")
    if mine is not None and peer is not None:
        out["cpu_ratio_fairscale_fsdp2"] = mine["median_cpu_s"] / peer["median_cpu_s"]
        out["thread_cpu_ratio_fairscale_fsdp2"] = mine["median_thread_cpu_s"] / peer["median_thread_cpu_s"]
    return out


def latency_text(section: Dict[str, Any]) -> str:
    """The latency scenario's table, and the collectives layer's overhead per call."""
    lines = [
        f"latency: CPU cost per step, per unit and per collective ({section['model']})",
        f"  {'run':<24} {'step ms':>8} {'(p25-p75)':>11} {'CPU ms':>7} {'own ms':>7} {'CPU us/unit':>11} "
        f"{'own us/unit':>11} {'c10d/step':>9} {'py calls/unit':>13}",
    ]
    for label, row in section["runs"].items():
        q = row["step_s_quartiles"]
        calls = row["python_calls_per_unit"]
        lines.append(
            f"  {label:<24} {row['median_step_s'] * 1e3:8.2f} {q[0] * 1e3:5.1f}-{q[2] * 1e3:<5.1f} "
            f"{row['median_cpu_s'] * 1e3:7.2f} {row['median_thread_cpu_s'] * 1e3:7.2f} "
            f"{row['cpu_s_per_unit'] * 1e6:11.1f} {row['thread_cpu_s_per_unit'] * 1e6:11.1f} "
            f"{row['c10d_calls_per_step']:9d} {'-' if calls is None else f'{calls:13.1f}':>13}"
        )
    units = next(iter(section["runs"].values()))["units"]
    lines.append(
        f"  ({units} units; CPU = process time, every thread; own = the rank's thread; c10d = collectives per step "
        "seen by the dispatch spy; py calls = Python function calls per step from cProfile, per unit)"
    )
    if "cpu_ratio_fairscale_fsdp2" in section:
        lines.append(
            f"  CPU per step fairscale/fsdp2: {section['cpu_ratio_fairscale_fsdp2']:.3f}x "
            f"(own thread {section['thread_cpu_ratio_fairscale_fsdp2']:.3f}x)"
        )
    co = section.get("collective_overhead")
    if co:
        real, dispatch = co["real"], co["dispatch_only"]
        lines.append(
            f"  collectives layer, 1-element all_reduce at world size {co['world_size']}, {co['calls']} calls x "
            f"{co['repeats']} (median us per call):"
        )
        for name in ("raw", "ours", "ours_counted", "raw_plus_10us"):
            lines.append(
                f"    {name:<13} wall {real[name]['wall_us'][1]:8.1f}  thread CPU {real[name]['cpu_us'][1]:7.1f}"
            )
        lines.append(
            f"    overhead of the layer (counter off): wall {co['overhead_us']['wall']:+.1f}, thread CPU "
            f"{co['overhead_us']['cpu']:+.1f} (raw_plus_10us: what 10 us of CPU per call costs on this machine)"
        )
        lines.append(f"    dispatch only, us per call ({dispatch['method']}):")
        for kind, row in dispatch.items():
            if kind == "method":
                continue
            lines.append(
                f"    {kind:<15} raw {row['raw_us']:6.2f}  ours {row['ours_us']:6.2f}  counted "
                f"{row['ours_counted_us']:6.2f}  overhead {row['overhead_us']:+6.2f}"
            )
    return "\n".join(lines)
