# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS's refusal to step a parameter unfrozen since its broadcast buckets were built."""

from typing import Any, Dict, List

from fairscale.internal.errors import FairscaleRuntimeError

from .buckets import Backing

__all__ = ["check_no_unfrozen_parameter"]


def check_no_unfrozen_parameter(backing: Backing, param_groups: List[Dict[str, Any]]) -> None:
    """Refuse to step a parameter unfrozen since the broadcast buckets were built (see :meth:`OSS.step`).

    Such a parameter is in no bucket: its owner would step it and no other rank would receive the new value, so
    the replicas would drift apart silently. A local check, one ``requires_grad`` read per parameter frozen at
    the last (re)build and no collective: ``requires_grad`` changes are made on every rank alike (the
    constructor, :meth:`OSS.refresh_trainable` and :meth:`OSS.add_param_group` check that the ranks agree), so every
    rank raises alike, before any communication of this step. A parameter frozen since stays in its bucket
    until the next rebuild, and is broadcast on its own after it while it has a gradient (the owner steps it).

    Raises:
        FairscaleRuntimeError: (also an ``AssertionError``) some parameter requires grad now but did not when the
            buckets were built; nothing is stepped then.
    """
    unfrozen = backing.unfrozen()
    if not unfrozen:
        return
    where = {
        id(p): f"group {g}, parameter {i}"
        for g, group in enumerate(param_groups)
        for i, p in enumerate(group["params"])
    }
    named = [f"{where.get(id(p), 'a parameter')} (shape {list(p.shape)})" for p in unfrozen]
    listed = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    raise FairscaleRuntimeError(
        f"OSS.step: {len(unfrozen)} parameter(s) were unfrozen (requires_grad False -> True) since the broadcast "
        f"buckets were built: {listed}. Their owner would update them and no other rank would receive the new "
        "values (the replicas would drift apart). Call optimizer.refresh_trainable() on every rank after "
        "changing requires_grad (ShardedDataParallel with auto_refresh_trainable=True does it at the forward)."
    )
