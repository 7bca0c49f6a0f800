# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The tensors of one owned (usually flat) parameter, and the moves between them. No communication, no hooks.

Layout of a parameter of ``numel`` elements at world size ``W`` (chunk-and-pad, spec 1.3): every rank holds a shard
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
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from fairscale.internal.device import DeviceHandle

from .state import HandleState, check_handle_transition


def free_storage_(data: Tensor) -> None:
    """Release a tensor's storage without changing its metadata (views stay valid objects)."""
    storage = data.untyped_storage()
    if storage.size() > 0:
        # The tensor must be the sole owner of the storage's start, or other views would silently lose their data.
        assert data.storage_offset() == 0, "free_storage_ needs a tensor that starts its storage"
        storage.resize_(0)


def alloc_storage_(data: Tensor, size: Union[int, torch.Size]) -> None:
    """Re-grow a storage freed by :func:`free_storage_` to hold ``size`` elements of the tensor's dtype.

    Args:
        data (Tensor): the tensor whose storage was freed.
        size (Union[int, torch.Size]): a shape (as upstream passes it) or a number of elements.
    """
    numel = size if isinstance(size, int) else torch.Size(size).numel()
    storage = data.untyped_storage()
    nbytes = numel * data.element_size()
    if storage.size() != nbytes:
        assert storage.size() == 0, "alloc_storage_ on a storage that is neither freed nor the right size"
        storage.resize_(nbytes)


def is_storage_allocated(tensor: Tensor) -> bool:
    """Whether a tensor's storage currently holds memory."""
    return tensor.untyped_storage().size() > 0


class FlatHandle:
    """State and tensors of one parameter owned by an FSDP instance.

    Args:
        param: the parameter; after construction of the FSDP instance ``param.data`` is this rank's padded shard
            (1-D) when sharded, or the original tensor when not.
        name: a readable name for messages.
        world_size: size of the sharding process group.
        rank: this rank inside the sharding group.
        padding: number of zero elements at the end of this rank's shard.
    """

    def __init__(self, param: nn.Parameter, name: str, world_size: int, rank: int, padding: int) -> None:
        self.param = param
        self.name = name
        self.world_size = world_size
        self.rank = rank
        self.padding = padding
        self.is_sharded = world_size > 1
        self.orig_size: torch.Size = param._orig_size  # type: ignore[attr-defined]
        self.numel = int(self.orig_size.numel())
        self.shard_numel = param.data.numel()
        self.state = HandleState.SHARDED
        self.fp32_shard: Optional[Tensor] = None
        self.full_padded: Optional[Tensor] = None
        self.zero2_slice: Optional[Tensor] = None
        self.saved_grad_shard: Optional[Tensor] = None
        # What the running backward started from: (saved_grad_shard, the reduced shard it took out of p.grad).
        # A backward that raises is undone to this at the next forward, so completed backwards keep their gradients.
        # ``keep_intact`` is the tensor reductions must not add into in place (it is, or aliases, one of those).
        self.grad_before_backward: Optional[Tuple[Optional[Tensor], Optional[Tensor]]] = None
        self.keep_intact: Optional[Tensor] = None
        # True for a parameter owned by a sibling instance and declared with append_shared_param.
        self.borrowed = False
        self.cpu_grad: Optional[Tensor] = None
        # optimize_backward_concat: unsharded gradient sum of the current accumulation window, and the window's id.
        self.grad_accum_flat: Optional[Tensor] = None
        self.grad_accum_views: List[Tensor] = []
        self.grad_window = 0
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

    def __getstate__(self) -> Dict[str, Any]:
        self.finish_gather()
        state = dict(self.__dict__)
        state["_assigned_grad"] = None  # a weak reference cannot be pickled; it is only a hint
        return state

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
        needs_buffer = self.is_sharded or shard.dtype != compute_dtype or shard.device != device.device
        if needs_buffer:
            self.full_padded = torch.empty(
                self.shard_numel * self.world_size, dtype=compute_dtype, device=device.device
            )
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
        self.state = HandleState.SHARDED

    @property
    def materialized(self) -> bool:
        return self.fp32_shard is not None

    # ------------------------------------------------------------------ gradient identity
    def shard_version(self) -> Tuple[int, int]:
        assert self.fp32_shard is not None
        return (self.param._version, self.fp32_shard._version)

    def remember_assigned_grad(self, grad: Tensor) -> None:
        """Record the reduced shard given to ``p.grad`` (to tell it from a full-size accumulated gradient later)."""
        self._assigned_grad = weakref.ref(grad)

    def is_assigned_grad(self, grad: Tensor) -> bool:
        return self._assigned_grad is not None and self._assigned_grad() is grad

    # ------------------------------------------------------------------ views
    @property
    def has_full_buffer(self) -> bool:
        """Whether the full parameter lives in its own buffer (else it is the fp32 shard itself)."""
        return self.full_padded is not None

    def full_view(self) -> Tensor:
        """The unpadded full parameter in its original shape (valid in state FULL)."""
        assert self.fp32_shard is not None
        self.finish_gather()
        if self.full_padded is None:
            return self.fp32_shard.view(self.orig_size)
        return self.full_padded[: self.numel].view(self.orig_size)

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
        return self.fp32_shard.to(device=self.device.device, dtype=self.compute_dtype, non_blocking=True)

    def alloc_full(self) -> Tensor:
        """Allocate the padded full buffer in place (same tensor object) and return it."""
        assert self.full_padded is not None
        alloc_storage_(self.full_padded, self.shard_numel * self.world_size)
        return self.full_padded

    def set_state(self, new: HandleState) -> None:
        check_handle_transition(self.state, new, self.name)
        self.state = new

    # ------------------------------------------------------------------ free side
    def _release_full_storage(self) -> None:
        self.finish_gather()  # never free a buffer a collective is still writing
        if self.full_padded is not None and is_storage_allocated(self.full_padded):
            assert self.device is not None
            # On an accelerator the buffer may still be read by queued kernels of the current stream.
            self.device.record_stream(self.full_padded, self.device.current_stream())
            free_storage_(self.full_padded)

    def free_full(self) -> None:
        """Release the full buffer (keeps the fp32 shard); a FULL handle becomes SHARDED."""
        self._release_full_storage()
        if self.state == HandleState.FULL:
            self.set_state(HandleState.SHARDED)

    def keep_zero2_slice(self, index: int, group_size: int) -> None:
        """Keep slice ``index`` of ``group_size`` of the full buffer, then free the full buffer (state ZERO2_SLICE)."""
        assert self.full_padded is not None and self.state == HandleState.FULL
        self.finish_gather()
        total = self.shard_numel * self.world_size
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
