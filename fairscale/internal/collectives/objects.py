# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Collectives of picklable Python objects, and the barrier."""

import pickle
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .checks import _check_src
from .groups import ProcessGroup, _member_info
from .recording import _record


def broadcast_object_list(objects: List[Any], src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Replace ``objects[i]`` on every rank with ``objects[i]`` of global rank ``src`` (picklable objects).

    Args:
        objects (List[Any]): a list of the same length on every rank, updated in place.
        src (int): the global rank that sends.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
    """
    if not isinstance(objects, list):
        raise TypeError(f"broadcast_object_list: objects must be a list (updated in place), got {type(objects)}")
    info = _member_info(group, "broadcast_object_list")
    _check_src("broadcast_object_list", src, info)
    _record("broadcast_object", info, None, 0, 0)
    if info.size > 1:
        with torch.inference_mode(False):  # see all_gather_object
            dist.broadcast_object_list(objects, src=src, group=info.pg)


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather one picklable object from every rank of ``group``.

    Args:
        obj (Any): this rank's object.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.

    Returns:
        List[Any]: the objects in group-rank order (copies, also at world size 1).
    """
    info = _member_info(group, "all_gather_object")
    _record("all_gather_object", info, None, 0, 0)
    if info.size == 1:
        # A pickle round trip keeps the multi-rank semantics: a copy, and unpicklable input fails.
        return [pickle.loads(pickle.dumps(obj))]
    gathered: List[Any] = [None] * info.size
    # torch 2.1's object collectives write into tensors in place, which fails under torch.inference_mode() (an
    # agreement check in a first forward under it, as in a validation sanity check).
    with torch.inference_mode(False):
        dist.all_gather_object(gathered, obj, group=info.pg)
    return gathered


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of ``group`` has reached this call."""
    info = _member_info(group, "barrier")
    _record("barrier", info, None, 0, 0)
    if info.size > 1:
        dist.barrier(group=info.pg)
