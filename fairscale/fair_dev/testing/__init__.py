# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Test tooling: the multi-process engine (re-exported here on first use) and upstream's helpers in ``.testing``."""

from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # imported on first use below: the engine needs pytest, the package's other modules do not
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


def __getattr__(name: str) -> Any:
    # Lazily, so that importing a module of this package (golden_testing_data, testing_memory, also under their old
    # fairscale.utils names) does not need pytest, which only the engine uses.
    if name in __all__:
        try:
            from . import engine
        except ImportError as e:  # an AttributeError, so that hasattr() and getattr(..., default) work as usual
            raise AttributeError(f"{__name__}.{name} needs pytest ({e}); pip install pytest") from e
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
