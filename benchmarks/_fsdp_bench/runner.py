# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What every rank of a world does: list the runs of its scenarios, run each, gather the results on rank 0."""

import dataclasses
import sys
from typing import Any, Dict, List

import torch

from fairscale.internal import collectives

from .config import BenchConfig, scenario_config
from .corpus import Corpus
from .latency import collective_overhead
from .measure import probe_run, timed_runs
from .peers import RunSpec, skip_reason
from .progress import ProgressBar, silent
from .results import aggregate, skipped_record


def specs_for(cfg: BenchConfig, scenario: str) -> List[RunSpec]:
    """The runs of one scenario, in the order they run and are reported."""
    if scenario in ("train", "latency"):
        specs = [
            RunSpec(scenario, peer, raf, cfg.microbatches, cfg.optimize_backward_concat and peer == "fairscale")
            for raf in cfg.reshard_after_forward
            for peer in cfg.compare
            if peer != "ddp"
        ]
        if "ddp" in cfg.compare:
            specs.append(RunSpec(scenario, "ddp", True, cfg.microbatches))
        return specs
    if scenario == "accum":
        raf = cfg.accum_reshard_after_forward
        specs = [RunSpec("accum", "fairscale", raf, cfg.accum_microbatches, obc) for obc in (False, True)]
        if "fsdp2" in cfg.compare:
            # The same window with FSDP2's own accumulation (set_requires_gradient_sync): the memory reference.
            specs.append(RunSpec("accum", "fsdp2", raf, cfg.accum_microbatches))
        return specs
    if scenario == "zero2":
        g = cfg.zero2_group_size
        specs = [
            RunSpec("zero2", "fairscale", True, cfg.microbatches),
            RunSpec("zero2", "fairscale", g, cfg.microbatches),
        ]
        if "fsdp2" in cfg.compare:
            specs += [RunSpec("zero2", "fsdp2", True, cfg.microbatches), RunSpec("zero2", "fsdp2", g, cfg.microbatches)]
        return specs
    if scenario == "hybrid":
        m = cfg.microbatches
        specs = [RunSpec("hybrid", "fairscale", True, m), RunSpec("hybrid", "fairscale", True, m, hybrid=True)]
        specs += [RunSpec("hybrid", peer, True, m, hybrid=True) for peer in ("fsdp2", "fsdp1") if peer in cfg.compare]
        # Full sharding without the link: the compute the cost model adds the modelled communication to.
        return specs + [RunSpec("hybrid", "fairscale", True, m, floor=True)]
    raise ValueError(f"unknown scenario {scenario!r}")


def run_world(
    cfg: BenchConfig, scenarios: List[str], rank: int, world_size: int, device: torch.device
) -> List[Dict[str, Any]]:
    """Run every scenario's runs on this rank; rank 0 returns the run records (other ranks an empty list)."""
    corpus = Corpus(cfg.vocab, cfg.seq_len, cfg.seed)
    records: List[Dict[str, Any]] = []
    # The world may be smaller or bigger than --world-size (the zero2 world, torchrun): record the real one.
    cfg = dataclasses.replace(cfg, world_size=world_size)
    for scenario in scenarios:
        if rank == 0:
            print(f"\n[{scenario}] world size {world_size}", flush=True)
        # The accum scenario has its own microbatch size (--accum-batch), the latency scenario its own model; their
        # records carry it in their config.
        scenario_cfg = scenario_config(cfg, scenario)
        specs = specs_for(scenario_cfg, scenario)
        skipped = {spec: skip_reason(spec, scenario_cfg) for spec in specs}
        runnable = [spec for spec in specs if skipped[spec] is None]
        label = f"{scenario}: {len(runnable)} runs in turn"
        progress = ProgressBar(label) if rank == 0 else silent
        timed = dict(zip(runnable, timed_runs(runnable, scenario_cfg, corpus, rank, world_size, device, progress)))
        if rank == 0 and runnable:
            print(f"probing memory, backward ops and collectives of {len(runnable)} runs (untimed) ...", flush=True)
        for spec in specs:
            reason = skipped[spec]
            if reason is not None:
                if rank == 0:
                    print(f"{spec.label:<30} skipped: {reason}", flush=True)
                    records.append(skipped_record(spec, reason))
                continue
            probe = probe_run(spec, scenario_cfg, corpus, rank, world_size, device)
            gathered = collectives.all_gather_object({"timed": timed[spec], "probe": probe})
            if rank == 0:
                records.append(aggregate(spec, scenario_cfg, world_size, gathered))
        if scenario == "latency":
            # The collectives layer's cost per call, in the same world (every rank takes part).
            if rank == 0:
                print(f"timing the collectives layer ({cfg.collective_calls} calls per block) ...", flush=True)
            overhead = collective_overhead(cfg.collective_calls)
            fs = next((r for r in records if r["scenario"] == "latency" and r["peer"] == "fairscale"), None)
            if rank == 0 and fs is not None and not fs.get("skipped"):
                fs["collective_overhead"] = overhead
    sys.stdout.flush()
    return records
