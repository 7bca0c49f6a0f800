# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The tensors of one owned (usually flat) parameter, and the moves between them. No communication, no hooks.

Layout of a parameter of ``numel`` elements at world size ``W`` (chunk-and-pad, as upstream): every rank holds a shard
of ``shard_numel = ceil(numel / W)`` elements, the tail ranks zero-padded, so the padded full tensor has
``shard_numel * W`` elements of which the first ``numel`` are real.

Tensors, by role:

* ``fp32_shard``: the master shard the optimizer sees (``p.data`` whenever the instance is idle). Its dtype is the
  parameter dtype (fp32, or fp16 in "pure fp16"). With ``move_params_to_cpu`` it lives (pinned) on the CPU.
* ``full_padded``: the gathered full parameter in compute dtype on the compute device. Freed by shrinking its
  *storage* to 0 and re-grown in place, so views that autograd saved in forward stay valid across free/realloc.
  Unsharded parameters that need no cast or move have no such buffer: their "full" tensor is the shard itself.
* ``zero2_slice``: this rank's 1/G slice of ``full_padded`` kept between a forward and its backward (zero2).
* ``saved_grad_shard``: the reduced gradient shard accumulated over the backward passes of one step.
* ``grad_accum_flat``: (``optimize_backward_concat``) the unsharded gradient summed over the microbatches of one
  accumulation window, written slice by slice by the views' backward; released when the window is reduced.
