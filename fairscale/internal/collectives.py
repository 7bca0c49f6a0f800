# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The collectives layer: the only module of fairscale that calls ``torch.distributed`` collectives.

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
"""

import contextlib
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import simulated_link as _link
from .collective_counter import (
    CollectiveCounter,
    CollectiveRecord,
    collective_phase,
    count_collectives,
    record_collective,
)

try:
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]


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
    "group_size",
    "group_rank",
    "group_ranks",
    "reduce",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
]


def _record(
    kind: str, info: "_GroupInfo", dtype: Optional[torch.dtype], numel: int, element_size: int
) -> Optional[float]:
    """Count the call; with a simulated link (see :mod:`.simulated_link`) also return its completion time."""
    record_collective(kind, info.size, info.ranks, dtype, numel, element_size)
    return _link.ready_time(info.pg, info.size, numel * element_size)


class WorkHandle:
    """Handle of an asynchronous collective; call :meth:`wait` before reading the result.

    It wraps torch's work object plus an optional completion step (e.g. copying out of a
    temporary buffer a fallback used), which runs exactly once, in :meth:`wait`. A handle
    without work is already complete (what synchronous fallbacks and world size 1 return).
    """

    __slots__ = ("_work", "_on_complete", "_done", "_ready_at")

    def __init__(self, work: Any = None, on_complete: Optional[Callable[[], None]] = None) -> None:
        self._work = work
        self._on_complete = on_complete
        self._done = work is None and on_complete is None
        self._ready_at: Optional[float] = None  # simulated link: not complete before this time.monotonic()

    def _complete_no_earlier_than(self, ready_at: Optional[float]) -> None:
        if ready_at is not None:
            self._ready_at = ready_at
            self._done = False

    def wait(self) -> None:
        """Block until the collective is done (on accelerators: order the current stream after it)."""
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        _link.sleep_until(self._ready_at)
        self._done = True
        if self._on_complete is not None:
            self._on_complete()

    def is_completed(self) -> bool:
        """Whether the result can be read; finishes the completion step when the work is done."""
        if self._done:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        if self._ready_at is not None and time.monotonic() < self._ready_at:
            return False
        self.wait()
        return True


@dataclass(frozen=True)
class _GroupInfo:
    pg: Any  # what torch gets as ``group``; None when torch.distributed is not initialised
    size: int
    rank: int  # this process's rank inside the group, -1 if it is not a member
    ranks: Tuple[int, ...]  # global ranks, sorted
    backend: str


_LOCAL_WORLD = _GroupInfo(pg=None, size=1, rank=0, ranks=(0,), backend="local")
# Group objects are long-lived (and not weak-referenceable), so a plain dict is the cache; it
# holds each group alive, which also rules out a recycled id() pointing at stale info.
_group_cache: Dict[Any, _GroupInfo] = {}


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_info(group: Optional[ProcessGroup]) -> _GroupInfo:
    if group is None:
        if not _dist_ready():
            return _LOCAL_WORLD
        group = dist.group.WORLD
    info = _group_cache.get(group)
    if info is None:
        info = _build_group_info(group)
        _group_cache[group] = info
    return info


def _build_group_info(group: Any) -> _GroupInfo:
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


def group_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank inside ``group`` (-1 if it is not a member)."""
    return _group_info(group).rank


def group_ranks(group: Optional[ProcessGroup] = None) -> Tuple[int, ...]:
    """The global ranks of ``group``, sorted (``(0,)`` without torch.distributed)."""
    return _group_info(group).ranks


def _member_info(group: Optional[ProcessGroup], what: str) -> _GroupInfo:
    info = _group_info(group)
    if info.rank < 0:
        me = dist.get_rank() if _dist_ready() else 0
        members = f"the process group with ranks {info.ranks}" if info.ranks else "the process group"
        raise ValueError(
            f"{what}: global rank {me} is not a member of {members}; " "only members may call collectives on a group"
        )
    if info.size > 1 and info.backend == "dummy":
        raise TypeError(f"{what}: {type(info.pg).__name__} cannot communicate; pass a real ProcessGroup")
    return info


