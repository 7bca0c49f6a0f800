# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A plain parent module's ``load_state_dict`` that raised inside an FSDP instance: undo its half-done load.

When a parent module (not FSDP) loads a full state dict, torch calls each FSDP instance's load hooks around the
recursion into its children: the pre hook summons the full parameters (with a snapshot of the shards), the post hook
writes them back and closes the summon. An exception in between (a module whose ``_load_from_state_dict`` raises)
skips the post hook: the instance stayed in ``SUMMON_FULL_PARAMS`` with partly loaded full parameters, and every
later forward was refused. No torch hook runs when the exception leaves the parent's load, so the load is undone at
the next use of the instance instead: the summon is closed and the snapshot put back (the instance is as it was
before that load), with a warning. Every entry point (forward, ``state_dict``, ``load_state_dict``,
``summon_full_params``, ``apply``...) goes through lazy init, which calls :func:`undo_failed_parent_loads`.
"""

import warnings
import weakref
from typing import Any, Tuple

from .unit import FSDPUnit

# Instances whose parent-route load is open (between their pre and post load hooks). Nothing else runs FSDP entry
# points while a parent's load recurses through an instance's children, so one found open at an entry point is a
# load that raised.
_OPEN: "weakref.WeakSet[FSDPUnit]" = weakref.WeakSet()


class _LoadRaised(RuntimeError):
    """Thrown into the open load's contexts so that they restore their snapshot (it never reaches the user)."""


def opened(unit: FSDPUnit, contexts: Tuple[Any, Any]) -> None:
    """Record the (outer, inner) exit stacks of a parent-route load opened by the pre load hook."""
    unit.pending_load_summon = contexts
    _OPEN.add(unit)


def take(unit: FSDPUnit) -> Any:
    """The post load hook's side: the open contexts of ``unit`` (``None`` when none is open), now closed to others."""
    _OPEN.discard(unit)
    pending, unit.pending_load_summon = unit.pending_load_summon, None
    return pending


def undo_failed_parent_loads(unit: FSDPUnit) -> None:
    """Undo the open parent-route load of ``unit``'s tree, if one raised before its post hook (a no-op otherwise)."""
    if not _OPEN:
        return
    for opener in list(_OPEN):
        if opener._owner_ref is None or opener._owner_ref() is None:
            take(opener)  # its model is gone: nothing to undo
        elif opener is unit or any(u is unit for u in opener.tree_units()):
            _undo(opener)


def undo_own(unit: FSDPUnit) -> None:
    """Undo ``unit``'s own open parent-route load (its pre load hook runs again: the earlier load raised)."""
    if unit.pending_load_summon is not None:
        _undo(unit)


def _undo(unit: FSDPUnit) -> None:
    pending = take(unit)
    if pending is None:
        return
    outer, inner = pending
    raised = _LoadRaised("a parent module's load_state_dict raised inside this FSDP instance")
    try:
        try:
            inner.close()  # ends the summon (writes the partly loaded full parameters back into the shards)...
        finally:
            outer.__exit__(type(raised), raised, raised.__traceback__)  # ...which the snapshot then overwrites
    except _LoadRaised:
        pass
    warnings.warn(
        f"FullyShardedDataParallel ({unit.name}): a load_state_dict() of a module holding this instance raised "
        "before it finished; this instance's parameters and buffers were restored to what they were before that "
        "load (the other modules keep what torch loaded into them).",
        RuntimeWarning,
        stacklevel=4,
    )
