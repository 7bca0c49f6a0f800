# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS's broadcast buckets: one flat buffer per (device, owning rank) that the owner's trainable parameters are
views of, so that sharing the updated parameters is one broadcast per owner instead of one per parameter."""

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch

from fairscale.internal import collectives
from fairscale.internal.collectives import WorkHandle
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError
from fairscale.nn.misc.param_bucket import ParamBucket

__all__ = [
    "Buckets",
    "Backing",
    "build_buckets",
    "broadcast_buckets",
    "agree_on_frozen_with_grads",
    "broadcast_frozen_since",
    "watch_frozen_with_grads",
]

# {device: {owner rank: bucket}}, the layout upstream exposes as ``OSS.buckets``.
Buckets = Dict[torch.device, Dict[int, ParamBucket]]

_DATA_PTR = torch.Tensor.data_ptr


class Backing:
    """Which parameters the buckets were built for, to tell cheaply whether they are still views of them.

    A parameter stops being a view of its bucket when its ``.data`` is replaced: ``model.double()``, ``model.to()``
    or ``param.data = ...``. The broadcast then writes the bucket and not the parameter, and the ranks drift apart
    silently, so OSS checks this before every step. The check compares the address of every bucketed parameter
    with its slice of the bucket (one C call per parameter, no tensor operation) and the dtype and device of each
    bucket's first parameter with the bucket's (two tensors on different devices could share an address).

    It also remembers the parameters that were frozen when the buckets were built: such a parameter is in no bucket,
    so once unfrozen its owner steps it and nobody receives the new value (see :meth:`unfrozen`). Those of them that
    were trainable at an earlier build may still have a gradient (e.g. zeroed rather than released), which the
    owner's optimizer steps: see :func:`broadcast_frozen_since`.

    Args:
        entries: ``(bucket, parameters in check-in order)`` for every bucket that backs parameters.
        frozen: the parameters that did not require grad when the buckets were built (in no bucket).
        frozen_since: ``(parameter, owner)`` for the frozen ones that were trainable at an earlier build (and, once
            :func:`watch_frozen_with_grads` ran, those frozen from the start that held a gradient at this build).
        trained: ``id`` of every parameter that was trainable at this build or an earlier one.
        frozen_first: ``(parameter, owner)`` for the frozen ones that were never trainable at a build.
    """

    def __init__(
        self,
        entries: List[Tuple[ParamBucket, List[torch.Tensor]]],
        frozen: Optional[List[torch.Tensor]] = None,
        frozen_since: Optional[List[Tuple[torch.Tensor, int]]] = None,
        trained: Optional[Set[int]] = None,
        frozen_first: Optional[List[Tuple[torch.Tensor, int]]] = None,
    ) -> None:
        self._frozen: List[torch.Tensor] = list(frozen) if frozen is not None else []
        self.frozen_first: List[Tuple[torch.Tensor, int]] = list(frozen_first) if frozen_first is not None else []
        # The entries of frozen_first that held a gradient on some rank when the ranks last agreed on them (None: not
        # agreed yet, the next step does it; see watch_frozen_with_grads).
        self.watched_first: Optional[List[Tuple[torch.Tensor, int]]] = []
        self.frozen_since: List[Tuple[torch.Tensor, int]] = list(frozen_since) if frozen_since is not None else []
        self.trained: Set[int] = set(trained) if trained is not None else set()
        self._entries: List[Tuple[ParamBucket, List[torch.Tensor], List[int]]] = []
        for bucket, params in entries:
            offsets = [0]
            for param in params[:-1]:
                offsets.append(offsets[-1] + param.numel())
            self._entries.append((bucket, params, offsets))
        # Per bucket: the buffer's address and the addresses expected from it. A broadcast_fp16 step swaps the
        # buffer for a new one (with the parameters re-pointed into it), so they are recomputed when it moved.
        self._expected: List[Tuple[int, List[int]]] = [(-1, []) for _ in self._entries]

    def intact(self) -> bool:
        """Whether every parameter is still a view of its slice of its bucket (of the bucket's dtype and device)."""
        for i, (bucket, params, offsets) in enumerate(self._entries):
            buffer = bucket.buffer
            if buffer is None:  # pragma: no cover - OSS never collapses its buckets
                return False
            if params[0].dtype != buffer.dtype or params[0].device != buffer.device:
                return False
            base = buffer.data_ptr()
            if self._expected[i][0] != base:
                size = buffer.element_size()
                self._expected[i] = (base, [base + offset * size for offset in offsets])
            if list(map(_DATA_PTR, params)) != self._expected[i][1]:
                return False
        return True

    def unfrozen(self) -> List[torch.Tensor]:
        """The parameters frozen when the buckets were built that require grad now (usually none).

        One attribute read per frozen parameter; the list is only built when there is one.
        """
        if not any(p.requires_grad for p in self._frozen):
            return []
        return [p for p in self._frozen if p.requires_grad]


@torch.no_grad()
def build_buckets(
    per_device: Dict[Any, List[List[torch.Tensor]]], previous: Buckets, backing: Optional[Backing] = None
) -> Tuple[Buckets, Backing]:
    """(Re)build the buckets for the current trainability.

    Frozen parameters get a private copy of their storage (they may still be views of an older bucket, which must
    not keep them alive or overwrite them). An owner whose parameters on a device are all frozen gets no new
    bucket, but keeps one of the size, dtype and device of the one it had (upstream keeps it too, and it is
    broadcast as before: every rank keeps the same set of buckets, which is what the broadcasts require). That
    bucket backs no parameter: upstream's still held the frozen parameters, and a ``broadcast_fp16`` step, which
    re-points a bucket's parameters into its buffer, put them back to their values of when they were frozen.
    ``backing`` (the previous build's) tells which frozen parameters were trainable before.

    Returns:
        The buckets, ``{device: {owner: bucket}}``, and the :class:`Backing` of the parameters they back.

    Raises:
        TypeError: (also an ``AssertionError``, as upstream asserted) one owner's trainable parameters on one device
            have different dtypes; nothing is changed then.
    """
    _check_one_dtype_per_bucket(per_device)
    buckets: Buckets = {}
    backed: List[Tuple[ParamBucket, List[torch.Tensor]]] = []
    frozen: List[torch.Tensor] = []
    frozen_since: List[Tuple[torch.Tensor, int]] = []
    frozen_first: List[Tuple[torch.Tensor, int]] = []
    trained = set(backing.trained) if backing is not None else set()
    for device, per_rank in per_device.items():
        device_buckets: Dict[int, ParamBucket] = dict(previous.get(device, {}))
        for owner, params in enumerate(per_rank):
            if not params:
                continue
            for param in params:
                if not param.requires_grad:
                    param.data = param.data.detach().clone()
                    frozen.append(param)
                    (frozen_since if id(param) in trained else frozen_first).append((param, owner))
                else:
                    trained.add(id(param))
            trainable = [p for p in params if p.requires_grad]
            if not trainable:
                continue
            bucket = ParamBucket(sum(p.numel() for p in trainable), trainable[0].dtype, device)
            for param in trainable:
                bucket.add_param(param)
            device_buckets[owner] = bucket
            backed.append((bucket, trainable))
        rebuilt = {id(bucket) for bucket, _ in backed}
        for owner, bucket in list(device_buckets.items()):
            if id(bucket) not in rebuilt:
                kept = _buffer(bucket)
                device_buckets[owner] = ParamBucket(kept.numel(), kept.dtype, kept.device)
        buckets[device] = device_buckets
    return buckets, Backing(backed, frozen, frozen_since, trained, frozen_first)


def watch_frozen_with_grads(backing: Backing, previous: Optional[Backing], world_size: int) -> None:
    """After a build: also watch the parameters frozen from the start that hold a gradient on some rank.

    A gradient from before (zeroed rather than released before the optimizer was built, rebuilt, or given the
    parameter with ``add_param_group``) makes the owner's optimizer step the frozen parameter (weight decay,
    momentum), as :func:`broadcast_frozen_since` describes; such a parameter was left out of that broadcast, so the
    replicas drifted apart, silently. Which ones hold a gradient differs between ranks (non-owners release theirs),
    so the ranks agree with one all-reduce when the set of frozen-from-the-start parameters changed: at the next
    step (:func:`agree_on_frozen_with_grads`), which every rank makes. A build does not communicate: ShardedDataParallel
    rebuilds on one rank alone when that rank alone switches to ``eval()`` (a validation pass on rank 0, perhaps
    followed by a barrier on the others), and a collective there would wait for ranks that make none or a different
    one. A rebuild that leaves the set as it was keeps the last agreement. A frozen parameter gets a gradient only by
    assignment, so the agreement stays valid.
    """
    first = backing.frozen_first
    if previous is not None and [id(p) for p, _ in previous.frozen_first] == [id(p) for p, _ in first]:
        backing.watched_first = None if previous.watched_first is None else list(previous.watched_first)
    elif first and world_size > 1:  # alone, the owner's value is the only one
        backing.watched_first = None
    else:
        backing.watched_first = []
    if backing.watched_first is not None:
        backing.frozen_since.extend(backing.watched_first)


def agree_on_frozen_with_grads(backing: Backing, group: Any) -> None:
    """At a step, before :func:`broadcast_frozen_since`: the ranks agree on which parameters frozen from the start
    hold a gradient on some rank, if a build since the last agreement changed that set (one small all-reduce)."""
    if backing.watched_first is not None:
        return
    first = backing.frozen_first
    flags = torch.tensor([int(p.grad is not None) for p, _ in first], dtype=torch.int32, device=first[0][0].device)
    collectives.all_reduce(flags, group=group, op="max")
    backing.watched_first = [entry for entry, flag in zip(first, flags.tolist()) if flag]
    backing.frozen_since.extend(backing.watched_first)


def _check_one_dtype_per_bucket(per_device: Dict[Any, List[List[torch.Tensor]]]) -> None:
    # A flat bucket has one dtype: a parameter of another dtype would silently become a view of a different dtype.
    for device, per_rank in per_device.items():
        for owner, params in enumerate(per_rank):
            dtypes = sorted({str(p.dtype) for p in params if p.requires_grad})
            if len(dtypes) > 1:
                raise FairscaleTypeError(
                    f"OSS: the trainable parameters that rank {owner} owns on {device} have several dtypes "
                    f"({', '.join(dtypes)}); OSS broadcasts them as one flat buffer of one dtype. Give the model's "
                    "parameters one dtype (e.g. model.float()), or put each dtype in its own OSS."
                )


@torch.no_grad()
def broadcast_buckets(buckets: Buckets, group: Any, local_to_global: Sequence[int], rank: int, fp16: bool) -> None:
    """Send every owner's bucket to all ranks (all broadcasts in flight at once), optionally as fp16.

    With ``fp16`` the buffers travel as half precision and come back in their own dtype, so every trainable
    parameter, the owner's included, ends up rounded to fp16 precision (as upstream; the ranks stay identical).
    A bucket holding a value that fp16 cannot represent (beyond +-65504; upstream turned it into inf on every
    rank) travels in its own dtype instead, for this step: the owners tell the others with one small all-reduce.

    Args:
        buckets: the buckets, ``{device: {owner: bucket}}``, with the same layout on every rank.
        group: the process group.
        local_to_global: the global rank of each group rank.
        rank: this process's rank in ``group``.
        fp16: broadcast as fp16 where the values fit.
    """
    ordered = [(owner, bucket) for device_buckets in buckets.values() for owner, bucket in device_buckets.items()]
    as_fp16 = _fits_fp16(ordered, group, rank) if fp16 else [False] * len(ordered)
    dtypes: Dict[int, torch.dtype] = {}
    for (_, bucket), half in zip(ordered, as_fp16):
        if half:
            dtypes[id(bucket)] = _buffer(bucket).dtype
            bucket.to(dtype=torch.float16, device=_buffer(bucket).device, keep_param_alignment=False)
    handles: List[WorkHandle] = []
    for owner, bucket in ordered:
        handle = collectives.broadcast(_buffer(bucket), src=local_to_global[owner], group=group, async_op=True)
        handles.append(cast(WorkHandle, handle))
    for handle in handles:
        handle.wait()
    for (_, bucket), half in zip(ordered, as_fp16):
        if half:
            # Back to the bucket's own dtype (upstream assumed fp32, turning an fp16/bf16 model into fp32).
            bucket.to(dtype=dtypes[id(bucket)], device=_buffer(bucket).device, keep_param_alignment=True)


@torch.no_grad()
def broadcast_frozen_since(
    frozen_since: List[Tuple[torch.Tensor, int]], group: Any, local_to_global: Sequence[int], rank: int
) -> None:
    """After a step: send the parameters frozen since an earlier build that their owner may have stepped.

    A frozen parameter that kept a gradient (``zero_grad(set_to_none=False)``, ShardedDataParallel's default, zeroes
    it rather than releasing it) is stepped by its owner's optimizer as a plain torch optimizer steps it on every
    rank under DDP (weight decay, momentum, Adam's moments keep moving it). It is in no bucket, so before, no other
    rank received the new value and the replicas drifted apart, silently. The owners flag the ones that have a
    gradient with one small all-reduce (only while such parameters exist: those frozen since an earlier build, and
    those frozen from the start that held a gradient at the last build, see :func:`watch_frozen_with_grads`), and
    each flagged one is broadcast from its owner, in its own dtype.

    Args:
        frozen_since: ``(parameter, owning rank)``, in the same order on every rank.
        group: the process group.
        local_to_global: the global rank of each group rank.
        rank: this process's rank in ``group``.
    """
    if not frozen_since or len(local_to_global) == 1:
        return  # alone, the owner's value is the only one
    owned = [int(owner == rank and param.grad is not None) for param, owner in frozen_since]
    flags = torch.tensor(owned, dtype=torch.int32, device=frozen_since[0][0].device)
    collectives.all_reduce(flags, group=group, op="max")
    staged: List[Tuple[torch.Tensor, torch.Tensor, WorkHandle]] = []
    for (param, owner), flag in zip(frozen_since, flags.tolist()):
        if flag:
            # Collectives need dense memory: a parameter whose .data was replaced by a strided one goes through a copy.
            target = param.data if param.data.is_contiguous() else param.data.contiguous()
            handle = collectives.broadcast(target, src=local_to_global[owner], group=group, async_op=True)
            staged.append((param, target, cast(WorkHandle, handle)))
    for param, target, handle in staged:
        handle.wait()
        if target is not param.data:
            param.data.copy_(target)


def _buffer(bucket: ParamBucket) -> torch.Tensor:
    if bucket.buffer is None:  # pragma: no cover - OSS never collapses its buckets
        raise FairscaleRuntimeError("OSS: a broadcast bucket has no buffer (internal error)")
    return bucket.buffer


_FP16_MAX = torch.finfo(torch.float16).max


def _fits_fp16(ordered: List[Tuple[int, ParamBucket]], group: Any, rank: int) -> List[bool]:
    """For each bucket, whether its owner's values all fit in fp16, agreed on every rank.

    Only the owner has the new values; it flags its buckets that do not fit, and a max all-reduce of the flags
    (one small tensor on the first bucket's device) tells every rank, so that sender and receivers pick the same
    dtype. fp16 buckets always fit; complex buckets never do (fp16 has no imaginary part).
    """
    if not ordered:
        return []
    device = _buffer(ordered[0][1]).device
    flags = torch.zeros(len(ordered), dtype=torch.int32, device=device)
    for i, (owner, bucket) in enumerate(ordered):
        buffer = _buffer(bucket)
        if buffer.is_complex():
            # The fp16 cast keeps the real part only (the imaginary one was erased on every rank, the owner's too):
            # complex buckets travel at full precision. Every rank flags them (the dtype is the same everywhere).
            flags[i] = 1
        elif owner == rank and buffer.dtype != torch.float16 and any(not p.requires_grad for p in bucket._params):
            # A parameter frozen since the buckets were built (refresh_trainable() not called yet) would be rounded
            # at every step although nothing trains it: the bucket travels in its own dtype until the refresh.
            flags[i] = 1
        elif owner == rank and buffer.dtype != torch.float16 and buffer.numel() > 0:
            # NaN compares false: a NaN travels as fp16 NaN, as the owner has it. inf (and anything beyond the
            # largest fp16 value) makes the bucket travel in its own dtype, so the value arrives as it is. Compared
            # in fp32: in bf16 the limit itself would round up to 65536, which fp16 cannot hold.
            flags[i] = (buffer.detach().abs().max().float() > _FP16_MAX).to(device=device, dtype=torch.int32)
    collectives.all_reduce(flags, group=group, op="max")
    return [not bool(f) for f in flags.tolist()]
