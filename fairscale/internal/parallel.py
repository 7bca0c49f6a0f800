# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers for data parallelism: sharding layout and cached process groups."""

import atexit
import datetime
import sys
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import collectives

try:
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]

__all__ = [
    "chunk_and_pad",
    "validate_process_group",
    "enable_pytorch_sync_bn",
    "ProcessGroupName",
    "get_process_group_cached",
    "default_group_timeout",
    "new_group_with_timeout",
]


class _ChunkCountError(RuntimeError, ValueError):
    """A chunk count below 1."""


def chunk_and_pad(tensor: Tensor, num_chunks: int) -> List[Tensor]:
    """Split a tensor into ``num_chunks`` equal 1-D chunks, zero-padding the tail.

    The tensor is flattened and cut like ``torch.chunk``: every chunk has
    ``ceil(numel / num_chunks)`` elements except possibly the last non-empty one, which is
    right-padded with zeros, and when ``torch.chunk`` yields fewer pieces than asked (e.g. 5
    elements into 4 chunks gives 2, 2, 1) all-zero chunks are appended. This is FSDP's shard
    layout: rank ``r`` owns chunk ``r`` and the zeros are padding.

    Args:
        tensor (Tensor): the tensor to split (any shape).
        num_chunks (int): how many chunks to return (> 0).

    Returns:
        List[Tensor]: exactly ``num_chunks`` 1-D tensors of equal length. Unpadded chunks are views
        of ``tensor``; padded ones are new tensors.
    """
    if num_chunks <= 0:
        # A RuntimeError, as torch's chunk raised it upstream (callers may catch that), and a ValueError.
        raise _ChunkCountError(f"chunk_and_pad: num_chunks must be positive, got {num_chunks}")
    chunks = list(torch.flatten(tensor).chunk(num_chunks))
    if not chunks:  # a zero-element tensor: torch.chunk returns an empty tuple on some versions
        chunks = [tensor.new_empty(0)]
    pad = chunks[0].numel() - chunks[-1].numel()
    if pad > 0:
        chunks[-1] = F.pad(chunks[-1], [0, pad])
    while len(chunks) < num_chunks:
        chunks.append(chunks[0].new_zeros(chunks[0].numel()))
    return chunks


def validate_process_group(device: torch.device, process_group: ProcessGroup) -> None:
    """Check that ``process_group`` can communicate tensors on ``device``.

    Every rank all-gathers its group rank in a one-element tensor on ``device``; the result must
    be ``0, 1, ..., size - 1``. This catches a group whose backend cannot handle the device (e.g.
    NCCL with CPU tensors) and ranks that disagree about the group, at construction time rather
    than at the first forward. It is a collective: every rank of the group must call it.

    Args:
        device (torch.device): the device the group will communicate tensors on.
        process_group (ProcessGroup): the group to check.

    Raises:
        ValueError: if this rank is not a member of ``process_group``.
        RuntimeError: if the gathered ranks are not the expected ones.
    """
    size = collectives.group_size(process_group)
    rank = collectives.group_rank(process_group)
    if size < 1 or rank < 0:  # torch answers -1 on a rank outside the group: "Dimension size must be non-negative"
        raise ValueError(
            "validate_process_group: this rank is not a member of the process group (new_group() returns a group on "
            "every rank, a usable one on its members only); call it on the group's ranks only"
        )
    mine = torch.tensor([rank], dtype=torch.int32, device=device)
    gathered = torch.zeros(size, dtype=torch.int32, device=device)
    collectives.all_gather_into_flat(gathered, mine, group=process_group)
    expected = list(range(size))
    if gathered.tolist() != expected:
        raise RuntimeError(
            f"process group validation failed on {device}: all-gathering group ranks gave {gathered.tolist()}, "
            f"expected {expected}; check that every rank built the group with the same ranks"
        )


def enable_pytorch_sync_bn(module: nn.Module) -> None:
    """Prepare ``SyncBatchNorm`` layers of ``module`` for use outside DistributedDataParallel.

    Old PyTorch versions refused to run ``SyncBatchNorm`` unless DDP had told it the number of
    devices per process; this tells every such layer "one". Newer PyTorch has no such
    requirement and the call changes nothing.

    Args:
        module (nn.Module): the module whose submodules (and itself) are adjusted.
    """
    for layer in module.modules():
        specify = getattr(layer, "_specify_ddp_gpu_num", None)
        if isinstance(layer, nn.SyncBatchNorm) and callable(specify):
            specify(1)


class ProcessGroupName(str, Enum):
    """Names under which :func:`get_process_group_cached` keeps separate groups."""

    default = "default"
    reduce_scatter = "reduce_scatter"


