# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The collectives layer: the only package of fairscale that calls ``torch.distributed`` collectives.

Callers pass plain tensors and a process group (``None`` = the default world group) and get the
same behaviour on every backend and supported torch version:

* all-gather into, and reduce-scatter from, one flat buffer of any shape (gloo rejects 2-D
  inputs to the tensor variants, so buffers are viewed as 1-D before they reach torch);
* torch's newest public name of each collective, and when a backend rejects a variant
  (no tensor reduce-scatter, no bf16/fp16 support ...) a fallback chosen once per
  ``(backend, collective, dtype)``: list variants, all-reduce-and-slice, or an fp32 wire format
  that is cast back to the caller's dtype;
* world size 1 (including no ``torch.distributed`` initialisation at all) as local copies;
* an opt-in :func:`count_collectives` counter recording every logical call once (kind, group,
  dtype, bytes, phase), however many torch calls a fallback needed (it lives in
  :mod:`fairscale.internal.collective_counter` and is re-exported here).

Every ``torch.distributed`` function is looked up on the module at call time (``dist.<fn>(...)``, never bound at
import), so that tests and tools that patch ``torch.distributed.<fn>`` see every call.

One concept per module, each importing only downward (``work`` and ``groups`` at the bottom, then ``recording``,
``checks`` and ``dispatch``, then the collectives themselves): ``work`` (:class:`WorkHandle`), ``groups`` (group
sizes, ranks, membership), ``recording`` (counter and simulated link), ``checks`` (argument checks), ``dispatch``
(torch function lookup, fallback strategies), ``flat`` (all-gather / reduce-scatter of flat buffers), ``inplace``
(all-reduce, broadcast, reduce), ``all_to_all``, ``objects`` (object collectives, barrier), ``p2p`` (send / recv,
and the group that carries them), ``store`` (decisions through the default group's rendezvous store) and ``shutdown``
(what happens at interpreter exit). Import the names from this package; the modules are its layout, not its API.
"""

# First, so that its exit handler runs last (atexit runs handlers in reverse): after the other modules' caches let go.
from . import shutdown as _shutdown  # noqa: F401,E402  # registers the exit handler (see its docstring)
from ..collective_counter import CollectiveCounter, CollectiveRecord, collective_phase, count_collectives
from .all_to_all import all_to_all_single
from .flat import all_gather_into_flat, reduce_scatter_from_flat
from .groups import (
    group_backend,
    group_destroyed,
    group_identity,
    group_leader,
    group_order,
    group_rank,
    group_ranks,
    group_size,
)
from .inplace import all_reduce, broadcast, reduce
from .objects import all_gather_object, barrier, broadcast_object_list
from .p2p import checked_by_torch, irecv, isend, p2p_group, p2p_group_retired, recv, send
from .store import decide_through_store
from .work import WorkHandle

# Private names that tests use (one live object each: ``_chosen`` is the dispatch module's dict, mutated in place).
from .dispatch import _chosen as _chosen
from .dispatch import _dispatch as _dispatch
from .dispatch import _force_strategy as _force_strategy
from .groups import _GroupInfo as _GroupInfo

__all__ = [
    "CollectiveRecord",
    "CollectiveCounter",
    "count_collectives",
    "collective_phase",
    "WorkHandle",
    "all_gather_into_flat",
    "reduce_scatter_from_flat",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "barrier",
    "decide_through_store",
    "group_size",
    "group_backend",
    "group_destroyed",
    "group_rank",
    "group_ranks",
    "group_leader",
    "group_order",
    "group_identity",
    "reduce",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "p2p_group",
    "p2p_group_retired",
    "checked_by_torch",
]
