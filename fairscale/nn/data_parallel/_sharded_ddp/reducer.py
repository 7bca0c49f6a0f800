# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Gradient reduction to the owning rank, during backward: hooks, buckets and pending work.

Each trainable parameter gets one post-accumulate-grad hook, which fires once its gradient for this backward is
complete. The gradient is averaged over the group by a *reduce* to the rank whose OSS shard owns the parameter:
small gradients travel together in a :class:`GradBucket` per (device, owner, dtype), sent as soon as all of its
gradients are in; the others are reduced one by one. An end-of-backward callback sends what is left (buckets with
unused parameters) and waits for every reduction, so gradients are final when ``backward()`` returns.

A backward that reaches gradients which already hold this step's reduced values (gradient accumulation without
``no_sync()``: forward, backward, forward, backward; or two forwards, then two backwards) adds to them the average of
its own gradients, as torch's DDP does: before autograd accumulates into such a gradient, a pre-hook moves the reduced
value aside ("parks" it) so that only the new local gradient is reduced, and the reduction's completion adds the
parked value back. A reduced value is recognised by identity and version counter (recorded when its reduction
completed), so a gradient the user released, zeroed or replaced since is never parked (see :mod:`.parking`).

Inside ``no_sync()`` the hooks leave the gradients where they accumulate. The backward after the window reduces the
sum; a parameter that only the micro-batches inside the window used gets no hook call there, and is reduced at the
end of that backward (see :meth:`GradReducer._reduce_window`).