_GroupKey = Tuple[ProcessGroupName, Optional[Tuple[int, ...]], Optional[datetime.timedelta]]
_group_cache: Dict[_GroupKey, Any] = {}
# The default group the cache was filled under: a new world (destroy + init) invalidates it.
_cache_world: List[Any] = [None]


@atexit.register
def _release_cached_groups() -> None:
    # As fairscale.internal.collectives.groups: groups still held at interpreter finalization made gloo abort now
    # and then at exit.
    _group_cache.clear()
    _cache_world[0] = None


def get_process_group_cached(
    name: ProcessGroupName = ProcessGroupName.default,
    ranks: Optional[Sequence[int]] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> ProcessGroup:
    """Return a process group over ``ranks`` (all ranks if ``None``), created once per process.

    ``torch.distributed.new_group`` is a collective over the whole world and creates a new
    communicator each time, so FSDP instances share groups through this cache, keyed by
    ``(name, sorted unique ranks, timeout)``. Different names give different communicators over the
    same ranks (e.g. reduce-scatters on their own group so they can overlap all-gathers). Like
    ``new_group``, every rank must make the same sequence of first calls.

    Every group created here has a collective timeout: ``timeout`` when given, else the default
    group's (the ``timeout`` given to ``init_process_group``). ``new_group`` alone would use the
    backend's default (30 minutes for gloo), so a peer that stays alive without joining a
    collective would block the others far longer than the user asked for.

    Args:
        name (ProcessGroupName): which cached group.
        ranks (Optional[Sequence[int]]): global ranks of the group; ``None`` for all ranks.
        timeout (Optional[datetime.timedelta]): collective timeout of the group; ``None``
            inherits the default group's.

    Returns:
        ProcessGroup: the cached group. ``None`` for the ``reduce_scatter`` name when
        ``torch.distributed`` is not initialised and pytest is running (single-process unit
        tests of code that only stores the group).

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialised (outside the case above).
    """
    if ranks is not None and len(ranks) == 0:
        raise ValueError("get_process_group_cached: ranks is empty; pass None for all ranks or list the member ranks")
    if not (dist.is_available() and dist.is_initialized()):
        if name == ProcessGroupName.reduce_scatter and "pytest" in sys.modules:
            return None  # type: ignore[return-value]
        raise RuntimeError(
            "get_process_group_cached: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first"
        )
    world = dist.group.WORLD
    if _cache_world[0] is not world:
        _group_cache.clear()
        _cache_world[0] = world
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"get_process_group_cached: timeout must be a datetime.timedelta, got {timeout!r}")
    inherited = default_group_timeout()
    if not _group_cache:
        # The first call on every rank creates the all-ranks default group, so the sequence of
        # new_group() calls (which must match across ranks) starts the same everywhere.
        _group_cache[(ProcessGroupName.default, None, inherited)] = new_group_with_timeout(None, inherited)
    chosen = timeout if timeout is not None else inherited
    key: _GroupKey = (ProcessGroupName(name), None if ranks is None else tuple(sorted(set(ranks))), chosen)
    if key not in _group_cache:
        # The key's sorted unique ranks: torch refuses duplicates ([0, 1, 1]) that the key already merged.
        _group_cache[key] = new_group_with_timeout(None if key[1] is None else list(key[1]), chosen)
    return _group_cache[key]


def new_group_with_timeout(ranks: Optional[List[int]], timeout: Optional[datetime.timedelta]) -> Any:
    """``dist.new_group(ranks)`` with ``timeout``, or with the backend's default when ``timeout`` is ``None`` (torch
    2.1 refuses ``timeout=None``: its default is a timedelta)."""
    if timeout is None:
        return dist.new_group(ranks=ranks)
    return dist.new_group(ranks=ranks, timeout=timeout)


def default_group_timeout() -> Optional[datetime.timedelta]:
    """The collective timeout of the default process group, as given to ``init_process_group``.

    torch does not expose it publicly; it is read from the default group's backend options
    (gloo and NCCL both keep it there). ``None`` when it cannot be read (no initialised default
    group, or a backend without options), in which case groups get the backend's default.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    get_backend = getattr(world, "_get_backend", None)
    if get_backend is None:  # pragma: no cover - torch without per-device backends
        return None
    for device in ("cpu", "cuda"):
        try:
            backend = get_backend(torch.device(device))
        except (RuntimeError, ValueError, AttributeError):  # no backend for this device type
            continue
        value = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(value, datetime.timedelta):
            return value
    return None
