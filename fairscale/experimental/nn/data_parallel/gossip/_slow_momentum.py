# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's slow-momentum step over the optimizer's parameters, seen as one virtual flat vector of ``T`` elements.

Memory-efficient mode shards the vector: rank ``r < num_shards`` owns ``[r * L, min((r + 1) * L, T))`` with
``L = ceil(T / num_shards)``. Every rank divides its parameters by the world size and SUM-reduces each owner's
slice to it (the owner then holds the exact average), the owner updates its slice, and broadcasts it back. Both
collectives use the default (world) group, as upstream. Otherwise every rank keeps the whole vector and updates
it locally (the base algorithm has averaged the parameters already).

The update of an owned element, with ``γ`` the parameter group's ``lr``, ``β`` the slow momentum and ``α`` the
slow learning rate: ``u ← β·u + (old − x)/γ``, ``old ← old − α·γ·u``, ``x ← old``.
"""

import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal.collectives import all_reduce, broadcast, reduce
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError

from .utils.helpers import communicate

__all__ = ["SlowMomentum"]


def _world_average(params: List[Tensor], world_size: int) -> Tensor:
    """The parameters as one flat vector, averaged over the default (world) group."""
    device = params[0].device if params else torch.device("cpu")
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0, device=device)
    all_reduce(flat)
    return flat.div_(world_size)


class SlowMomentum:
    """Buffers and step of the slow momentum (see the module docstring).

    Attributes:
        old_params (Optional[Tensor]): the slice's parameters after the last slow-momentum step.
        global_momentum_buffer (Optional[Tensor]): the slice's momentum ``u``.
        portion_start, portion_end (Optional[int]): the owned slice of the virtual vector.
        world_portion_length (Optional[int]): ``L``.
        initialized (bool): whether :meth:`init_buffers` ran.
    """

    def __init__(
        self,
        enabled: bool,
        momentum: float,
        lr: float,
        memory_efficient: bool,
        num_shards: int,
        process_rank: int,
        process_world_size: int,
    ) -> None:
        self.enabled = enabled
        self.momentum = momentum
        self.lr = lr
        self.memory_efficient = memory_efficient
        self.num_shards = num_shards
        self.process_rank = process_rank
        self.process_world_size = process_world_size
        self.is_shard_owner = process_rank < num_shards if memory_efficient else True
        self.old_params: Optional[Tensor] = None
        self.global_momentum_buffer: Optional[Tensor] = None
        self.portion_start: Optional[int] = None
        self.portion_end: Optional[int] = None
        self.world_portion_length: Optional[int] = None
        self.initialized = False
        # The optimizer's parameters the buffers were sized from, in order: the shards and ``old_params`` are laid
        # out over exactly these, so a later change (``add_param_group``) must be caught, not stepped over.
        self._layout: List[Tensor] = []

    @staticmethod
    def _params(optimizer: torch.optim.Optimizer) -> Iterator[Tuple[Tensor, float]]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p, float(group["lr"])

    def init_buffers(self, optimizer: torch.optim.Optimizer, average: bool = False) -> None:
        """Allocate ``old_params`` (a copy of the owned slice) and a zero momentum buffer.

        Args:
            average: take ``old_params`` from the parameters averaged over the world (one all-reduce of the whole
                vector, on every rank) rather than this rank's own. For buffers laid out lazily, after a first local
                step: see ``SlowMoDistributedDataParallel.perform_slowmo``.
        """
        if not self.enabled:
            self.initialized = True
            return
        params = [p for p, _ in self._params(optimizer)]
        # The optimizer is the caller's (SlowMoDistributedDataParallel.perform_slowmo passes it through). Marked
        # initialized only once the buffers are filled, so a call after a rejected optimizer (or a failed copy)
        # sets them up again instead of stepping without them.
        if not all(p.dtype == torch.float32 for p in params):
            dtypes = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
            raise FairscaleTypeError(
                f"SlowMo needs fp32 optimizer parameters, got {', '.join(dtypes)}; give the optimizer fp32 "
                "parameters (for an fp16 model, the fp32 master copies, and pass them as fp32_params)"
            )
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise FairscaleValueError(
                f"SlowMo needs all optimizer parameters on one device, got {', '.join(sorted(map(str, devices)))}; "
                "move the optimizer's parameters to one device"
            )
        total = sum(p.numel() for p in params)
        averaged = _world_average(params, self.process_world_size) if average else None  # on every rank, owner or not
        self.world_portion_length = math.ceil(total / self.num_shards)
        if self.is_shard_owner:
            if self.memory_efficient:
                self.portion_start = self.process_rank * self.world_portion_length
                self.portion_end = min((self.process_rank + 1) * self.world_portion_length, total)
            else:
                self.portion_start, self.portion_end = 0, total
            length = self.world_portion_length if self.memory_efficient else total
            device = params[0].device if params else torch.device("cpu")
            old_params = torch.zeros(length, dtype=torch.float32, device=device)
            with torch.no_grad():
                if averaged is not None:
                    old_params[: self.portion_end - self.portion_start].copy_(
                        averaged[self.portion_start : self.portion_end]
                    )
                else:
                    for flat, lo, hi, start, _ in self._owned_ranges(_FlatParams(self._params(optimizer))):
                        old_params[start : start + hi - lo].copy_(flat[lo:hi])
            self.old_params = old_params
            self.global_momentum_buffer = torch.zeros(length, dtype=torch.float32, device=device)
        self._layout = params
        self.initialized = True

    def _owned_ranges(self, flats: "_FlatParams") -> Iterator[Tuple[Tensor, int, int, int, float]]:
        """``(flat parameter, lo, hi, offset inside the slice, lr)``: ``flat[lo:hi]`` is the owned part of it."""
        assert self.portion_start is not None and self.portion_end is not None
        offset = 0
        for flat, lr in flats.items:
            lo, hi = max(offset, self.portion_start), min(offset + flat.numel(), self.portion_end)
            if lo < hi:
                yield flat, lo - offset, hi - offset, lo - self.portion_start, lr
            offset += flat.numel()

    def _owner_buckets(self, flats: "_FlatParams") -> Dict[int, List[Tensor]]:
        """The parameter element ranges grouped by owner rank (views of the flat parameters)."""
        assert self.world_portion_length is not None
        length = self.world_portion_length
        buckets: Dict[int, List[Tensor]] = {}
        offset = 0
        for flat, _ in flats.items:
            start = 0
            while start < flat.numel():
                owner = (offset + start) // length
                end = min(flat.numel(), (owner + 1) * length - offset)
                buckets.setdefault(owner, []).append(flat[start:end])
                start = end
            offset += flat.numel()
        return buckets

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One slow-momentum step (gather to owners, update, scatter back in memory-efficient mode)."""
        if not self.enabled:
            return
        self.check_layout(optimizer)
        # Everything that can fail on the layout is done before a parameter changes: a step that raised after the
        # division left every parameter divided by the world size, and a retry divided it again.
        flats = _FlatParams(self._params(optimizer))
        buckets = self._owner_buckets(flats) if self.memory_efficient else {}
        if self.memory_efficient:
            with torch.no_grad():
                for flat, _ in flats.items:
                    flat.div_(self.process_world_size)
            for owner in range(self.num_shards):
                if owner in buckets:
                    communicate(buckets[owner], lambda tensor, dst=owner: reduce(tensor, dst=dst))
        if self.is_shard_owner:
            self._update(flats)
        if self.memory_efficient:
            for owner in range(self.num_shards):
                if owner in buckets:
                    communicate(buckets[owner], lambda tensor, src=owner: broadcast(tensor, src=src))
        flats.write_back()

    def check_layout(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if the optimizer's parameters are not the ones the buffers were laid out over.

        Parameters added later (``optimizer.add_param_group``, e.g. progressive unfreezing) lie past the last shard:
        memory-efficient mode would divide them by the world size with no owner to reduce and broadcast them back
        (silently shrinking them at every step), and neither mode would give them slow momentum.
        """
        if not self.enabled or not self.initialized:
            return  # no buffers laid out yet (or none at all): nothing to be out of step with
        params = [p for p, _ in self._params(optimizer)]
        if len(params) != len(self._layout) or any(p is not q for p, q in zip(params, self._layout)):
            raise FairscaleRuntimeError(
                f"SlowMo's slow-momentum buffers were set up for {len(self._layout)} optimizer parameters at the first "
                f"perform_slowmo(), but the optimizer now has {len(params)} (or other ones): its parameters changed "
                "since (e.g. optimizer.add_param_group). Add all parameter groups before the first perform_slowmo(), "
                "or create a new SlowMoDistributedDataParallel (re-initializing the slow momentum) after changing them"
            )

    def _update(self, flats: "_FlatParams") -> None:
        assert self.old_params is not None and self.global_momentum_buffer is not None
        with torch.no_grad():
            for flat, lo, hi, start, lr in self._owned_ranges(flats):
                view = flat[lo:hi]
                old = self.old_params[start : start + hi - lo]
                u = self.global_momentum_buffer[start : start + hi - lo]
                if lr == 0.0:
                    # A group at lr 0 (a frozen group, or a warm-up schedule starting from 0) is a valid schedule,
                    # but the update divides by lr (0/0 = NaN for good). Such a group gets no slow-momentum step:
                    # its parameters stay as they are and its momentum is kept; ``old`` follows them so the next
                    # step (lr > 0) measures the drift from here, as after any step (``x == old``).
                    old.copy_(view)
                    continue
                u.mul_(self.momentum).add_((old - view) / lr)
                old.add_(u, alpha=-self.lr * lr)
                view.copy_(old)


class _FlatParams:
    """The optimizer's parameters as 1-D tensors in their logical (row-major) element order, with their lr.

    A contiguous parameter is viewed; another one (``channels_last``, any non-contiguous layout, which ``view(-1)``
    refused) is copied, and :meth:`write_back` copies the result into it.
    """

    def __init__(self, params: Iterator[Tuple[Tensor, float]]) -> None:
        self.items: List[Tuple[Tensor, float]] = []
        self._copies: List[Tuple[Tensor, Tensor]] = []
        for p, lr in params:
            data = p.data
            if data.is_contiguous():
                flat = data.view(-1)
            else:
                flat = data.contiguous().view(-1)
                self._copies.append((data, flat))
            self.items.append((flat, lr))

    def write_back(self) -> None:
        with torch.no_grad():
            for data, flat in self._copies:
                data.copy_(flat.view(data.shape))
