# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The pieces of ``benchmarks/fsdp.py``, one concept per module.

config (options), corpus (embedded data), model (GPT and sharding units), peers (fairscale, FSDP2, FSDP1, DDP),
measure (timed loop and probe run), probes (collective spy, profiler analysis), link (simulated link for every
peer), formula (expected collectives and cost model), cluster (step time on N nodes with and without overlap),
results (per-run records and comparisons), sections (feature sections and targets), report (text and JSON), plot
(PNG), progress (progress bar), runner (what a rank does), launch (starting ranks), main (entry point).
"""