A wrapper acts on the first backward after each training forward and, once that one is reduced, on later backwards
only when they are its own (they run through the forward's output, or inside the forward; see :mod:`.own_backward`):
not on the backward of another wrapper built over the same module since, nor on a plain one through the module.

Every rank must produce the same reductions in the same order, i.e. run the same graph. Which parameters are
reduced follows each rank's own ``requires_grad`` flags, so the first reduction of every backward is preceded by one
all-reduce of two integers (a fingerprint of the flags) that checks that the ranks agree: a rank that froze a layer
alone would otherwise leave its peers waiting for reductions it never sends.
"""

import collections
import copy
import enum
import functools
import inspect
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch.autograd import Variable

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.internal.params import Workhandle
from fairscale.internal.tensor_hooks import current_graph_task
from fairscale.nn.misc.param_bucket import GradBucket

from . import own_backward
from .parking import ReducedValues
from .parking import buffer_of as _buffer
from .swapped import revive_swapped_hooks
from .trainable_agreement import TrainableAgreement

__all__ = ["HookState", "GradReducer"]


def _dispatch_hook(reducer_ref: "weakref.ReferenceType[GradReducer]", param: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._on_grad_ready(param)


def _dispatch_pre_hook(reducer_ref: "weakref.ReferenceType[GradReducer]", index: int, _: Any) -> None:
    reducer = reducer_ref()
    # Cheap when nothing holds a reduced value (the usual loop releases gradients before the next backward). Inside
    # no_sync() nothing is parked: no reduction of this backward would add it back.
    if reducer is not None and reducer._reduced.any_marked() and not reducer.accumulating:
        reducer._before_accumulate(reducer.trainable[index])


class _Reduction(Workhandle):
    """A pending reduction, and the tensor it writes into (``None``: a copy, see ``reduce_fp16``)."""

    def __init__(self, handle: Any, callback: Callable[[], Any], target: Optional[torch.Tensor]) -> None:
        super().__init__(handle, callback)
        self.target = target


class _WeakMethod:
    """Calling it returns the bound method it was built with, or ``None`` once the method's object is gone.

    ShardedDataParallel passes its own ``_describe_reduction`` and holds the reducer: a strong bound method would
    close the cycle wrapper -> reducer -> method -> wrapper, which only the cycle collector frees. Left to it, the
    wrapper (its process group, optimizers and buckets) was freed at interpreter exit, after
    ``destroy_process_group()``, where gloo now and then aborted the process.
    """

    def __init__(self, method: Optional[Callable[[], List[Any]]]) -> None:
        self._ref = weakref.WeakMethod(method) if method is not None else None

    def __call__(self) -> Optional[Callable[[], List[Any]]]:
        return self._ref() if self._ref is not None else None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_WeakMethod":
        # A weak reference cannot be copied; a deep copy of the wrapper (as with the strong method before) gets a
        # reducer that describes the copy: the method's object is already in ``memo`` then.
        return _WeakMethod(copy.deepcopy(self(), memo))


def _weak_callable(fn: Callable[[], List[Any]]) -> Callable[[], Optional[Callable[[], List[Any]]]]:
    """A getter for ``fn`` that holds a bound method weakly (see :class:`_WeakMethod`), other callables as they are."""
    if inspect.ismethod(fn):
        return _WeakMethod(fn)
    return lambda: fn


class HookState(enum.Enum):
    """Whether the backward hooks are in place (they are only while training)."""

    #: No hooks: never set up, or set up in eval mode (nothing to reduce).
    NONE = enum.auto()
    #: One hook per trainable parameter; buckets built for the current trainability.
    READY = enum.auto()


class GradReducer:
    """Owns the hooks, the gradient buckets and the queue of pending reductions of one ShardedDataParallel.

    Args:
        group: the process group.
        world_size (int): its size.
        bucket_size (int): the element capacity of each gradient bucket (0: no buckets).
        reduce_fp16 (bool): reduce unbucketed fp32 gradients as fp16.
        describe (Callable[[], List[Any]]): what the ranks must agree on before they reduce: one
            ``(name, requires_grad, hooked)`` tuple per managed parameter; compared across ranks at the first
            reduction of every backward. A bound method is held weakly (see :func:`_weak_callable`).
        strict_trainable (bool): once the ranks agreed, refuse a backward in which some managed parameter's
            ``requires_grad`` flag differs from whether it is hooked (trainability changed without a refresh).

    Nothing the reducer holds refers back to it or to its owner, so both are freed by reference counting as soon as
    the user drops them; the hooks are then taken off the parameters (see :meth:`__del__`).
    """

    def __init__(
        self,
        group: Any,
        world_size: int,
        bucket_size: int,
        reduce_fp16: bool,
        describe: Optional[Callable[[], List[Any]]] = None,
        strict_trainable: bool = False,
    ) -> None:
        self.group = group
        self.world_size = world_size
        self._describe = _weak_callable(describe) if describe is not None else None
        self._agreement = TrainableAgreement(self._describe, strict_trainable, group, world_size)
        #: Whether this backward's reductions were preceded by the agreement check.
        self._agreement_checked = False
        self.scaling = 1.0 / world_size
        self.bucket_size = bucket_size
        self.reduce_fp16 = reduce_fp16
        self.state = HookState.NONE
        #: True inside ``no_sync()``: hooks leave the gradients where they accumulate.
        self.accumulating = False
        self.trainable: List[torch.Tensor] = []
        self._impls: List[int] = []  # the C++ tensor of each hooked parameter (a swap replaces it, and its hooks)
        self._owner: Dict[int, int] = {}  # id(param) -> destination global rank
        self._is_owner: Dict[int, bool] = {}
        self._bucket_of: Dict[int, GradBucket] = {}
        self.buckets: List[GradBucket] = []
        self._pending: Dict[int, bool] = {}  # id(param) -> still to be reduced in this backward
        self._handles: Deque[Workhandle] = collections.deque()
        self._hook_handles: List[Any] = []
        self._callback_queued = False
        #: Whether the last forward ran in training mode (its backward, and a later one of it, reduce).
        self._forward_training = False
        #: A training forward with grad ran and its backward has not finished yet.
        self.awaiting_backward = False
        # Gradients holding a completed reduction's result, and those results moved aside by a later backward: see
        # the module docstring. Never reassigned: completion callbacks hold it, not the reducer.
        self._reduced = ReducedValues()
        # Inside no_sync(): the parameters (by id) whose gradient accumulated there since the last reduced backward,
        # and whether a training forward or backward ran there at all (every rank alike): see _reduce_window.
        self._window: Set[int] = set()
        self._window_open = False
        # Once a backward after the last training forward was reduced, a later one is reduced only while a pre-hook
        # on an output of this wrapper's says it runs through it (see .own_backward).
        self._backward_done = False
        self._outputs_watched = False
        #: Set for the duration of a backward that runs through an output of this wrapper's training forwards.
        self.own_backward_running = False

    # ------------------------------------------------------------------------------------------------
    # Set-up

    def setup(self, trainable: Sequence[torch.Tensor], owners: Dict[int, Tuple[int, bool]], training: bool) -> None:
        """Rebuild buckets and hooks for ``trainable`` (sorted by size); ``owners``: ``{id: (dst, mine)}``."""
        self.remove_hooks()
        # Gradients holding a reduced value stay marked across the rebuild (the buckets copy their values): an eval()
        # forward between two backwards of one step, or freezing, made the next backward reduce them again.
        held = self._reduced.held(self.trainable, self._bucket_of)
        hooked = dict(zip(map(id, self.trainable), self._impls))
        self._reduced.restore()
        self.trainable = list(trainable)
        self._owner = {pid: dst for pid, (dst, _) in owners.items()}
        self._is_owner = {pid: mine for pid, (_, mine) in owners.items()}
        # refresh_trainable() between a forward and its backward: that backward reduced nothing (fuzz, session 42).
        self._pending = {id(p): True for p in self.trainable if self.awaiting_backward and self._pending.get(id(p))}
        self._bucket_of = {}
        self.buckets = []
        if not training:
            self.state = HookState.NONE
            self._impls = []  # no hooks to lose (the next training forward sets up again)
            self._reduced.remark(self.trainable, self._bucket_of, held)
            return
        for param in self.trainable:
            if param.grad is not None and param.grad.requires_grad:
                raise RuntimeError("ShardedDataParallel only works with gradients that don't require grad")
        if self.bucket_size > 0:
            self._setup_buckets()
        revive_swapped_hooks(self.trainable, hooked)
        for index, param in enumerate(self.trainable):
            register = cast(Any, param).register_post_accumulate_grad_hook  # untyped in torch's stubs
            # The parameter (held by C++ autograd) must not keep the reducer alive: a dropped wrapper stops
            # reducing. One still alive leaves alone the backwards that are not its own (_follows_own_forward), so
            # a model wrapped again is reduced by its new wrapper only.
            self._hook_handles.append(register(functools.partial(_dispatch_hook, weakref.ref(self))))
            # Runs before autograd accumulates into the gradient (it may park a reduced value first). The parameter
            # is found by its index (the hooks are rebuilt with ``trainable``), not held: the hook is stored on it, and
            # a weak reference would make torch refuse to swap it (``set_swap_module_params_on_conversion``).
            pre_hook = functools.partial(_dispatch_pre_hook, weakref.ref(self), index)
            self._hook_handles.append(cast(Any, param).register_hook(pre_hook))
        self._impls = [param._cdata for param in self.trainable]
        self._reduced.remark(self.trainable, self._bucket_of, held)
        self.state = HookState.READY

    def _setup_buckets(self) -> None:
        # A bucket gives every gradient a view of it, a zero one where there was none: such a parameter then had a
        # zero gradient after each rebuild (the first forward, eval -> train, freezing, add_param_group), even right
        # after optimizer.zero_grad(), and weight decay or momentum moved a parameter no rank used (a plain
        # optimizer, DDP and reduce_buffer_size=0 leave it alone). Released again below: a gradient that arrives
        # later is copied into its slot, as after any optimizer.zero_grad().
        released = [param for param in self.trainable if param.grad is None]
        by_key: Dict[Tuple[torch.device, int, torch.dtype], GradBucket] = {}
        for param in self.trainable:
            dst = self._owner[id(param)]
            key = (param.device, dst, param.dtype)
            bucket = by_key.get(key)
            if bucket is None:
                bucket = GradBucket(self.bucket_size, param.dtype, param.device, destination=dst)
                by_key[key] = bucket
            if bucket.can_add_grad_view(param):
                bucket.add_grad(param)
                self._bucket_of[id(param)] = bucket
        # Buckets that got no gradient are dropped: every rank drops the same ones.
        self.buckets = [b for b in by_key.values() if b._params]
        for bucket in self.buckets:
            bucket.shrink()
        for param in released:
            param.grad = None
        for param in self.trainable:
            bucket = self._bucket_of.get(id(param))
            if bucket is not None and param.grad is not None:
                # A new view: GradBucket swaps a gradient's storage (as upstream), keeping its version counter, so its
                # zero_() did not move the buffer's, and a later no_sync() window was reduced wrong (fuzz, session 42).
                param.grad = bucket.slot(param)
        for param in self.trainable:
            grad = param.grad
            if id(param) not in self._bucket_of and grad is not None and grad._base is not None:
                # Left a view of an earlier bucket, it shared that buffer's version counter (parking's sign of a
                # reduced value): a second reduced backward of the step reduced its earlier result again.
                param.grad = grad.clone()

    def buckets_stale(self) -> bool:
        """Whether the parameters' dtype or device changed since the buckets were built, or torch swapped them.

        ``module.half()`` / ``.double()`` (``nn.Module``'s, which ``ShardedDataParallel.to`` does not see) cast every
        parameter: the next backward assigned a gradient slot of the old dtype to them and failed inside torch.
        One parameter per bucket is compared (a cast changes them all). Under torch's swap setting
        (``set_swap_module_params_on_conversion(True)``, the default for tensor subclasses) any conversion, even
        ``.to()`` of the current device, gives the parameter objects new contents, and the hooks registered on the
        old ones are gone: each parameter is compared (a submodule may have been converted alone).
        """
        if any(param._cdata != impl for param, impl in zip(self.trainable, self._impls)):
            return True
        for bucket in self.buckets:
            first = bucket._params[0]
            buffer = bucket.buffer
            if buffer is not None and (first.dtype != buffer.dtype or first.device != buffer.device):
                return True
        return False

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self.state = HookState.NONE

    def __del__(self) -> None:
        # The parameters outlive a dropped wrapper (the model is the user's): without this, each of them would keep
        # one dead hook per wrapper it was ever wrapped by. getattr: __init__ may have failed before the list existed.
        for handle in getattr(self, "_hook_handles", ()):
            handle.remove()
        # Work still pending here was left by a backward that raised before its end-of-backward flush. It is
        # released, not waited for: its peers may never send their part (they may have failed too), and a wait in a
        # finalizer would then block the process for the whole collective timeout. Its completion callbacks (which
        # drop or restore gradients) are not run either: the gradients of a failed backward mean nothing.
        pending = getattr(self, "_handles", None)
        if pending is not None:
            pending.clear()

    # ------------------------------------------------------------------------------------------------
    # Per iteration

    def abandon_failed_backward(self) -> None:
        """Finish the reductions a backward that raised left pending (before its flush), at the next forward or
        ``zero_grad()``. Left pending, gloo went on writing the reduced values into the gradients after the user's ``zero_grad()``,
        and their completion callbacks ran in the next backward, marking stale tensors as reduced results (later
        steps silently off; found by a fuzz of recovery after exceptions, session 39). They are waited for (every
        rank issued them: a rank whose backward failed elsewhere waits until the group's timeout, as at any
        mismatched collective), their callbacks are dropped and what they wrote is zeroed (a sum of partial
        gradients: written after the user's zero_grad(set_to_none=False), it undid it); what the failed backward had
        parked goes back where the gradients were not cleared since (:meth:`ReducedValues.abandon`).
        """
        if current_graph_task() != -1 or not (self._handles or self._callback_queued or self._reduced.parks()):
            return  # inside a backward, or the last one finished (its flush reset all three)
        with torch.no_grad():
            while self._handles:
                work = self._handles.popleft()
                work.handle.wait()
                target = getattr(work, "target", None)
                if target is not None:
                    target.zero_()
        self._reduced.abandon()
        self._callback_queued = False

    def clear_counters(self, training: bool) -> None:
        """A forward starts: every trainable parameter is to be reduced in the coming backward."""
        self.abandon_failed_backward()
        self._forward_training = training
        self._reduced.drop_released()
        if training and torch.is_grad_enabled() and current_graph_task() == -1:
            # A new graph: its first backward is reduced, whatever tensor of it the loss is built from (the output is
            # watched once the forward returned; until then, backwards inside the forward are this wrapper's).
            self._backward_done = False
            self._outputs_watched = False
            self.own_backward_running = False
        if training and torch.is_grad_enabled():
            # Not a forward under no_grad (a teacher or logging forward in train() mode): it has no backward, and
            # marking every parameter pending made reduce() reduce the held results again instead of raising.
            self._pending = {id(p): True for p in self.trainable}
            self.awaiting_backward = True
            self._window_open = self._window_open or self.accumulating
        self._callback_queued = False
        self._agreement_checked = False
        for bucket in self.buckets:
            bucket.reset_checked_in()

    def watch_outputs(self, output: Any) -> None:
        """A training forward returned ``output``: later backwards through it are this wrapper's own."""
        if self.state != HookState.READY or not self._forward_training or not torch.is_grad_enabled():
            return
        # A recomputation in a backward too (a reentrant checkpoint of the wrapper): its nested backward is its own.
        nodes = own_backward.graph_nodes(output)
        own_backward.watch(nodes, self)
        # Backwards already run inside the forward (manual optimization): a backward after it is nobody's.
        self._outputs_watched = bool(nodes) or self._backward_done

    def _follows_own_forward(self) -> bool:
        """Whether this wrapper acts on the running backward: the first one after its training forward, one that
        runs through that forward's output or inside that forward, or any when the output could not be watched."""
        return self.own_backward_running or not (self._backward_done and self._outputs_watched)

    @property
    def has_pending(self) -> bool:
        return any(self._pending.values())

    @torch.no_grad()
    def _before_accumulate(self, param: torch.Tensor) -> None:
        """Autograd is about to accumulate into ``param.grad``: park the reduced value it may hold (see module doc)."""
        pid = id(param)
        if not self._follows_own_forward():
            return  # another wrapper's backward, or a plain one through the module: none of this wrapper's business
        if not self._pending.get(pid, False) and not self._starts_new_round(pid):
            return  # this backward will not reduce the parameter: what it holds must stay where it is
        bucket = self._bucket_of.get(pid)
        if bucket is None:
            self._reduced.park_direct(param, self._is_owner[pid])
        else:
            self._reduced.park_bucket(param, bucket, self._is_owner[pid])

    def _starts_new_round(self, pid: int) -> bool:
        """Whether a gradient of an already reduced parameter starts a new round of reductions: the first one of a new
        backward, after a training forward whose hooked parameters were all reduced (two forwards then two
        backwards over the same parameters, or ``backward(retain_graph=True)`` twice). A backward that reaches only
        some of them again (another loss head, a parameter used inside and outside a reentrant checkpoint) is left as
        upstream left it: not reduced again."""
        return (
            pid in self._pending
            and not self._callback_queued
            and self._forward_training
            and not any(self._pending.values())
        )

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.accumulating:
            self._window.add(id(param))
            self._window_open = True
            return
        if not self._follows_own_forward():
            return  # reducing it raced with the module's new wrapper, or waited for peers that ran no such backward
        if not self._pending.get(id(param), False):
            if not self._starts_new_round(id(param)):
                # Not hooked for this forward, reduced already in this backward or round, or a backward after an
                # eval() forward (gradients stay local, as documented).
                return
            # It is reduced too, and adds to the earlier result.
            self._pending = {id(p): True for p in self.trainable}
            for each in self.buckets:
                each.reset_checked_in()
        if not self._agreement_checked:
            self._agreement_checked = True
            self._agreement.check(param.device)
        if param.grad is None:  # frozen after the forward (the agreement above saw every rank freeze it alike)
            raise FairscaleRuntimeError(
                f"ShardedDataParallel: a parameter of shape {tuple(param.shape)} had requires_grad turned off between "
                "the forward and its backward, so it got no gradient to reduce. Freeze parameters before the forward "
                "(with auto_refresh_trainable=True the next forward takes the change into account)."
            )
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self.flush)
        self._dispatch(param)
        self._consume_completed()

    def _dispatch(self, param: torch.Tensor) -> None:
        """Mark ``param`` reduced in this round and send its gradient (directly, or checked into its bucket)."""
        self._pending[id(param)] = False
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            self._reduce_direct(param)
        else:
            self._check_into_bucket(param, bucket)

    def _reduce_direct(self, param: torch.Tensor) -> None:
        grad = cast(torch.Tensor, param.grad)  # checked in _on_grad_ready
        grad.mul_(self.scaling)
        dst = self._owner[id(param)]
        mine = self._is_owner[id(param)]
        # An alias (sharing storage, not the object): gloo holds what it reduces for a while after the work completes,
        # and torch refuses to swap a tensor held elsewhere (a cast under ``set_swap_module_params_on_conversion``).
        wire = grad.half() if self.reduce_fp16 and grad.dtype == torch.float32 else grad.detach()
        handle = collectives.reduce(wire, dst, group=self.group, async_op=True)
        reduced = self._reduced  # not self: a pending callback must not hold the reducer

        def done() -> None:
            if not mine:
                # The reduced value lives on the owner only; dropping it here is what saves the memory.
                param.grad = None
                return
            if wire.data_ptr() != grad.data_ptr():
                grad.copy_(wire)
            reduced.direct_reduced(param, grad)

        # What gloo writes into: the gradient itself, unless reduce_fp16 made a copy.
        self._handles.append(_Reduction(handle, done, wire if wire.data_ptr() == grad.data_ptr() else None))

    @torch.no_grad()
    def _check_into_bucket(self, param: torch.Tensor, bucket: GradBucket) -> None:
        grad = cast(torch.Tensor, param.grad)  # checked in _on_grad_ready
        slot = bucket.slot(param)
        if grad.data_ptr() != slot.data_ptr():
            # The gradient was replaced (e.g. zero_grad(set_to_none=True) on the optimizer, then a fresh
            # gradient from autograd): bring its value into the bucket so the bucket reduces what autograd
            # computed. Upstream reduced the stale bucket instead.
            slot.copy_(grad)
            param.grad = slot
        bucket.params_checked_in += 1
        if bucket.all_checked_in:
            self._send(bucket)

    def _send(self, bucket: GradBucket) -> None:
        buffer = _buffer(bucket)
        buffer.mul_(self.scaling)
        bucket.sent = True
        handle = collectives.reduce(buffer, bucket.destination, group=self.group, async_op=True)
        done = functools.partial(self._reduced.bucket_reduced, bucket, buffer)
        self._handles.append(_Reduction(handle, done, buffer))

    def _consume_completed(self) -> None:
        while self._handles and self._handles[0].handle.is_completed():
            self._finish(self._handles.popleft())

    @staticmethod
    def _finish(work: Workhandle) -> None:
        work.handle.wait()
        if work.callback is not None:
            work.callback()

    def flush(self) -> None:
        """End of backward: reduce what accumulated inside ``no_sync()`` and was not reached since, send the buckets
        not sent yet, then wait for every reduction, in order."""
        if self._window_open and not self.accumulating:
            self._reduce_window()
        for bucket in self.buckets:
            if not bucket.sent:
                if bucket.params_checked_in == 0:
                    self._reduced.park_unreached_bucket(bucket, self._is_owner[id(bucket._params[0])])
                self._send(bucket)
        while self._handles:
            self._finish(self._handles.popleft())
        self._callback_queued = False
        self._agreement_checked = False
        self.awaiting_backward = False
        self._backward_done = True

    def manual_reduce(self) -> None:
        """Reduce everything still pending now (after a backward run inside ``no_sync()``)."""
        if not self.has_pending:
            raise FairscaleRuntimeError(
                "ShardedDataParallel.reduce: No grads waiting to be reduced, maybe that this was called twice or "
                "there was no BW pass ? Call reduce() once, after the last backward run inside no_sync()."
            )
        # Outside of a backward there is no autograd engine to queue the flush on: it runs right here.
        self._callback_queued = True
        if not self.accumulating:
            # Every pending gradient is reduced below, those of the no_sync() window included.
            self._window.clear()
            self._window_open = False
        running, self.own_backward_running = self.own_backward_running, True  # an explicit call: this wrapper's
        try:
            for param in self.trainable:
                if param.grad is None and self._pending.get(id(param), False) and not self.accumulating:
                    self._zero_unused_grad(param)
                self._on_grad_ready(param)
        finally:
            self.own_backward_running = running
        self.flush()

    def _reduce_window(self) -> None:
        """Reduce the gradients that accumulated inside ``no_sync()`` and that this reduced backward did not reach.

        Such a parameter (used only by the micro-batches inside the window) gets no hook call in the backward after
        it, so its gradient was never reduced and its owner stepped with its own local sum; torch's DDP reduces it (it
        records which parameters were used since its last reduction). Which parameters those are is agreed with one
        all-reduce (max) of one flag per hooked parameter, once per window, so that every rank sends the same
        reductions; a rank that did not use one sends zeros.
        """
        window, self._window = self._window, set()
        self._window_open = False
        if not self.trainable:
            return
        flags = [int(id(p) in window and self._pending.get(id(p), False)) for p in self.trainable]
        if self.world_size > 1:
            agreed = torch.tensor(flags, dtype=torch.int32, device=self.trainable[0].device)
            collectives.all_reduce(agreed, group=self.group, op="max")
            flags = agreed.tolist()
        for param, flag in zip(self.trainable, flags):
            if not flag:
                continue
            if param.grad is None:
                self._zero_unused_grad(param)
            self._dispatch(param)

    @torch.no_grad()
    def _zero_unused_grad(self, param: torch.Tensor) -> None:
        """Give a parameter that got no gradient (unused in the backwards run inside ``no_sync()``) a zero one.

        A bucketed parameter's gradient is its slot, which takes part in its bucket's reduction whether or not the
        parameter was used (zero when unused): an unbucketed one is reduced the same way, as a zero gradient
        (before, ``reduce()`` failed with an internal error). It also keeps the reductions matched across ranks when
        a parameter was used on some ranks only: every rank sends its part.
        """
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            param.grad = torch.zeros_like(param)
            return
        # The gradient was released (e.g. zero_grad(set_to_none=True) on the optimizer): its slot stands for it.
        slot = bucket.slot(param)
        slot.zero_()
        param.grad = slot

    # ------------------------------------------------------------------------------------------------
    # Gradient buffers

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool, params: Sequence[torch.Tensor]) -> None:
        """Zero (or release) the gradients of ``params``; bucketed trainable ones stay views, zeroed."""
        self.abandon_failed_backward()
        # Nothing reduced earlier is owed any more, nor is an abandoned no_sync() window (its parameters, released
        # here, got zero gradients at the next backward, and weight decay stepped them).
        self._reduced.clear()
        self._window, self._window_open = set(), False
        for param in params:
            in_bucket = id(param) in self._bucket_of and param.requires_grad
            if set_to_none and not in_bucket:
                # A parameter frozen since the buckets were built gets None too, as a plain optimizer's would,
                # so that it is not stepped with a zero gradient.
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        for bucket in self.buckets:
            bucket.zero()

    def bucket_devices(self) -> List[torch.device]:
        return list(dict.fromkeys(_buffer(bucket).device for bucket in self.buckets))

    def is_bucketed(self, param: torch.Tensor) -> Optional[GradBucket]:
        return self._bucket_of.get(id(param))
