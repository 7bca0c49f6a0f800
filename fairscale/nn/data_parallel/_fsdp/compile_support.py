# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``torch.compile`` around FSDP instances: their forward runs outside the compiler.

What compiles with FSDP are the modules inside a unit, compiled before wrapping (``block = torch.compile(block)``,
then ``FSDP(block)``): FSDP hands them its gathered parameters as ordinary tensors. FSDP's own forward cannot be
traced: it swaps each flat parameter's data between its shard and the gathered full tensor (the compiler saw a
parameter of one size with a gradient of another, or a version counter bumped behind its back), and the first
forward gathers Python objects across ranks. ``torch.compile(fsdp_model)`` failed with the compiler's internal errors
("UnsafeScriptObjectError", "expected size 110==55"). Now the compiler leaves every FSDP forward to eager Python (a
graph break), so such a model trains as without the compiler, and one warning says where compiling pays.
"""

import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from . import runtime
from .unit import FSDPUnit

_warned = False


def _dynamo_is_compiling() -> bool:  # torch < 2.3 has no torch.compiler.is_compiling
    return bool(torch._dynamo.is_compiling())


# Asked at every FSDP forward: resolved once.
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or _dynamo_is_compiling


def _eager_forward(unit: FSDPUnit, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "torch.compile reached a FullyShardedDataParallel instance: FSDP's forward runs outside the compiler, "
            "and so does every module it wraps unless that module was compiled itself. Compile the blocks before "
            "wrapping them (block = torch.compile(block); FSDP(block)) to get compiled code.",
            UserWarning,
            stacklevel=2,
        )
    return runtime.forward(unit, args, kwargs)


_outside_compiler: Optional[Callable[..., Any]] = None


def _forward_outside_compiler() -> Callable[..., Any]:
    """``_eager_forward`` hidden from the compiler, made at first use: wrapping it imports the compiler (seconds),
    which a run that never compiles should not pay. Recursive: nothing below FSDP's forward is traced from the outer
    compiled frame (a module compiled on its own still runs its compiled code)."""
    global _outside_compiler
    if _outside_compiler is None:
        _outside_compiler = torch.compiler.disable(_eager_forward)  # type: ignore[no-untyped-call,unused-ignore]
    return _outside_compiler


def forward(unit: FSDPUnit, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """FSDP's forward; under the compiler's tracing, a call it does not trace."""
    if _compiling():
        return _forward_outside_compiler()(unit, args, kwargs)
    return runtime.forward(unit, args, kwargs)