# torch's names of the flat-tensor variants, newest first (the older ones print deprecation warnings on recent torch).
# They are looked up on ``torch.distributed`` at every call, never bound at import, so that tests and tools that
# patch them (to count calls or inject delays, as upstream's tests do) see every call. A name patched since import
# wins over the newest name: on recent torch the older names are thin wrappers that call the newest one inside
# torch, so a patched older name would otherwise never run.
_ALL_GATHER_TENSOR_NAMES = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_REDUCE_SCATTER_TENSOR_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
_TORCH_ORIGINALS = {name: getattr(dist, name, None) for name in _ALL_GATHER_TENSOR_NAMES + _REDUCE_SCATTER_TENSOR_NAMES}


def _torch_function(names: Sequence[str]) -> Callable[..., Any]:
    """The function of ``torch.distributed`` to call now: a patched one if any, else the newest that exists."""
    current: List[Tuple[str, Optional[Callable[..., Any]]]] = [(name, getattr(dist, name, None)) for name in names]
    for name, fn in current:
        if fn is not None and fn is not _TORCH_ORIGINALS[name]:
            return fn
    for _, fn in current:
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch.distributed has none of {list(names)}; fairscale needs torch >= 2.1")


def _all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    return _torch_function(_ALL_GATHER_TENSOR_NAMES)(*args, **kwargs)


def _reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    return _torch_function(_REDUCE_SCATTER_TENSOR_NAMES)(*args, **kwargs)


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Errors a backend raises, before any communication, for a variant or dtype it lacks. Only
# these trigger a fallback: anything else (a dead peer, a timeout) must surface unchanged.
_UNSUPPORTED = re.compile(r"not support|unsupported|not implemented|no kernel|invalid scalar type", re.I)

_Strategy = Tuple[str, Callable[[], WorkHandle]]
_chosen: Dict[Tuple[str, str, torch.dtype], str] = {}
# Tests force a strategy to exercise fallbacks that the installed torch does not need.
_forced: Dict[Tuple[str, Optional[torch.dtype]], str] = {}


class _NotApplicable(Exception):
    """A strategy that does not apply to this call (e.g. fp32 wire format for an fp32 tensor)."""


