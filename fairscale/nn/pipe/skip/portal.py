# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Portals: carry a skip tensor from the partition that stashes it to the partition that pops it.

A portal holds the tensor out of the main autograd lane and hands it out through three phony-producing autograd
functions, so the autograd engine orders everything correctly without the tensor travelling through the
partitions in between:

* ``blue`` (at the stash): a phony joined to the stash layer's output; its backward gives the stashed tensor the
  gradient the pop side left in the portal;
* ``copy`` (at the pipeline fence): moves the tensor to the pop partition's device;
* ``orange`` (at the pop): the tensor itself; its backward leaves the gradient in the portal.

Each hand-out uses one unit of "tensor life", and the tensor is dropped when the life reaches zero, so a portal
never keeps a skip tensor longer than the pipeline needs it.
"""

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..copy import Context as CopyContext
from ..copy import Copy as Copy
from ..copy import copy_tensors
from ..checkpoint import note_stash_phony
from ..phony import get_phony
from ..stream import AbstractStream, get_device
from .inplace_guard import InPlaceGuard
from .namespace import Namespace as Namespace

# The stream pair of a portal copy (upstream's name for it in this module).
Context = CopyContext

__all__ = ["Portal", "PortalBlue", "PortalOrange", "PortalCopy"]


class Portal:
    """Holds one skip tensor of one micro-batch, and its gradient.

    Args:
        tensor (Optional[Tensor]): the stashed tensor (``None`` is allowed and pops as ``None``).
        tensor_life (int): how many times the tensor may be handed out before it is dropped.
        index (int): the micro-batch index.
    """

    def __init__(self, tensor: Optional[Tensor], tensor_life: int, index: int) -> None:
        self.guard = InPlaceGuard("?")  # named by the tracker (see inplace_guard.py)
        self.put_tensor(tensor, tensor_life)
        self.grad: Optional[Tensor] = None
        self.__index = index
        self.ns_name: Optional[Tuple[Any, str]] = None

    @property
    def index(self) -> int:
        return self.__index

    def blue(self) -> Tensor:
        """A phony that becomes the stashed tensor's gradient path (at the stash)."""
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        phony = PortalBlue.apply(self, tensor)
        note_stash_phony(phony)
        return phony

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """The stashed tensor, depending on ``phony`` (at the pop)."""
        self.check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        self.guard.popped(self.tensor)
        return PortalOrange.apply(self, phony)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Move the tensor to ``next_stream``'s device; return a phony for the ordering."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError("tensor in portal has been removed")

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        """Store ``tensor`` for ``tensor_life`` hand-outs (not at all when the life is not positive)."""
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None
        self.guard.stashed(self.tensor)

    def use_tensor(self) -> Optional[Tensor]:
        """Hand the tensor out once; drop it when its life is used up."""
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> Tensor:
        """Hand the gradient out once (it is single-use)."""
        if self.grad is None:
            raise RuntimeError("grad in portal has been removed or never set")
        grad = self.grad
        self.grad = None
        return grad


class PortalBlue(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        phony = get_phony(tensor.device, requires_grad=False)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Tuple[None, Optional[Tensor]]:
        if ctx.portal.grad is None:
            # The popped tensor got no gradient in this backward (the pop used it without autograd, e.g. for a
            # mask, or not at all): the stash gets none either, as in the plain module (this raised before).
            return None, None
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:
        ctx.portal = portal
        # A popped tensor whose use reaches nothing gets no gradient (None), not zeros: materialised, the zeros went
        # back through the stash and gave the layers before it a zero .grad where the plain module leaves None
        # (momentum and weight decay then moved them; a fuzz of Pipe, session 44).
        ctx.set_materialize_grads(False)
        tensor = portal.use_tensor()
        assert tensor is not None
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Tuple[None, None]:
        if grad is not None:
            ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor
    ) -> Tensor:
        ctx.portal = portal
        ctx.streams = CopyContext(prev_stream, next_stream)
        assert portal.tensor is not None
        before = portal.tensor
        (portal.tensor,) = copy_tensors(ctx.streams, (portal.tensor,))
        portal.guard.moved(before, portal.tensor)
        phony = get_phony(get_device(next_stream), requires_grad=False)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Tuple[None, None, None, None]:
        portal = ctx.portal
        if portal.grad is not None:  # None: the popped tensor got no gradient (see PortalBlue.backward)
            (portal.grad,) = copy_tensors(ctx.streams.reversed(), (portal.grad,))
        return None, None, None, None
