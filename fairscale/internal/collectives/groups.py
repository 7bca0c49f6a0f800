# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Process groups as the collectives see them: size, rank and ranks of a group, cached, and membership checks."""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

try:
    from torch.distributed import ProcessGroup as ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]


@dataclass(frozen=True)
class _GroupInfo:
    pg: Any  # what torch gets as ``group``; None when torch.distributed is not initialised
    size: int
    rank: int  # this process's rank inside the group, -1 if it is not a member
    ranks: Tuple[int, ...]  # global ranks, sorted
    backend: str
    # Whether this process may call collectives on the group (a member, and a real group if it has peers): decided
    # once here, so that every collective checks one attribute and only a refused call builds its error message.
    usable: bool = field(init=False, repr=False, compare=False)
    # A proxy's listener, told of every tensor all-gather on the group before it runs (see _build_group_info).
    on_all_gather: Optional[Callable[[Any, Any], None]] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "usable", self.rank >= 0 and not (self.size > 1 and self.backend == "dummy"))


_LOCAL_WORLD = _GroupInfo(pg=None, size=1, rank=0, ranks=(0,), backend="local")
# Group objects are long-lived (and not weak-referenceable), so a plain dict is the cache; it
# holds each group alive, which also rules out a recycled id() pointing at stale info.
_group_cache: Dict[Any, _GroupInfo] = {}
# Let go of the groups at exit, while the interpreter is whole (shutdown._release_at_exit): a group this cache still
# held was otherwise freed during interpreter finalization, where gloo now and then aborts the process.


# Whether torch was built with distributed support never changes in a process.
_AVAILABLE = dist.is_available()


def _dist_ready() -> bool:
    return _AVAILABLE and dist.is_initialized()


def _group_info(group: Optional[ProcessGroup]) -> _GroupInfo:
    if group is None:
        if not _AVAILABLE:
            return _LOCAL_WORLD
        # The default group, or None before init_process_group (what dist.is_initialized() tests), in one lookup.
        group = dist.GroupMember.WORLD
        if group is None:
            return _LOCAL_WORLD
    info = _group_cache.get(group)
    if info is None:
        info = _build_group_info(group)
        _forget_destroyed_groups()
        _group_cache[group] = info
    return info


def _forget_destroyed_groups() -> None:
    """Drop the entries of groups torch destroyed (``destroy_process_group``): held here, each kept its threads and
    sockets (gloo) for the rest of the process, so a sweep that re-initialises the world or makes a group per trial
    ran out of file descriptors (a leak fuzz, session 49). Run when a new group is first seen, which is rare."""
    for key, info in list(_group_cache.items()):
        if group_destroyed(info.pg):
            del _group_cache[key]


def group_destroyed(group: Any) -> bool:
    """Whether ``group`` is a process group that torch destroyed (``destroy_process_group``), so that whatever holds
    it for later use (a cache, a thread) should let it go. ``False`` for anything else (a stand-in, ``None``, or a
    torch too old to tell)."""
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return live is not None and isinstance(group, dist.ProcessGroup) and group not in live


def _build_group_info(group: Any) -> _GroupInfo:
    # A proxy of a real group (the memory tracker's ProcessGroupTracker, documented as FSDP's process_group to see
    # its all-gathers): the collectives run on the real group and tell the proxy's listener of each all-gather, as
    # upstream's proxy saw torch's calls. Looked up on the type: such proxies forward unknown attributes to the group.
    if callable(getattr(type(group), "fairscale_proxied_group", None)):
        real, on_all_gather = group.fairscale_proxied_group()
        base = _group_info(real)
        return _GroupInfo(base.pg, base.size, base.rank, base.ranks, base.backend, on_all_gather=on_all_gather)
    if group is dist.GroupMember.NON_GROUP_MEMBER or group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group() returns on ranks outside the new group; sizes as torch reports them.
        return _GroupInfo(group, -1, -1, (), "non-member")
    if isinstance(group, dist.ProcessGroup):
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        return _GroupInfo(group, group.size(), dist.get_rank(group), ranks, str(dist.get_backend(group)))
    if hasattr(group, "size") and hasattr(group, "rank"):
        # Stand-ins such as fair_dev.testing.DummyProcessGroup: sizes only, no communication.
        size = int(group.size())
        return _GroupInfo(group, size, int(group.rank()), tuple(range(size)), "dummy")
    raise TypeError(f"expected a torch.distributed ProcessGroup or None, got {type(group).__name__}: {group!r}")


def group_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (1 for ``None`` when torch.distributed is not initialised)."""
    return _group_info(group).size


def group_backend(group: Optional[ProcessGroup] = None) -> str:
    """The backend of ``group`` as torch names it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``; ``"local"``
    without torch.distributed)."""
    return _group_info(group).backend


def group_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank inside ``group`` (-1 if it is not a member)."""
    return _group_info(group).rank


def group_ranks(group: Optional[ProcessGroup] = None) -> Tuple[int, ...]:
    """The global ranks of ``group``, sorted (``(0,)`` without torch.distributed)."""
    return _group_info(group).ranks


def group_leader(group: Optional[ProcessGroup] = None) -> int:
    """The global rank of ``group``'s rank 0 (not always its lowest global rank: ``new_group`` keeps the order of the
    ranks it is given)."""
    if _dist_ready() and isinstance(group, dist.ProcessGroup):
        return int(dist.get_global_rank(group, 0))
    return 0


def group_order(group: Optional[ProcessGroup] = None) -> Tuple[int, ...]:
    """The global ranks of ``group`` in the order of their rank inside it (``new_group`` keeps the order it is given):
    two groups of the same ranks in another order give shard ``i`` to different processes."""
    if _dist_ready() and isinstance(group, dist.ProcessGroup):
        return tuple(int(dist.get_global_rank(group, i)) for i in range(group.size()))
    return group_ranks(group)


def group_identity(group: Optional[ProcessGroup] = None) -> str:
    """A name of ``group``'s communicator that is the same on its ranks: ``"default"`` for ``None`` or the default
    group, else its ranks and torch's group name (``new_group`` numbers groups in creation order, which every rank
    shares). Two groups of the same ranks created twice are two communicators: ranks that pass one each would wait
    on each other's collectives forever, so callers compare this, not the ranks."""
    if group is None or not _dist_ready() or group is dist.GroupMember.WORLD:
        return "default"
    name = getattr(group, "group_name", None)
    if name is None:  # pragma: no cover - every supported torch names its groups
        name = dist.distributed_c10d._get_process_group_name(group)
    return f"{list(group_ranks(group))}#{name}"


def _member_info(group: Optional[ProcessGroup], what: str) -> _GroupInfo:
    """The group's info, checked for a collective ``what`` on it (called by every collective: the known, usable
    group is a dictionary hit, and everything else takes the full path of :func:`_group_info`)."""
    if group is None and _AVAILABLE:
        group = dist.GroupMember.WORLD  # None before init_process_group: the full path returns the local world
    info = _group_cache.get(group) if group is not None else None
    if info is None:
        info = _group_info(group)
    if info.usable:
        return info
    if info.rank < 0:
        me = dist.get_rank() if _dist_ready() else 0
        members = f"the process group with ranks {info.ranks}" if info.ranks else "the process group"
        raise ValueError(
            f"{what}: global rank {me} is not a member of {members}; " "only members may call collectives on a group"
        )
    if info.size > 1 and info.backend == "dummy":
        raise TypeError(f"{what}: {type(info.pg).__name__} cannot communicate; pass a real ProcessGroup")
    return info
