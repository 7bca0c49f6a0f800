# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Test tooling: the multi-process engine (re-exported here) and upstream's helpers in ``.testing``."""

from .engine import (
    DEFAULT_TIMEOUT,
    SEED,
    DistributedTestError,
    DistributedTestTimeout,
    run_cases,
    run_distributed,
    run_ranks,
    seed_everything,
    subtest,
    use_loopback_for_gloo,
    init_gloo_world,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "SEED",
    "DistributedTestError",
    "DistributedTestTimeout",
    "run_cases",
    "run_distributed",
    "run_ranks",
    "seed_everything",
    "subtest",
    "use_loopback_for_gloo",
    "init_gloo_world",
]
