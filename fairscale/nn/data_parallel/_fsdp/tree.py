# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Bookkeeping shared by every FSDP instance of one wrapped tree; owned by the root and created at its lazy init."""

import inspect
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Variable

from fairscale.internal.device import DeviceHandle
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer

from .order import ExecutionOrder


class PendingBackward:
    """Marks one forward whose backward may still run (see :attr:`TreeState.backward_pending`); ``forward`` numbers the
    root's forward whose graph holds it (-1: a forward run inside a backward)."""

    __slots__ = ("done", "forward", "__weakref__")

    def __init__(self, forward: int) -> None:
        self.done = False
        self.forward = forward


class TreeState:
    """Streams, the reduce-scatter bucketer and the per-backward bookkeeping of one FSDP tree.

    Args:
        device: the compute device of the root.
        bucket_cap_mb: size of the reduce-scatter bucket (``<= 0`` disables bucketing).
    """

    def __init__(self, device: DeviceHandle, bucket_cap_mb: float) -> None:
        self.device = device
        # Gathers run on their own stream so they can overlap compute on accelerators; inert on CPU.
        self.all_gather_stream = device.new_stream()
        self.post_backward_stream = device.new_stream()
        # overlap: on CPU a reduce-scatter is waited only when the next is issued (gloo blocks the caller meanwhile).
        self.bucketer = ReduceScatterBucketer(bucket_cap_mb, overlap=True)  # type: ignore[arg-type]
        self.final_callback_queued = False
        # The root unit (a weak reference: the unit holds this state), for a reset of one unit of the tree.
        self.root: Optional["weakref.ref[Any]"] = None
        # One token per forward that registered pre-backward hooks. The hooks' closures hold it, and autograd holds
        # the hooks with the graph: a token dies with its graph (an abandoned forward) and is marked done when its
        # backward starts, so "a backward is pending" is exact, not a flag that a dropped forward leaves set.
        self._pending: "weakref.WeakSet[PendingBackward]" = weakref.WeakSet()
        self.root_forwards = 0  # the number of the root's forwards (not recomputations) started so far
        # The newest root forward a backward reached so far (a hook of its fired): at the end of a backward, a unit
        # forgets its uses by that forward and older ones (see FSDPUnit.forget_finished_forwards).
        self.newest_reached = -1
        # Returns the end-of-backward callback, or None once its owner is gone (see set_finalizer).
        self._finalizer: Optional[Callable[[], Optional[Callable[[], None]]]] = None
        # The callback queued by the running (or last) backward, weakly: see backward_running.
        self._queued_callback: Optional["weakref.ReferenceType[_FinalCallback]"] = None
        # Whether any post-backward point ran in the current backward (autograd.grad() runs none).
        self.any_post_backward = False
        # Whether the current backward builds a graph of its own (create_graph=True, as a gradient penalty's
        # autograd.grad does): the engine runs it with grad mode on. That graph reads the full parameters.
        self.backward_builds_graph = False
        # Unit orders of the previous forward and backward, for prefetch (see _fsdp/prefetch.py).
        self.forward_order = ExecutionOrder("forward")
        self.backward_order = ExecutionOrder("backward")
        self.forward_running = False  # inside the root's (non-recomputed) forward
        # Handles gathered ahead by a forward prefetch, by unit, until that unit's own forward takes them (see
        # prefetch.end_of_forward).
        self.prefetched_ahead: "weakref.WeakKeyDictionary[Any, List[Any]]" = weakref.WeakKeyDictionary()
        # The gradient the last reduction reads on the post-backward stream, and an event recorded after that read
        # was queued (accelerators only; see hold_until_reduced).
        self._held: Optional[Tuple[Any, Tensor]] = None
        # id() of each parameter declared with append_shared_param -> the units whose handles wrap it (owner first).
        self.sharing: Dict[int, List[Any]] = {}
        # (unit, handle) whose gradient was reduced in a nested backward (a reentrant checkpoint) while the unit's
        # own backward task uses none of its parameters: the full parameter is freed at the next pre-backward point
        # or at the end of backward, not at once (see nested_backward.only_nested_tasks_use_params).
        self._free_later: List[Tuple["weakref.ref[Any]", "weakref.ref[Any]"]] = []

    def free_after_nested_backwards(self, unit: Any, handle: Any) -> None:
        """Keep ``handle``'s full parameter of ``unit`` until :meth:`free_nested_leftovers`."""
        if not any(h() is handle for _, h in self._free_later):
            self._free_later.append((weakref.ref(unit), weakref.ref(handle)))

    def free_nested_leftovers(self) -> None:
        """Free the full parameters kept for nested backwards: at a pre-backward point (the backward reached another
        unit: the one it left is done) or at the end of backward. A unit that started a new use since keeps them."""
        if not self._free_later:
            return
        pending, self._free_later = self._free_later, []
        for unit_ref, handle_ref in pending:
            unit, handle = unit_ref(), handle_ref()
            if unit is not None and handle is not None and unit.training_state.name == "BACKWARD_POST":
                handle.free_full()

    def new_pending_backward(self) -> "PendingBackward":
        # A forward inside a backward (a checkpointed unit's recomputation) belongs to that backward, not to the
        # root's latest forward (-1): its hook running must not mark that forward's backward as started.
        inside_backward = torch._C._current_graph_task_id() != -1
        token = PendingBackward(-1 if inside_backward else self.root_forwards)
        self._pending.add(token)
        return token

    def abandon_started_backwards(self) -> None:
        """After a backward that raised: its forwards' tokens that it never reached are done too.

        The failed batch's graph stays alive while the user holds its loss (the usual ``try: loss.backward()``), with
        the tokens of the instances the backward raised before; every later load was refused as "between a forward
        and its backward", which the user could not run. A forward whose backward has not started keeps its tokens.
        """
        tokens = list(self._pending)
        started = {t.forward for t in tokens if t.done and t.forward != -1}
        for t in tokens:
            if t.forward in started or t.forward == -1:  # -1: made inside the backward that raised
                t.done = True

    def mark_reached(self, token: PendingBackward) -> None:
        """A hook of ``token``'s forward fired: its backward started."""
        token.done = True
        self.newest_reached = max(self.newest_reached, token.forward)

    @property
    def backward_pending(self) -> bool:
        """Whether a forward's graph is alive and its backward has not started yet."""
        return any(not t.done for t in list(self._pending))

    def set_finalizer(self, fn: Callable[[], None]) -> None:
        """Set the end-of-backward callback; a bound method (the root's) is held weakly.

        The root holds this tree through its unit, so a strong reference to the root's bound method would put every
        FSDP model in a reference cycle: a dropped model would then wait for the cycle collector, which at interpreter
        exit runs after ``destroy_process_group()`` with the model's groups still referenced. Any other callable (one
        set on the instance before the first forward, say) is held as given.
        """
        if inspect.ismethod(fn):
            self._finalizer = weakref.WeakMethod(fn)
        else:
            self._finalizer = lambda: fn

    def queue_final_callback(self) -> None:
        """Queue the end-of-backward callback on the autograd engine, once per backward pass."""
        fn = self._finalizer() if self._finalizer is not None else None
        if self.final_callback_queued or fn is None:
            return
        self.final_callback_queued = True
        self.backward_builds_graph = torch.is_grad_enabled()
        callback = _FinalCallback(fn)
        # The engine holds the callback until its backward ends, completed or aborted: alive, that backward is still
        # running (on whatever thread), see backward_running.
        self._queued_callback = weakref.ref(callback)
        Variable._execution_engine.queue_callback(callback)

    def backward_running(self) -> bool:
        """Whether the backward that queued the end-of-backward callback is still running (the callback queued and
        still held by the autograd engine), as opposed to finished or aborted by an exception."""
        ref = self._queued_callback
        return self.final_callback_queued and ref is not None and ref() is not None

    def hold_until_reduced(self, grad: Tensor) -> None:
        """Keep ``grad`` (made on the compute stream) alive until the reduction queued on it is known to be done.

        Called right after the reduction reading ``grad`` was queued on the post-backward stream. Instead of
        ``record_stream`` (which delays the reuse of every such block to an unknown later time), the tree holds the
        last gradient with an event recorded after its reduction; the next one makes the compute stream wait for
        that event before the reference is dropped, so a later compute-stream kernel that reuses the memory is
        ordered after the read. At most one gradient is held; the end of backward releases it. On CPU there is
        nothing to order: nothing is held.
        """
        if not self.device.is_accelerator:
            return
        self.release_held()
        self._held = (self.post_backward_stream.record_event(), grad)

    def release_held(self) -> None:
        """Order the compute stream after the held gradient's reduction, then drop the reference."""
        if self._held is not None:
            event, _ = self._held
            self.device.current_stream().wait_event(event)
            self._held = None


class _FinalCallback:
    """The end-of-backward callback as queued on the autograd engine: an object of its own, so that a weak reference
    to it tells whether the engine still holds it (see :meth:`TreeState.backward_running`)."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()
