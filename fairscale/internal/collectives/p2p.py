# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Point-to-point (pipeline parallelism, :mod:`fairscale.nn.pipe`): send / recv between two ranks of a group."""

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from .checks import _check_contiguous
from .groups import ProcessGroup, _dist_ready, _GroupInfo, _member_info
from .recording import _record
from .work import WorkHandle


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