@contextlib.contextmanager
def _force_strategy(kind: str, name: str, dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Testing aid: make ``kind`` (for ``dtype``, or any dtype) use strategy ``name``."""
    key = (kind, dtype)
    previous = _forced.get(key)
    _forced[key] = name
    try:
        yield
    finally:
        if previous is None:
            del _forced[key]
        else:
            _forced[key] = previous


def _dispatch(
    kind: str, info: _GroupInfo, dtype: torch.dtype, strategies: Sequence[_Strategy], device_type: str = "cpu"
) -> WorkHandle:
    """Run the first strategy the backend accepts for ``(backend, kind, dtype)``; remember it.

    Fallbacks are for CPU tensors only (gloo's gaps). Accelerator backends (NCCL) support every variant and dtype, so
    an error there is a real failure (a CUDA error can read "operation not supported") and retrying another variant
    on this rank alone would leave the peers waiting. The tensor's device decides, not the backend's name, which
    reads "undefined" or "cpu:gloo,cuda:nccl" for groups created without an explicit backend.
    """
    forced = _forced.get((kind, dtype)) or _forced.get((kind, None))
    wanted = forced or _chosen.get((info.backend, kind, dtype))
    if wanted is not None:
        for name, run in strategies:
            if name == wanted:
                return run()
        raise ValueError(f"unknown {kind} strategy {wanted!r}")
    errors: List[str] = []
    for name, run in strategies:
        try:
            handle = run()
        except _NotApplicable:
            continue
        except (RuntimeError, NotImplementedError) as exc:
            if device_type != "cpu" or not _UNSUPPORTED.search(str(exc)):
                raise
            errors.append(f"{name}: {str(exc).strip().splitlines()[0]}")
            continue
        _chosen[(info.backend, kind, dtype)] = name
        return handle
    raise RuntimeError(
        f"{kind} of {dtype} tensors is not supported by backend {info.backend!r}; tried " + "; ".join(errors)
    )


def _copy_back(dst: Tensor, src: Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src)

    return copy


def _via_fp32(out: Tensor, inp: Tensor, run: Callable[[Tensor, Tensor], WorkHandle]) -> WorkHandle:
    """Run ``run(wire_out, wire_in)`` on fp32 copies and cast the result back (for fp16/bf16 only)."""
    if out.dtype not in _LOW_PRECISION:
        raise _NotApplicable()
    wire_in = inp.float()
    wire_out = wire_in if out is inp else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    return WorkHandle(run(wire_out, wire_in), _copy_back(out, wire_out))


def _reduce_op(op: str) -> Any:
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


def _finish(handle: WorkHandle, async_op: bool, ready_at: Optional[float] = None) -> Optional[WorkHandle]:
    handle._complete_no_earlier_than(ready_at)
    if async_op:
        return handle
    handle.wait()
    return None


def _check_pair(what: str, output: Tensor, input: Tensor) -> None:
    if output.dtype != input.dtype:
        raise ValueError(f"{what}: output dtype {output.dtype} differs from input dtype {input.dtype}; cast first")
    if output.device != input.device:
        raise ValueError(f"{what}: output is on {output.device} but input is on {input.device}; move one of them")
    if not output.is_contiguous():
        raise ValueError(f"{what}: output must be contiguous (it is written in place); pass .contiguous() storage")


def all_gather_into_flat(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """All-gather equal-sized pieces into one flat buffer, in group-rank order.

    Args:
        output (Tensor): contiguous, any shape, ``group size * input.numel()`` elements; receives
            the concatenation of every rank's ``input`` (rank 0 first). ``input`` may be a view of
            this rank's part of ``output``.
        input (Tensor): this rank's piece, any shape, same dtype and device as ``output``.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_gather_into_flat")
    _check_pair("all_gather_into_flat", output, input)
    if output.numel() != input.numel() * info.size:
        raise ValueError(
            f"all_gather_into_flat: output has {output.numel()} elements but input has {input.numel()} "
            f"and the group has {info.size} ranks; output needs input.numel() * {info.size} = "
            f"{input.numel() * info.size}"
        )
    ready_at = _record("all_gather", info, output.dtype, output.numel(), output.element_size())
    return _finish(_all_gather(output.view(-1), input.reshape(-1), info, async_op), async_op, ready_at)


def _all_gather(out: Tensor, inp: Tensor, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(_all_gather_tensor(out, inp, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        return WorkHandle(dist.all_gather(list(out.chunk(info.size)), inp, group=info.pg, async_op=async_op))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(out, inp, lambda o, i: _all_gather(o, i, info, async_op))

    strategies = [("tensor", tensor_variant), ("list", list_variant), ("fp32", fp32_variant)]
    return _dispatch("all_gather", info, out.dtype, strategies, out.device.type)


def reduce_scatter_from_flat(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce a flat buffer across ranks and keep this rank's contiguous chunk.

    Args:
        output (Tensor): contiguous, any shape; receives chunk ``r`` (``r`` = this rank's group
            rank) of the element-wise reduction of every rank's ``input``.
        input (Tensor): ``group size * output.numel()`` elements, any shape or layout (2-D
            buckets included); read in row-major order as ``size`` consecutive chunks.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "reduce_scatter_from_flat")
    _check_pair("reduce_scatter_from_flat", output, input)
    reduce_op = _reduce_op(op)
    if input.numel() != output.numel() * info.size:
        raise ValueError(
            f"reduce_scatter_from_flat: input has {input.numel()} elements but output has {output.numel()} "
            f"and the group has {info.size} ranks; input needs output.numel() * {info.size} = "
            f"{output.numel() * info.size}"
        )
    ready_at = _record("reduce_scatter", info, input.dtype, input.numel(), input.element_size())
    # reshape() copies a non-contiguous input (e.g. the used columns of a 2-D bucket) into the
    # 1-D layout every backend accepts.
    return _finish(_reduce_scatter(output.view(-1), input.reshape(-1), reduce_op, info, async_op), async_op, ready_at)


def _reduce_scatter(out: Tensor, inp: Tensor, op: Any, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(_reduce_scatter_tensor(out, inp, op=op, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        chunks = list(inp.chunk(info.size))
        return WorkHandle(dist.reduce_scatter(out, chunks, op=op, group=info.pg, async_op=async_op))

    def all_reduce_variant() -> WorkHandle:
        # Costs size x the traffic, but every backend has all-reduce.
        full = inp.clone()
        work = dist.all_reduce(full, op=op, group=info.pg, async_op=async_op)
        start = info.rank * out.numel()
        return WorkHandle(work, _copy_back(out, full[start : start + out.numel()]))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(out, inp, lambda o, i: _reduce_scatter(o, i, op, info, async_op))

    strategies = [
        ("tensor", tensor_variant),
        ("list", list_variant),
        ("all_reduce", all_reduce_variant),
        ("fp32", fp32_variant),
    ]
    return _dispatch("reduce_scatter", info, out.dtype, strategies, out.device.type)


def all_reduce(
    tensor: Tensor, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce ``tensor`` in place across the ranks of ``group``.

    Args:
        tensor (Tensor): contiguous tensor, same shape on every rank; holds the result afterwards.
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_reduce")
    reduce_op = _reduce_op(op)
    _check_contiguous("all_reduce", tensor)
    ready_at = _record("all_reduce", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return _finish(_all_reduce(tensor, reduce_op, info, async_op), async_op, ready_at)


def _all_reduce(tensor: Tensor, op: Any, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(dist.all_reduce(tensor, op=op, group=info.pg, async_op=async_op))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(tensor, tensor, lambda wire, _: _all_reduce(wire, op, info, async_op))

    strategies = [("tensor", tensor_variant), ("fp32", fp32_variant)]
    return _dispatch("all_reduce", info, tensor.dtype, strategies, tensor.device.type)


def broadcast(
    tensor: Tensor, src: int, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place.

    Args:
        tensor (Tensor): contiguous; the data on ``src``, overwritten on the other ranks.
        src (int): the **global** rank that sends (as in ``torch.distributed.broadcast``).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "broadcast")
    _check_src("broadcast", src, info)
    _check_contiguous("broadcast", tensor)
    ready_at = _record("broadcast", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return _finish(_broadcast(tensor, src, info, async_op), async_op, ready_at)


def _broadcast(tensor: Tensor, src: int, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(dist.broadcast(tensor, src=src, group=info.pg, async_op=async_op))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(tensor, tensor, lambda wire, _: _broadcast(wire, src, info, async_op))

    strategies = [("tensor", tensor_variant), ("fp32", fp32_variant)]
    return _dispatch("broadcast", info, tensor.dtype, strategies, tensor.device.type)


def _check_contiguous(what: str, tensor: Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (it is updated in place); pass .contiguous() storage")


def _check_src(what: str, src: int, info: _GroupInfo) -> None:
    if src not in info.ranks:
        raise ValueError(f"{what}: src={src} is not in the group (global ranks {info.ranks}); src is a global rank")


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
    dist.all_gather_object(gathered, obj, group=info.pg)
    return gathered


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of ``group`` has reached this call."""
    info = _member_info(group, "barrier")
    _record("barrier", info, None, 0, 0)
    if info.size > 1:
        dist.barrier(group=info.pg)


# ----------------------------------------------------------------------------------------------
# All-to-all (mixture of experts, fairscale.nn.moe)


def all_to_all_single(
    output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[WorkHandle]:
    """Exchange equal blocks along dim 0: block ``j`` of ``input`` goes to group rank ``j``.

    After the call, block ``i`` of ``output`` on rank ``j`` is block ``j`` of ``input`` on rank ``i``
    (torch's ``all_to_all_single`` with equal splits). A backend without all-to-all for the tensor
    falls back to torch's list variant, then to an all-gather of every input (``size`` x the traffic,
    but available everywhere).

    Args:
        output (Tensor): contiguous, same shape, dtype and device as ``input``; receives the blocks.
        input (Tensor): dim 0 divisible by the group size; any layout (made contiguous for the wire).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "all_to_all_single")
    _check_pair("all_to_all_single", output, input)
    if output.shape != input.shape:
        raise ValueError(
            f"all_to_all_single: output shape {tuple(output.shape)} differs from input {tuple(input.shape)}"
        )
    if input.dim() == 0 or input.shape[0] % info.size != 0:
        raise ValueError(
            f"all_to_all_single: dim 0 of the input (shape {tuple(input.shape)}) must divide into {info.size} equal "
            "blocks, one per rank of the group"
        )
    ready_at = _record("all_to_all", info, input.dtype, input.numel(), input.element_size())
    return _finish(_all_to_all(output, input.contiguous(), info, async_op), async_op, ready_at)


def _all_to_all(out: Tensor, inp: Tensor, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(dist.all_to_all_single(out, inp, group=info.pg, async_op=async_op))

    def list_variant() -> WorkHandle:
        outs = list(out.chunk(info.size))
        return WorkHandle(dist.all_to_all(outs, list(inp.chunk(info.size)), group=info.pg, async_op=async_op))

    def all_gather_variant() -> WorkHandle:
        # Everyone's whole input, then keep block `my rank` of each: size x the traffic, synchronous.
        full = torch.empty((info.size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
        _all_gather(full.view(-1), inp.reshape(-1), info, async_op=False).wait()
        mine = full.view(info.size, info.size, -1)[:, info.rank]
        out.view(info.size, -1).copy_(mine)
        return WorkHandle()

    strategies = [("tensor", tensor_variant), ("list", list_variant), ("all_gather", all_gather_variant)]
    return _dispatch("all_to_all", info, out.dtype, strategies, out.device.type)


# ------------------------------------------------------------------------------------------------------------------
# OSS / ShardedDataParallel block: reduce to one rank (gradients to their owner).


def reduce(
    tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None, op: str = "sum", async_op: bool = False
) -> Optional[WorkHandle]:
    """Reduce ``tensor`` across the ranks of ``group`` into global rank ``dst``'s ``tensor``.

    Only ``dst`` holds the result afterwards; on the other ranks the content of ``tensor`` is unspecified (some
    backends use it as scratch space).

    Args:
        tensor (Tensor): contiguous, same shape on every rank.
        dst (int): the **global** rank that receives the result (as in ``torch.distributed.reduce``).
        group (Optional[ProcessGroup]): the group, ``None`` for the default world group.
        op (str): ``"sum"``, ``"max"``, ``"min"`` or ``"product"``.
        async_op (bool): return a :class:`WorkHandle` instead of waiting.

    Returns:
        Optional[WorkHandle]: the handle when ``async_op`` is true, else ``None``.
    """
    info = _member_info(group, "reduce")
    _check_src("reduce", dst, info)
    reduce_op = _reduce_op(op)
    _check_contiguous("reduce", tensor)
    ready_at = _record("reduce", info, tensor.dtype, tensor.numel(), tensor.element_size())
    return _finish(_reduce(tensor, dst, reduce_op, info, async_op), async_op, ready_at)


def _reduce(tensor: Tensor, dst: int, op: Any, info: _GroupInfo, async_op: bool) -> WorkHandle:
    if info.size == 1:
        return WorkHandle()

    def tensor_variant() -> WorkHandle:
        return WorkHandle(dist.reduce(tensor, dst=dst, op=op, group=info.pg, async_op=async_op))

    def fp32_variant() -> WorkHandle:
        return _via_fp32(tensor, tensor, lambda wire, _: _reduce(wire, dst, op, info, async_op))

    strategies = [("tensor", tensor_variant), ("fp32", fp32_variant)]
    return _dispatch("reduce", info, tensor.dtype, strategies, tensor.device.type)


# ------------------------------------------------------------------------------------------------------------------
# Point-to-point block (pipeline parallelism, fairscale.nn.pipe): send / recv between two ranks of a group.


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
