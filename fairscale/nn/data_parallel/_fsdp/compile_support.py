# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``torch.compile`` around FSDP instances: their forward runs outside the compiler.

What compiles with FSDP are the modules inside a unit, compiled before wrapping (``block = torch.compile(block)``,
then ``FSDP(block)``): FSDP hands them its gathered parameters as ordinary tensors. FSDP's own forward cannot be
traced: it swaps each flat parameter's data between its shard and the gathered full tensor (the compiler saw a
parameter of one size with a gradient of another, or a version counter bumped behind its back), and the first
forward gathers Python objects across ranks. ``torch.compile(fsdp_model)`` failed with the compiler's internal errors
("UnsafeScriptObjectError", "expected size 110==55"). Now the compiler leaves every FSDP forward to eager Python (a
graph break, :mod:`fairscale.internal.compiler`), so such a model trains as without the compiler, and one warning
says where compiling pays.
"""

from typing import Any, Dict, Protocol, Tuple

from fairscale.internal.compiler import call_outside_compiler

from . import runtime
from .unit import FSDPUnit

_WARNING = (
    "torch.compile reached a FullyShardedDataParallel instance: FSDP's forward runs outside the compiler, and so does "
    "every module it wraps unless that module was compiled itself. Compile the blocks before wrapping them "
    "(block = torch.compile(block); FSDP(block)) to get compiled code."
)


class _HasUnit(Protocol):
    @property
    def _fsdp_unit(self) -> FSDPUnit: ...


def _forward_of(front: _HasUnit, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return runtime.forward(front._fsdp_unit, args, kwargs)


def forward_outside_compiler(front: _HasUnit, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """FSDP's forward as a call the compiler does not trace (the caller checked that it is tracing).

    Takes the front module, not its unit: even the lookup of the unit (``self.__dict__[...]`` in a property) stays out
    of the compiler, whose tracing of it recursed without end on torch 2.6.
    """
    return call_outside_compiler(_forward_of, front, args, kwargs, warning=_WARNING)
