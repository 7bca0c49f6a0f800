# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Point-to-point (pipeline parallelism, :mod:`fairscale.nn.pipe`): send / recv between two ranks of a group, and
the group that should carry them (:func:`p2p_group`)."""

import atexit
import datetime
from typing import Any, Dict, List, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import _check_contiguous
from .groups import ProcessGroup, _dist_ready, _GroupInfo, _member_info, group_destroyed
from .recording import _record
from .work import WorkHandle

# Point-to-point twins of the groups that PyTorch's collective checker wraps, by group; see p2p_group.
_twins: Dict[Any, Any] = {}
# Twins of groups the user destroyed (see p2p_group); torch holds them until the world is destroyed anyway.
_retired_twins: List[Any] = []
# Released at exit while the interpreter is whole, for the reason groups._group_cache is.
atexit.register(_twins.clear)
atexit.register(_retired_twins.clear)


def p2p_group(group: Optional[ProcessGroup] = None) -> Optional[ProcessGroup]:
    """The group that should carry the point-to-point traffic between ranks of ``group``.

    ``group`` itself, unless PyTorch's collective checker wraps it (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, see
    :func:`checked_by_torch`). The checker compares a sequence number of the group across its ranks before every
    collective, and each send or receive advances that number on the two ranks concerned only: after a pipeline's
    messages the ranks of its group hold other numbers, and the next collective on the group (a barrier, an
    agreement check) fails with "Detected mismatch between collectives" although every rank calls it. A checked
    group therefore gets a twin for its point-to-point traffic: a new group of the same ranks, backend and timeout,
    on which no collective ever runs, so that the sequence numbers of ``group`` count its collectives only.

    The twin is created at the first call for ``group`` and cached, so that every later call is local. That first
    call is collective over the ranks of ``group``: every one of them must make it, at the same point of its program
    (with respect to its other ``new_group`` calls). When ``group`` spans the world it is a plain ``new_group``, named
    by torch's group counter like the caller's own groups; otherwise only the members take part
    (``use_local_synchronization=True``). Without the checker nothing is created and nothing is communicated.

    Args:
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.

    Returns:
        Optional[ProcessGroup]: ``group`` (``None`` stays ``None``), or its twin.

    Raises:
        ValueError: this process is not a member of ``group``.
    """
    if not _dist_ready() or (group is not None and not isinstance(group, dist.ProcessGroup)):
        return group  # no torch.distributed, or a stand-in (fair_dev.testing.DummyProcessGroup): nothing checks it
    info = _member_info(group, "p2p_group")
    if not _checked_by_torch(info.pg):
        return group
    twin: Any = _twins.get(info.pg)
    if twin is None:
        # The twin of a group the user destroyed is retired: the pipeline's sender thread on it ends (see
        # nn/pipe/messages.py), which held it for the rest of the process. The twin itself is not destroyed here:
        # torch names a subgroup made with use_local_synchronization by its ranks and the number of live groups, so
        # a destroy the user did not make gave the next twin the name of the user's newest group ("The specified
        # group name has already been created"; a review, session 50). Destroying the world ends it.
        for key in [key for key in _twins if group_destroyed(key)]:
            _retired_twins.append(_twins.pop(key))
        timeout = _timeout_of(info.pg)
        local = len(info.ranks) < dist.get_world_size()
        if timeout is None:  # torch 2.1 refuses timeout=None (its default is a timedelta)
            twin = dist.new_group(ranks=list(info.ranks), backend=info.backend, use_local_synchronization=local)
        else:
            twin = dist.new_group(
                ranks=list(info.ranks), backend=info.backend, timeout=timeout, use_local_synchronization=local
            )
        _twins[info.pg] = twin
    return cast(Optional[ProcessGroup], twin)


def p2p_group_retired(group: Any) -> bool:
    """Whether ``group``, a group :func:`p2p_group` returned, carries no more traffic: torch destroyed it, or it is
    the twin of a group torch destroyed (retired at the next :func:`p2p_group` call that makes a twin)."""
    _retired_twins[:] = [twin for twin in _retired_twins if not group_destroyed(twin)]
    return group_destroyed(group) or any(twin is group for twin in _retired_twins)


def checked_by_torch(group: Optional[ProcessGroup] = None) -> bool:
    """Whether PyTorch's collective checker wraps ``group`` (``None``: the default world group).

    The checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``torch.distributed.set_debug_level(DebugLevel.DETAIL)``)
    wraps the groups created while it is on; it compares every collective across the ranks first and raises
    "Detected mismatch between collectives" on all of them when they differ. ``False`` without torch.distributed.
    """
    if not _dist_ready():
        return False
    return _checked_by_torch(dist.group.WORLD if group is None else group)


def _checked_by_torch(pg: Any) -> bool:
    """Whether ``pg`` is wrapped by PyTorch's collective checker (decided when the group was created, from the debug
    level then: the level now may differ)."""
    wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
    get_backend = getattr(pg, "_get_backend", None)
    if wrapper is None or get_backend is None:  # pragma: no cover - torch without gloo or per-device backends
        return False
    for device in ("cpu", "cuda"):
        try:
            if isinstance(get_backend(torch.device(device)), wrapper):
                return True
        except (RuntimeError, ValueError):  # no backend for this device type
            continue
    return False


def _timeout_of(pg: Any) -> Optional[datetime.timedelta]:
    """The collective timeout ``pg`` was created with, so that a receive on its twin gives up as late as one on
    ``pg`` would (``None``, the backend's default, when torch does not tell)."""
    for device in ("cpu", "cuda"):
        try:
            value = getattr(getattr(pg._get_backend(torch.device(device)), "options", None), "_timeout", None)
        except (RuntimeError, ValueError, AttributeError):
            continue
        if isinstance(value, datetime.timedelta):
            return value
    return None


def _check_peer(what: str, peer: int, info: _GroupInfo) -> None:
    if peer not in info.ranks:
        raise ValueError(f"{what}: rank {peer} is not in the group (global ranks {info.ranks}); peers are global ranks")
    if peer == dist.get_rank():
        raise ValueError(f"{what}: rank {peer} is this process; a rank cannot send to or receive from itself")


def _p2p_info(what: str, group: Optional[ProcessGroup]) -> _GroupInfo:
    if not _dist_ready():
        raise RuntimeError(f"{what}: torch.distributed is not initialised; point-to-point needs a process group")
    return _member_info(group, what)


def send(tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it left (``torch.distributed.send``).

    Args:
        tensor (Tensor): contiguous tensor to send.
        dst (int): the **global** rank that receives it (a member of ``group``).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        tag (int): matches the receive with the same tag.
    """
    info = _p2p_info("send", group)
    _check_peer("send", dst, info)
    _check_contiguous("send", tensor)
    _record("send", info, tensor.dtype, tensor.numel(), tensor.element_size())
    dist.send(tensor, dst=dst, group=info.pg, tag=tag)


def recv(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src``, or from any rank when ``src`` is ``None``.

    Receiving from any rank needs a backend that supports it (gloo, MPI; not NCCL).

    Args:
        tensor (Tensor): contiguous buffer of the sent shape and dtype, overwritten.
        src (Optional[int]): the **global** rank that sends, ``None`` for any rank of the group.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        tag (int): matches the send with the same tag.

    Returns:
        int: the global rank the tensor came from.
    """
    info = _p2p_info("recv", group)
    if src is not None:
        _check_peer("recv", src, info)
    _check_contiguous("recv", tensor)
    _record("recv", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return int(dist.recv(tensor, src=src, group=info.pg, tag=tag))


def isend(tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> WorkHandle:
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` unchanged until the handle is waited on."""
    info = _p2p_info("isend", group)
    _check_peer("isend", dst, info)
    _check_contiguous("isend", tensor)
    _record("send", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return WorkHandle(dist.isend(tensor, dst=dst, group=info.pg, tag=tag))


def irecv(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> WorkHandle:
    """Start receiving into ``tensor`` from global rank ``src``; read it after the handle is waited on."""
    info = _p2p_info("irecv", group)
    _check_peer("irecv", src, info)
    _check_contiguous("irecv", tensor)
    _record("recv", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return WorkHandle(dist.irecv(tensor, src=src, group=info.pg, tag=tag))
