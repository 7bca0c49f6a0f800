# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Calls that ``torch.compile`` must not trace: run as eager Python from inside a compiled region (a graph break).

fairscale's wrappers do things a compiler cannot trace faithfully: FSDP swaps its flat parameters' data between
shard and full tensor, ShardedDataParallel re-points parameters into OSS's broadcast buckets, Pipe runs micro-batches
on worker threads. Traced, such code failed inside the compiler or, worse, was captured as something else (the
parameters stopped being views of the buckets and the ranks drifted apart). Modules compiled on their own (the
blocks inside a wrapper) still run their compiled code when called from such an eager call.
"""

import warnings
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

__all__ = ["call_outside_compiler", "is_compiling"]


def _dynamo_is_compiling() -> bool:  # torch < 2.3 has no torch.compiler.is_compiling
    return bool(torch._dynamo.is_compiling())


#: Whether the compiler is tracing the caller (asked at every wrapped forward: resolved once).
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or _dynamo_is_compiling

_warned: Set[str] = set()
_eager: Optional[Callable[..., Any]] = None


def _eager_call(fn: Callable[..., Any], warning: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if warning and warning not in _warned:
        _warned.add(warning)
        warnings.warn(warning, UserWarning, stacklevel=2)
    return fn(*args, **kwargs)


def call_outside_compiler(fn: Callable[..., Any], *args: Any, warning: str = "", **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; while ``torch.compile`` traces the caller, run as a call it does not trace.

    Args:
        fn: the function.
        warning: said once per process (per text) the first time the compiler reaches the call ("" for nothing).

    Returns:
        What ``fn`` returns.
    """
    if not is_compiling():
        return fn(*args, **kwargs)
    global _eager
    if _eager is None:  # made at first use: wrapping imports the compiler, which a run without it should not pay
        _eager = torch.compiler.disable(_eager_call)  # type: ignore[no-untyped-call,unused-ignore]
    return _eager(fn, warning, args, kwargs)
