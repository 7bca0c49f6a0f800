# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which gradients hold a completed reduction's result, and the results a later backward moved aside ("parked").

A backward outside ``no_sync()`` that reaches gradients already holding this step's reduced values must reduce only
its own new gradients and add the earlier results back (see :mod:`.reducer`). A reduced value is recognised by
identity and version counter (a *mark*, recorded when its reduction completed), so a gradient the user released,
zeroed or replaced since is never parked. Marks hold their tensors (a weak reference would make torch refuse to swap
them: ``torch.__future__.set_swap_module_params_on_conversion(True)`` then ``model.half()``), and the reducer drops
the marks of released gradients at each forward (:meth:`ReducedValues.drop_released`), so that a gradient set to
``None`` is freed before the next forward, as without the wrapper. Bucketed gradients are views of their bucket's buffer and share its
version counter: a bucket is marked as a whole, with the set of its parameters whose slots are owed (``None``: all
of them; a subset after a rebuild of the buckets, see :meth:`ReducedValues.held` and :meth:`ReducedValues.remark`).
"""

from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set, Tuple, cast

import torch

from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.misc.param_bucket import GradBucket

__all__ = ["ReducedValues", "will_accumulate"]


class Mark(NamedTuple):
    """A tensor holding a reduction's result: the object, its version counter, its C++ contents then, and the
    parameter whose gradient it is (``None`` for a bucket's buffer)."""

    tensor: torch.Tensor
    version: int
    impl: int
    param: Optional[torch.Tensor] = None


def buffer_of(bucket: GradBucket) -> torch.Tensor:
    if bucket.buffer is None:  # pragma: no cover - the reducer never collapses its buckets
        raise FairscaleRuntimeError("ShardedDataParallel: a gradient bucket has no buffer (internal error)")
    return bucket.buffer


def _grad_accumulator(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of a leaf."""
    get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    # Grad mode on: the caller runs in a backward hook under no_grad, and torch < 2.4's get_gradient_edge reaches a
    # leaf's node through a view it builds without enabling grad (the view then has no grad_fn).
    with torch.enable_grad():
        if get_edge is not None:
            return get_edge(param).node
        return cast(Any, param.view_as(param).grad_fn).next_functions[0][0]  # torch < 2.2: no get_gradient_edge


def will_accumulate(param: torch.Tensor) -> bool:
    """Whether this backward accumulates into ``param.grad`` (``autograd.grad()`` runs leaf hooks but never does)."""
    try:
        return bool(torch._C._will_engine_execute_node(_grad_accumulator(param)))
    except RuntimeError:  # torch refuses the question for a leaf inside autograd.grad(): no accumulation there
        return False


def _mark(tensor: torch.Tensor, param: Optional[torch.Tensor] = None) -> Mark:
    return Mark(tensor, tensor._version, tensor._cdata, param)


def _still_marked(tensor: Optional[torch.Tensor], mark: Mark) -> bool:
    """Whether ``tensor`` still holds the marked result: the same object, not modified in place since (zeroed), or
    converted by a swap (``torch.utils.swap_tensors`` gives it new contents, with a version counter of their own)."""
    return tensor is mark.tensor and (tensor._version == mark.version or tensor._cdata != mark.impl)


def _holds_slot(param: torch.Tensor, bucket: GradBucket) -> bool:
    """Whether ``param.grad`` is (a tensor over) its slot of the bucket, i.e. was not released or replaced."""
    grad = param.grad
    return grad is not None and grad.data_ptr() == bucket.slot(param).data_ptr()


# How far a gradient converted away and back (``model.half()`` then ``.float()``, ``float64 -> float32 -> float64``)
# may be from its slot: a round trip through bfloat16 keeps 8 bits of mantissa, through float16 11 bits, and float16's
# subnormals are spaced 2**-24 apart.
_ROUND_TRIP_RTOL = 2.0**-7
_ROUND_TRIP_ATOL = 2.0**-24


class BucketMark(NamedTuple):
    """A bucket holding a completed reduction's result: its buffer's mark, the parameters whose slots are owed
    (``None``: all of them), and the gradient objects that were views of their slot then (by parameter id; held
    until the mark goes, at the latest at the next forward or backward: views of the bucket, no memory of their own
    unless a conversion gave them some)."""

    mark: Mark
    subset: Optional[FrozenSet[int]]
    grads: Dict[int, torch.Tensor]


def _bucket_mark(bucket: GradBucket, buffer: torch.Tensor, subset: Optional[FrozenSet[int]]) -> BucketMark:
    # Every gradient there is (a reduction leaves each one in its slot): checking each slot here cost a view per
    # parameter and step; a gradient recorded that was not in its slot must still match the slot's value to count.
    grads = {id(p): p.grad for p in bucket._params if p.grad is not None}
    return BucketMark(_mark(buffer), subset, grads)


@torch.no_grad()
def _holds_converted_slot(param: torch.Tensor, bucket: GradBucket, entry: BucketMark) -> bool:
    """Whether ``param.grad`` is its slot's value converted: ``model.double()`` / ``.half()`` / ``.to()`` swapped the
    storage of the very gradient object that viewed the slot when the bucket was marked (torch's default conversion,
    and the one the wrappers force) for one in the new dtype or device, and left the bucket untouched. The reduced
    value it holds stays owed (before, the next backward reduced it again with the other ranks' gradients: silently
    wrong parameters). Two casts in a row may have rounded it (through a narrower dtype and back), hence the
    tolerance; the identity keeps out a fresh gradient that equals the reduced value by chance (integer-valued
    gradients of an ``abs().sum()`` loss do)."""
    grad = param.grad
    recorded = entry.grads.get(id(param))
    if grad is None or recorded is not grad or grad.shape != param.shape:
        return False
    if not (grad.is_floating_point() or grad.is_complex()):
        return False
    slot = bucket.slot(param).to(device=grad.device, dtype=grad.dtype)
    return bool(torch.allclose(grad, slot, rtol=_ROUND_TRIP_RTOL, atol=_ROUND_TRIP_ATOL))


def _rebind_converted(bucket: GradBucket, entry: BucketMark) -> None:
    """Owed gradients that casts moved out of their slot while the bucket kept its dtype (two casts with no forward
    between: ``model.half()`` then ``.float()``) go back into it, with their (possibly rounded) value, as a plain
    model keeps them. Before, autograd accumulated into the moved tensor and the bucket reduced the earlier result
    again with the new gradient."""
    for each in bucket._params:
        if (entry.subset is None or id(each) in entry.subset) and not _holds_slot(each, bucket):
            if _holds_converted_slot(each, bucket, entry):
                slot = bucket.slot(each)
                slot.copy_(cast(torch.Tensor, each.grad))
                each.grad = slot


class ReducedValues:
    """The marks and parked values of one reducer.

    Completion callbacks of pending reductions hold this object, never the reducer (nothing here refers back to
    it), so that a dropped wrapper is still freed by reference counting.
    """

    def __init__(self) -> None:
        # Unbucketed gradients by id(param); buckets by id(bucket), with the parameters whose slots are owed.
        self.marks: Dict[int, Mark] = {}
        self.bucket_marks: Dict[int, BucketMark] = {}
        # Reduced values moved aside until this backward's own reduction completes (owner ranks only).
        self.parked: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, reduced gradient)
        self.parked_buckets: Dict[int, Tuple[GradBucket, torch.Tensor]] = {}  # id(bucket) -> (bucket, values)

    def parks(self) -> bool:
        """Whether a reduced value is parked (only while a backward runs, or after one that raised)."""
        return bool(self.parked or self.parked_buckets)

    def any_marked(self) -> bool:
        return bool(self.marks or self.bucket_marks)

    def clear(self) -> None:
        """Nothing reduced earlier is owed any more (the gradients were zeroed or released)."""
        self.parked.clear()
        self.parked_buckets.clear()
        self.marks.clear()
        self.bucket_marks.clear()

    @torch.no_grad()
    def restore(self) -> None:
        """Put parked values back where they came from and forget every mark (the buckets are about to change)."""
        for param, reduced in self.parked.values():
            param.grad = reduced if param.grad is None else param.grad.add_(reduced)
        for bucket, reduced in self.parked_buckets.values():
            buffer_of(bucket).add_(reduced)
        self.clear()

    @torch.no_grad()
    def abandon(self) -> None:
        """A backward raised with values parked: give them back only where the gradients still hold something.

        An optimizer's ``zero_grad()`` after the failure (the usual way to skip the batch) cannot see a parked value:
        given back unconditionally, it came back and the next step applied the dropped step (as FSDP's recovery
        does, a gradient that is ``None`` or all zero counts as cleared).
        """
        for param, reduced in self.parked.values():
            grad = param.grad
            if grad is not None and bool(grad.any()):
                param.grad = reduced  # the failed backward's partial gradient goes; the completed one stays
        for bucket, reduced in self.parked_buckets.values():
            grads = [p.grad for p in bucket._params]
            if any(g is not None and _holds_slot(p, bucket) and bool(g.any()) for p, g in zip(bucket._params, grads)):
                buffer_of(bucket).add_(reduced)
        self.clear()

    def drop_released(self) -> None:
        """Forget the unbucketed gradients released or replaced since their reduction (their marks held them)."""
        for pid, mark in list(self.marks.items()):
            if cast(torch.Tensor, mark.param).grad is not mark.tensor:
                del self.marks[pid]

    def held(self, trainable: Sequence[torch.Tensor], bucket_of: Dict[int, GradBucket]) -> Set[int]:
        """The parameters (by id) whose gradient holds a reduced value now: kept across a rebuild of the buckets
        (an ``eval()`` forward between two backwards of one step, freezing), which copies the values into the new
        buckets. Forgetting them made the next backward reduce the earlier result again."""
        held: Set[int] = set()
        for param in trainable:
            pid = id(param)
            bucket = bucket_of.get(pid)
            if bucket is None:
                mark = self.marks.get(pid)
                if mark is not None and _still_marked(param.grad, mark):
                    held.add(pid)
                continue
            entry = self.bucket_marks.get(id(bucket))
            if entry is None or not _still_marked(buffer_of(bucket), entry.mark):
                continue
            if (entry.subset is None or pid in entry.subset) and (
                _holds_slot(param, bucket) or _holds_converted_slot(param, bucket, entry)
            ):
                held.add(pid)
        return held

    def remark(self, trainable: Sequence[torch.Tensor], bucket_of: Dict[int, GradBucket], held: Set[int]) -> None:
        """Mark again, in the new layout, the gradients that held a reduced value before the rebuild."""
        owed: Dict[int, Tuple[GradBucket, List[int]]] = {}
        for param in trainable:
            if id(param) not in held or param.grad is None:
                continue
            bucket = bucket_of.get(id(param))
            if bucket is None:
                self.marks[id(param)] = _mark(param.grad, param)
            elif _holds_slot(param, bucket):
                owed.setdefault(id(bucket), (bucket, []))[1].append(id(param))
        for bucket, pids in owed.values():
            subset = None if len(pids) == len(bucket._params) else frozenset(pids)
            self.bucket_marks[id(bucket)] = _bucket_mark(bucket, buffer_of(bucket), subset)

    @torch.no_grad()
    def park_direct(self, param: torch.Tensor, mine: bool) -> None:
        """Autograd is about to accumulate into the unbucketed ``param.grad``: move a reduced value it holds aside."""
        pid = id(param)
        mark = self.marks.pop(pid, None)
        if mark is None or not _still_marked(param.grad, mark):
            return  # released, zeroed or replaced since its reduction: nothing of it is owed
        if not will_accumulate(param):
            self.marks[pid] = mark  # autograd.grad(): .grad stays as it is
            return
        if mine:
            self.parked[pid] = (param, cast(torch.Tensor, param.grad))
        # Autograd then stores the new gradient alone (elsewhere than the owner, what it held was scratch).
        param.grad = None

    @torch.no_grad()
    def park_bucket(self, param: torch.Tensor, bucket: GradBucket, mine: bool) -> None:
        """Autograd is about to accumulate into the first gradient of ``bucket`` this backward reaches.

        Decided for the whole bucket, from each slot: the parameter that happens to come first may have had its
        gradient released (unused by the micro-batch before) while its neighbours hold reduced values.
        Before, such a first parameter left the whole bucket unparked, and its reduced values were reduced again.
        The owed slots that still hold their gradient are parked (on the owner) and zeroed; released slots are
        zeroed too (a new gradient is copied into them); the others keep their local values, which are reduced.
        """
        entry = self.bucket_marks.get(id(bucket))
        if entry is None or not will_accumulate(param):
            return  # nothing owed, or autograd.grad(): the gradients stay as they are
        self._park_owed(bucket, mine)

    @torch.no_grad()
    def park_unreached_bucket(self, bucket: GradBucket, mine: bool) -> None:
        """End of a reduced backward that reached no gradient of ``bucket``: it is sent anyway (every rank sends
        every bucket, whichever parameters its backward used), so a reduced value it holds from an earlier backward
        of the step is parked first and added back when this (zero) reduction completes. Before, that value was
        reduced again (a parameter used by one reduced backward of a step and not by the next: one task head per
        micro-batch)."""
        self._park_owed(bucket, mine)

    def _park_owed(self, bucket: GradBucket, mine: bool) -> None:
        entry = self.bucket_marks.pop(id(bucket), None)
        if entry is None:
            return
        buffer = buffer_of(bucket)
        if not _still_marked(buffer, entry.mark):
            return
        _rebind_converted(bucket, entry)
        subset = entry.subset
        owed: List[torch.Tensor] = []
        released: List[torch.Tensor] = []
        kept = False
        for each in bucket._params:
            if not _holds_slot(each, bucket):
                released.append(each)
            elif subset is None or id(each) in subset:
                owed.append(each)
            else:
                kept = True
        if not owed:
            return
        if mine:
            if kept or released:
                parked = torch.zeros_like(buffer)
                for each in owed:
                    parked.narrow(0, bucket._offsets[id(each)], each.numel()).copy_(bucket.slot(each).flatten())
            else:
                parked = buffer.clone()
            self.parked_buckets[id(bucket)] = (bucket, parked)
        # Elsewhere the bucket holds the reduction's scratch, which must not be sent again.
        if kept:
            for each in owed + released:
                bucket.slot(each).zero_()
        else:
            buffer.zero_()

    def direct_reduced(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` (the owner's ``param.grad``) now holds its reduced value: add back what was parked, and mark."""
        earlier = self.parked.pop(id(param), None)
        if earlier is not None:
            grad.add_(earlier[1])
        if param.grad is grad:
            self.marks[id(param)] = _mark(grad, param)

    @torch.no_grad()
    def bucket_reduced(self, bucket: GradBucket, buffer: torch.Tensor) -> None:
        """A bucket's reduction completed: add back what an earlier reduction left there, and mark the result."""
        earlier = self.parked_buckets.pop(id(bucket), None)
        if earlier is not None:
            buffer.add_(earlier[1])
        self.bucket_marks[id(bucket)] = _bucket_mark(bucket, buffer, None)