"""

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import tensor_hooks
from fairscale.internal.device import DeviceHandle

from .state import _LEGAL, HandleState, check_handle_transition
from .freed_views import FreedViews
from .storage import FreedBuffer, alloc_storage_, free_storage_, is_storage_allocated

_FreedBuffer = FreedBuffer  # the name models pickled by earlier versions of this package refer to


def set_grad_of_other_shape(param: Tensor, grad: Tensor) -> None:
    """``param.grad = grad`` while ``param.data`` is the shard: torch checks the shape against ``param.data``, so
    the data is pointed at ``grad`` for the assignment (metadata only), as the default path leaves a full-size
    gradient on a sharded parameter after a ``no_sync()`` backward."""
    data = param.data
    param.data = grad
    try:
        param.grad = grad
    finally:
        param.data = data


def _resizable(t: Tensor) -> bool:
    resizable = getattr(t.untyped_storage(), "resizable", None)
    return bool(resizable()) if resizable is not None else False  # torch < 2.2 cannot tell: take it as not


class FlatHandle:
    """State and tensors of one parameter owned by an FSDP instance.

    Args:
        param: the parameter; after construction of the FSDP instance ``param.data`` is this rank's padded shard
            (1-D) when sharded, or the original tensor when not.
        name: a readable name for messages.
        world_size: size of the sharding process group.
        rank: this rank inside the sharding group.
        padding: number of zero elements at the end of this rank's shard.
        borrowed: the parameter is owned by a sibling instance (declared with ``append_shared_param``).
    """

    # Defaults for handles pickled before these caches existed (unpickling restores __dict__ without __init__).
    _full_view: Optional[Tensor] = None
    _full_view_of: Optional[Tensor] = None
    _shard_is_gather_input = False

    def __init__(
        self, param: nn.Parameter, name: str, world_size: int, rank: int, padding: int, borrowed: bool = False
    ) -> None:
        self.param = param
        self.name = name
        self.world_size = world_size
        self.rank = rank
        self.padding = padding
        self.is_sharded = world_size > 1
        # Hybrid sharding over a one-rank shard group reduces across the replicas all the same (an all-reduce, as
        # DDP): a no_sync() gradient is unreduced there too. Set by the owner's construction.
        self.replicated = False
        self.orig_size: torch.Size = param._orig_size  # type: ignore[attr-defined]
        self.numel = int(self.orig_size.numel())
        self.shard_numel = param.data.numel()
        self.state = HandleState.SHARDED
        self.fp32_shard: Optional[Tensor] = None
        self.full_padded: Optional[Tensor] = None
        self.zero2_slice: Optional[Tensor] = None
        self.saved_grad_shard: Optional[Tensor] = None
        # What the running backward started from: (saved_grad_shard, the reduced shard it took out of p.grad).
        # A backward that raises is undone to this at the recovery (see recovery.undo_partial_backward).
        # ``keep_intact`` is the tensor reductions must not add into in place (it is, or aliases, one of those).
        self.grad_before_backward: Optional[Tuple[Optional[Tensor], Optional[Tensor]]] = None
        self.keep_intact: Optional[Tensor] = None
        # Whether p.grad was None when the running backward began: a full-size p.grad then came from that backward;
        # whether the optimize_backward_concat window buffer was open then (if not, that backward opened it).
        self.no_grad_before_backward = False
        self.window_open_before_backward = False
        # True for a parameter owned by a sibling instance and declared with append_shared_param.
        self.borrowed = borrowed
        # Whether the persistent post-accumulate-grad hook is on the parameter (registered once per handle).
        self._post_hook_registered = False
        # optimize_backward_concat: unsharded gradient sum of the current accumulation window, and the window's id.
        self.grad_accum_flat: Optional[Tensor] = None
        self.grad_accum_views: List[Tensor] = []
        # The buffer's unpadded part shaped as the full parameter: what p.grad shows between microbatches.
        self.grad_accum_grad: Optional[Tensor] = None
        self.grad_window = 0
        # The gradient a no_sync() backward left in p.grad (the full-size accumulation, or the window buffer's view
        # with optimize_backward_concat), held weakly, with its version: zero_grad() inside an accumulation window
        # shows as a change of it at the next backward (see drop_window_if_cleared).
        self._window_grad: Optional[Tuple["weakref.ref[Tensor]", int]] = None
        # The reduced shard last handed to p.grad, held weakly: after optimizer.zero_grad() it must be freed.
        self._assigned_grad: Optional["weakref.ref[Tensor]"] = None
        # Versions of (param, fp32 shard) when the full buffer was last gathered from the shard: a later in-place
        # change of either (optimizer step, load, summon write-back) makes the gathered copy stale.
        self.gathered_version: Tuple[int, int] = (-1, -1)
        self.device: Optional[DeviceHandle] = None
        self.compute_dtype: torch.dtype = param.dtype
        # A prefetched all-gather still in flight into full_padded (see _fsdp/prefetch.py): its work handle and its
        # input, kept alive until the gather is waited on. The handle is already FULL; every reader of the full
        # buffer (and every free of it) first calls finish_gather().
        self.pending_gather: Optional[Tuple[Any, Tensor]] = None
        # Made once per full buffer and reused by every use_full (a slice and a view cost more than the rest of it;
        # the view stays valid across free/realloc of the buffer's storage, see free_storage_), and whether the fp32
        # shard needs no cast or move to be a gather's input (decided at materialize).
        self._full_view: Optional[Tensor] = None
        self._full_view_of: Optional[Tensor] = None
        self._shard_is_gather_input = False
        # Stand-ins for the wrapped modules' views while the full buffer is released (see freed_views.py).
        self.freed_views = FreedViews()

    @staticmethod
    @torch.no_grad()
    def shard_param_(param: nn.Parameter, name: str, world_size: int, rank: int) -> "FlatHandle":
        """Replace ``param.data`` with this rank's chunk-and-pad shard and return the parameter's handle.

        The shard is 1-D with ``ceil(numel / world_size)`` elements; the last ranks' shards end in zero padding.
        Sets upstream's parameter attributes ``_is_sharded`` and ``_orig_size``.
        """
        param._is_sharded = world_size > 1  # type: ignore[attr-defined]
        param._orig_size = param.data.size()  # type: ignore[attr-defined]
        padding = 0
        if world_size > 1:
            chunks = torch.flatten(param.data).chunk(world_size)
            piece = chunks[rank] if rank < len(chunks) else param.data.new_empty(0)
            shard = torch.zeros(chunks[0].numel(), dtype=param.dtype, device=param.device)
            shard[: piece.numel()].copy_(piece)
            padding = chunks[0].numel() - piece.numel()
            param.data = shard
        return FlatHandle(param, name, world_size, rank, padding)

    def __getstate__(self) -> Dict[str, Any]:
        self.finish_gather()
        state = dict(self.__dict__)
        state["_assigned_grad"] = None  # a weak reference cannot be pickled; it is only a hint
        state["_window_grad"] = None  # likewise
        # A copy carries no gradient, as torch's copy of a parameter carries no .grad: neither the reduced shard of
        # earlier windows nor an accumulation window's sum (before, the optimize_backward_concat buffer went along and
        # the default path's did not, so a copy made inside a window had other gradients with the flag on and off).
        state["saved_grad_shard"] = None
        state["grad_accum_flat"] = None
        state["grad_accum_views"] = []
        state["grad_accum_grad"] = None
        state["_full_view"] = state["_full_view_of"] = None  # a cache, remade from full_padded
        # Copies and pickles of a parameter drop its hooks (torch keeps them on the original only): the copy's
        # next backward registers its own, or it would reduce every gradient late and keep full parameters.
        state["_post_hook_registered"] = False
        # Between steps p.data *is* the fp32 shard. torch's deepcopy of a Parameter clones its data instead of going
        # through the copy's memo, so the copy's parameter and shard came apart: edits of the copy's parameters
        # (apply(), load_state_dict()) went to a tensor its forward never read, silently.
        shard = self.fp32_shard
        state["_param_is_shard"] = shard is not None and self.param.data.data_ptr() == shard.data_ptr()
        full = self.full_padded
        if full is not None and full.untyped_storage().nbytes() == 0:
            # A freed buffer is a tensor larger than its storage, which torch.load cannot rebuild: keep its recipe.
            state["full_padded"] = FreedBuffer(full.numel(), full.dtype, full.device)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        param_is_shard = state.pop("_param_is_shard", False)
        self.__dict__.update(state)
        self.__dict__.setdefault("freed_views", FreedViews())  # pickled by a version without it
        if param_is_shard and self.fp32_shard is not None and self.param.data.data_ptr() != self.fp32_shard.data_ptr():
            self.param.data = self.fp32_shard
        # Upstream's parameter attributes do not survive every copy (nn.Parameter's deepcopy drops a parameter's
        # attributes, a FlatParameter pickles in upstream's format without them): set them again.
        self.param._is_sharded = self.is_sharded  # type: ignore[attr-defined]
        self.param._orig_size = self.orig_size  # type: ignore[attr-defined]
        full = self.full_padded
        if isinstance(full, FreedBuffer):
            self.full_padded = full.make()
        elif full is not None and not _resizable(full):
            # torch.load gives storages that cannot be resized, and the full buffer is freed and regrown in place at
            # every step: give it a storage of its own.
            self.full_padded = full.clone()

    def finish_gather(self) -> None:
        """Wait for a prefetched all-gather into the full buffer, if one is in flight (else a no-op)."""
        pending = self.pending_gather
        if pending is not None:
            self.pending_gather = None
            pending[0].wait()

    # ------------------------------------------------------------------ lazy init / teardown
    def materialize(self, device: DeviceHandle, compute_dtype: torch.dtype, move_params_to_cpu: bool) -> None:
        """Take ``param.data`` as the fp32 shard and prepare (unallocated) compute buffers. Idempotent."""
        if self.fp32_shard is not None:
            return
        self.device = device
        self.compute_dtype = compute_dtype
        shard = self.param.data
        if move_params_to_cpu:
            if shard.device.type != "cpu":
                raise ValueError(
                    f"move_params_to_cpu=True needs the parameters on CPU at wrapping time, but {self.name} is on "
                    f"{shard.device}. Build the model on CPU and let FSDP move compute copies to {device.device}."
                )
            shard = device.pin_memory(shard)
            self.param.data = shard
        elif shard.device != device.device:
            # Parameters built on the CPU with an accelerator as compute device: the fp32 shard (and so the
            # optimizer state, created at its first step) moves to the compute device, as the default promises.
            shard = shard.to(device.device)
            self.param.data = shard
        self.fp32_shard = shard
        self._shard_is_gather_input = shard.dtype == compute_dtype and shard.device == device.device
        self._full_view = self._full_view_of = None
        needs_buffer = self.is_sharded or shard.dtype != compute_dtype or shard.device != device.device
        if needs_buffer:
            self.full_padded = torch.empty(self.padded_numel, dtype=compute_dtype, device=device.device)
            free_storage_(self.full_padded)
        else:
            self.full_padded = None

    def reset(self) -> None:
        """Undo :meth:`materialize` (lazy init reset). The parameter must be idle (sharded)."""
        self.finish_gather()
        if self.state != HandleState.SHARDED:
            self.use_shard()
            self.free_full()
            self.drop_zero2_slice()
        self.fp32_shard = None
        self.full_padded = None
        self._full_view = self._full_view_of = None
        self._shard_is_gather_input = False
        # The hidden views are views of the dropped buffer: never give them back (the modules keep the stand-ins
        # until the next forward makes views of the new one).
        self.freed_views = FreedViews()
        self.state = HandleState.SHARDED

    @property
    def materialized(self) -> bool:
        return self.fp32_shard is not None

    @property
    def padded_numel(self) -> int:
        """Elements of the padded full parameter: ``shard_numel * world_size`` (the real ones come first)."""
        return self.shard_numel * self.world_size

    # ------------------------------------------------------------------ gradient identity
    def shard_version(self) -> Tuple[int, int]:
        assert self.fp32_shard is not None
        return (self.param._version, self.fp32_shard._version)

    def remember_assigned_grad(self, grad: Tensor) -> None:
        """Record the reduced shard given to ``p.grad`` (to tell it from a full-size accumulated gradient later)."""
        self._assigned_grad = weakref.ref(grad)

    def is_assigned_grad(self, grad: Tensor) -> bool:
        return self._assigned_grad is not None and self._assigned_grad() is grad

    def holds_unreduced_grad(self) -> bool:
        """Whether this rank holds a gradient of a ``no_sync()`` backward that was not reduce-scattered yet (a
        full-size ``p.grad``, or an ``optimize_backward_concat`` window buffer); never alone (world size 1 without
        replicas)."""
        if not (self.is_sharded or getattr(self, "replicated", False)):  # getattr: handles pickled before the flag
            return False
        if self.grad_accum_flat is not None:
            # p.grad shows the window buffer (leave_window_grad); None means the user cleared it (zero_grad(), which
            # the next backward sees and drops the buffer for), as the default path's None p.grad below (a fuzz of
            # call orders, session 48: clip_grad_norm_ was refused with the flag on only).
            return self.param.grad is not None
        if self._window_grad is None:
            # No no_sync() backward left a gradient since the last reduction: whatever p.grad is now, the reduced
            # shard or a tensor the user assigned since, it is not unreduced. The shapes alone cannot tell when the
            # shard has the full shape (a 1-element parameter at world size 2).
            return False
        g = self.param.grad
        if g is None or self.is_assigned_grad(g):
            return False
        # A move inside the window (.to(), .double(), _reset_lazy_init()) reset the handle: p.data is the shard then.
        shard_shape = (self.fp32_shard if self.fp32_shard is not None else self.param.data).shape
        # As in park_grad_for_backward: the shard shape alone is ambiguous when it equals the full shape.
        return not (g.shape == shard_shape and g.shape != self.orig_size)

    # ------------------------------------------------------------------ views
    @property
    def has_full_buffer(self) -> bool:
        """Whether the full parameter lives in its own buffer (else it is the fp32 shard itself)."""
        return self.full_padded is not None

    def full_view(self) -> Tensor:
        """The unpadded full parameter in its original shape (valid in state FULL)."""
        assert self.fp32_shard is not None
        if self.pending_gather is not None:
            self.finish_gather()
        full = self.full_padded
        if full is None:
            return self.fp32_shard.view(self.orig_size)
        view = self._full_view
        if view is None or self._full_view_of is not full:
            view = self._full_view = full[: self.numel].view(self.orig_size)
            self._full_view_of = full
        return view

    def use_full(self) -> None:
        """Point ``param.data`` at the full parameter."""
        if self.state != HandleState.FULL:
            raise RuntimeError(f"{self.name}: full parameter requested while in state {self.state.name}")
        self.param.data = self.full_view()

    def use_shard(self) -> None:
        """Point ``param.data`` at the fp32 shard (what the optimizer and state dicts see)."""
        assert self.fp32_shard is not None
        self.param.data = self.fp32_shard

    # ------------------------------------------------------------------ gather side
    def gather_input(self) -> Tensor:
        """This rank's shard in compute dtype on the compute device (a copy only when a cast/move is needed)."""
        assert self.fp32_shard is not None and self.device is not None
        if self._shard_is_gather_input:  # what .to() would return: the shard itself
            return self.fp32_shard
        return self.fp32_shard.to(device=self.device.device, dtype=self.compute_dtype, non_blocking=True)

    def take_gather_source(self) -> Tuple[Tensor, bool]:
        """What the next gather into the full buffer reads, and whether it is the zero2 slice.

        In ZERO2_SLICE the slice (consumed: the gather replaces it); otherwise this rank's shard in compute dtype,
        and the shard version is recorded (a later change of the shard makes the gathered copy stale).
        """
        if self.state == HandleState.ZERO2_SLICE:
            source = self.zero2_slice
            assert source is not None
            self.zero2_slice = None
            return source, True
        self.gathered_version = self.shard_version()
        return self.gather_input(), False

    def mark_gathered(self, work: Optional[Any], source: Tensor) -> None:
        """The gather into the full buffer was issued (``work`` still in flight when not ``None``): state FULL.

        The source is kept with the work: an asynchronous collective reads it until it is waited on.
        """
        self.set_state(HandleState.FULL)
        if work is not None:
            self.pending_gather = (work, source)

    def install_post_backward_hook(self, make_hook: Callable[[], Callable[[Tensor], None]]) -> None:
        """Put the post-accumulate-grad hook ``make_hook()`` on the parameter, once per handle (hooks are
        persistent, so they never pile up across iterations). Frozen parameters get none."""
        if self.param.requires_grad and not self._post_hook_registered:
            tensor_hooks.register_post_accumulate_grad_hook(self.param, make_hook())
            self._post_hook_registered = True

    @property
    def post_hook_registered(self) -> bool:
        """Whether FSDP's own post-accumulate-grad hook is on the parameter."""
        return self._post_hook_registered

    def alloc_full(self) -> Tensor:
        """Allocate the padded full buffer in place (same tensor object) and return it."""
        assert self.full_padded is not None
        alloc_storage_(self.full_padded, self.shard_numel * self.world_size)  # padded_numel
        self.freed_views.show()
        return self.full_padded

    def set_state(self, new: HandleState) -> None:
        if new not in _LEGAL[self.state]:
            check_handle_transition(self.state, new, self.name)  # raises
        self.state = new

    # ------------------------------------------------------------------ free side
    def _release_full_storage(self) -> None:
        if self.pending_gather is not None:
            self.finish_gather()  # never free a buffer a collective is still writing
        if self.full_padded is not None and self.full_padded.untyped_storage().nbytes() > 0:
            # No record_stream: on an accelerator the buffer may still be read by queued kernels of the compute
            # stream, but it was allocated on the all-gather stream, whose pool only that stream allocates from, and
            # that stream waits for the compute stream before every gather (runtime and prefetch), so the next
            # gather into this memory is ordered after those reads.
            self.freed_views.hide(self.param, self.full_padded)
            free_storage_(self.full_padded)

    def free_full(self) -> None:
        """Release the full buffer (keeps the fp32 shard); a FULL handle becomes SHARDED."""
        self._release_full_storage()
        if self.state == HandleState.FULL:
            self.set_state(HandleState.SHARDED)

    def keep_zero2_slice(self, index: int, group_size: int) -> None:
        """Keep slice ``index`` of ``group_size`` of the full buffer, then free the full buffer (state ZERO2_SLICE)."""
        assert self.full_padded is not None
        if self.state != HandleState.FULL:
            raise RuntimeError(f"fairscale internal error: {self.name}: zero2 slice kept in state {self.state.name}")
        self.finish_gather()
        total = self.padded_numel
        if total % group_size != 0:
            raise ValueError(f"{self.name}: padded size {total} is not divisible by the zero2 group size {group_size}")
        piece = total // group_size
        self.zero2_slice = self.full_padded.narrow(0, index * piece, piece).clone()
        self._release_full_storage()
        self.set_state(HandleState.ZERO2_SLICE)

    def drop_zero2_slice(self) -> None:
        """Free the zero2 slice; a handle in ZERO2_SLICE goes back to SHARDED."""
        self.zero2_slice = None
        if self.state == HandleState.ZERO2_SLICE:
            self.set_state(HandleState.SHARDED)

    # ------------------------------------------------------------------ gradient state
    def park_grad_for_backward(self, compute_device: torch.device) -> None:
        """A backward starts: move a reduced shard gradient out of ``p.grad`` so autograd can write a full-size one.

        Remembers what the backward started from (``recovery.undo_partial_backward`` goes back to it if it raises).

        Raises:
            RuntimeError: ``p.grad`` has neither the full shape nor the shard shape (assigned by hand).
        """
        self.drop_window_if_cleared()
        p, g = self.param, self.param.grad
        if not p.requires_grad:
            # Frozen: autograd writes it no gradient, and whatever p.grad holds stays there, as with a plain module (an
            # optimizer still applies it). Parked, it vanished from p.grad until an unfreeze brought it back, added to
            # the next backward's gradient even across a zero_grad(set_to_none=True) that could not see it.
            self.grad_before_backward = self.keep_intact = None
            self.no_grad_before_backward = False
            return
        self.grad_before_backward = (self.saved_grad_shard, None)
        self.keep_intact = self.saved_grad_shard
        self.no_grad_before_backward = g is None
        self.window_open_before_backward = self.grad_accum_flat is not None
        if g is None:
            return
        # The shape alone is ambiguous when shard and full shapes coincide (a 1-element parameter): a full-size
        # gradient is an unreduced no_sync accumulation unless it is the shard FSDP itself assigned.
        assert self.fp32_shard is not None
        is_reduced_shard = self.is_assigned_grad(g) or (
            self.is_sharded and g.shape == self.fp32_shard.shape and g.shape != self.orig_size
        )
        if is_reduced_shard:
            self.grad_before_backward = (self.saved_grad_shard, g)
            if g.device != compute_device:
                # move_grads_to_cpu: the parked shard joins the next reductions, which land on the compute device.
                g = g.to(compute_device)
            self.saved_grad_shard = g if self.saved_grad_shard is None else self.saved_grad_shard + g
            self.keep_intact = self.saved_grad_shard
            p.grad = None
        elif g.shape != self.orig_size:
            raise RuntimeError(
                f"{self.name}: found a gradient of shape {tuple(g.shape)} that is neither the full shape "
                f"{tuple(self.orig_size)} nor the shard shape; was p.grad assigned by hand?"
            )

    def leave_window_grad(self) -> None:
        """A ``no_sync()`` backward ended: show its accumulated gradient in ``p.grad`` and remember it.

        The default path's full-size ``p.grad`` is that gradient already. With ``optimize_backward_concat`` the sum
        lives in the window buffer, which is given to ``p.grad`` as a view, so that the user sees (and clears) the
        same gradient with the flag on and off.
        """
        p = self.param
        if self.grad_accum_flat is not None:
            view = self.grad_accum_grad
            if view is None:  # once per window
                view = self.grad_accum_grad = self.grad_accum_flat[: self.numel].view(self.orig_size)
            if p.grad is not view:
                self._absorb_full_grad(self.grad_accum_flat)
                set_grad_of_other_shape(p, view)
        g = p.grad
        if g is not None and not self.is_assigned_grad(g) and g.shape == self.orig_size:
            self._window_grad = (weakref.ref(g), g._version)

    def _absorb_full_grad(self, buf: Tensor) -> None:
        """Add a full-size ``p.grad`` that is not the buffer's view into the window buffer, and take it out of p.grad.

        ``backward(inputs=...)`` answers the flat parameter as the default path does (a full-size ``p.grad``, no
        buffer); a window with the flag holds its sum in one place, the buffer.
        """
        g = self.param.grad
        if g is None or g is self.grad_accum_grad or self.is_assigned_grad(g) or g.shape != self.orig_size:
            return
        buf[: self.numel].add_(g.reshape(-1))
        self.param.grad = None

    def drop_window_if_cleared(self) -> bool:
        """Forget what FSDP keeps of this step's gradient if the user cleared ``p.grad`` since the last ``no_sync()``
        backward (``zero_grad()`` inside an accumulation window, e.g. to drop a microbatch).

        Besides the window's sum (in ``p.grad`` or the window buffer), FSDP keeps the reduced shard of earlier
        windows of the step aside while a window runs; both went on being summed after the user's ``zero_grad()``.
        Cleared means ``p.grad`` is ``None``, or is the gradient FSDP left there, changed in place and now all zero
        (``zero_grad(set_to_none=False)``; the check reads the gradient only when its version changed). What FSDP
        left stays remembered until a backward completes (:meth:`leave_window_grad`, :meth:`close_window`): after a
        backward that raised, a ``zero_grad()`` is seen at the next one. Returns whether it dropped the window.
        """
        left = self._window_grad
        if left is None:
            return False
        ref, version = left
        g = self.param.grad
        if g is None:
            cleared = True
        elif g is ref() and g._version != version:
            cleared = not bool(g.any())
            if not cleared:  # changed by a backward that raised, or scaled by hand: read it once only
                self._window_grad = (ref, g._version)
        else:
            return False  # unchanged, or replaced by hand (the default path then accumulates into the replacement)
        if not cleared:
            return False
        self._window_grad = None
        self.saved_grad_shard = None
        if self.grad_accum_flat is not None:
            if g is not None:
                self.param.grad = None  # a view of the buffer dropped here
            self.grad_accum_flat = None
            self.grad_accum_views = []
            self.grad_accum_grad = None
        return True

    def close_window(self) -> None:
        """The window's gradient goes to its reduction (or was reduced): nothing of it is left for the user to clear.

        After a synchronizing backward that raised once a unit's reduction had started, a ``zero_grad()`` is
        therefore not seen for that unit (its window's sum was lost with the failed reduction anyway)."""
        self._window_grad = None

    def accumulate_reduced(self, shard_grad: Tensor) -> None:
        """Add one reduced gradient shard (shaped like the fp32 shard) to what this step reduced so far."""
        if self.saved_grad_shard is None:
            self.saved_grad_shard = shard_grad
        elif self.saved_grad_shard is self.keep_intact:
            # The gradient of completed backwards (or the user's p.grad): a failing backward must be able to go back.
            self.saved_grad_shard = self.saved_grad_shard + shard_grad
        else:
            self.saved_grad_shard.add_(shard_grad)

    def end_backward(self) -> None:
        """The backward completed: nothing of it needs undoing any more."""
        self.grad_before_backward = self.keep_intact = None

    def hand_reduced_grad_to_param(self, to_cpu: bool) -> None:
        """Give the reduced shard gradient of this step to ``p.grad`` (on the CPU with ``to_cpu``)."""
        grad = self.saved_grad_shard
        # Frozen ones too: a no_sync() window's sum from before the freeze, which a plain module keeps and steps with.
        if grad is None:
            return
        self.saved_grad_shard = None
        if to_cpu:
            grad = grad.to("cpu")
        if grad.dtype != self.param.dtype:
            grad = grad.to(self.param.dtype)
        self.param.grad = grad
        self.remember_assigned_grad(grad)

    # ------------------------------------------------------------------ optimize_backward_concat window buffer
    def open_accum_buffer(
        self, dtype: torch.dtype, device: torch.device, make_views: Callable[[Tensor], Sequence[Tensor]]
    ) -> List[Tensor]:
        """Open the accumulation window's flat buffer; returns (and keeps) ``make_views`` of its unpadded part.

        Padded like the full parameter so the reduce-scatter reads the buffer as is, without a padded copy; the
        padding is zero. The views are made once per window, so gradients are added without a reshape.
        """
        buf = torch.empty(self.padded_numel if self.is_sharded else self.numel, dtype=dtype, device=device)
        buf[self.numel :].zero_()
        self.grad_accum_flat = buf
        self.grad_accum_grad = None
        self.grad_accum_views = list(make_views(buf[: self.numel]))
        return self.grad_accum_views

    def take_accum_buffer(self) -> Tensor:
        """Hand the window's buffer to the reduction and open a new window."""
        buf = self.grad_accum_flat
        assert buf is not None
        view = self.grad_accum_grad
        self.grad_accum_flat = None
        self.grad_accum_views = []
        self.grad_accum_grad = None
        self.grad_window += 1
        # p.grad showed the buffer (leave_window_grad): the buffer is the sum. Another full-size p.grad (from a
        # backward(inputs=...)) joins it rather than being reduced on its own.
        if self.param.grad is view:
            self.param.grad = None
        self._absorb_full_grad(buf)
        self.close_window()  # FSDP itself took the window's gradient: a None p.grad is not the user's zero_grad()
        return buf
