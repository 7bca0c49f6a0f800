# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Skip trackers: where stashed skip tensors wait until they are popped."""

import threading
from contextlib import contextmanager
from typing import Dict, Generator, Optional, Tuple

from torch import Tensor

# The portal's fork/join sits on the first tensor autograd follows (always the first tensor before: when that was an
# integer tensor, ids beside the activations, the portal left the graph and the skip's gradient was lost silently).
from ..checkpoint import _first_grad_index, is_checkpointing
from ..dependency import fork, join
from ..microbatch import Batch
from ..stream import AbstractStream
from ._routes import SkipLayout as SkipLayout  # upstream's namespace: tracker.SkipLayout
from .namespace import Namespace
from .portal import Portal

__all__ = ["SkipTracker", "SkipTrackerThroughPotals", "use_skip_tracker", "current_skip_tracker"]


class SkipTracker:
    """The plain tracker: a dict of skip tensors, for use without a pipeline (or within one partition)."""

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}

    @property
    def index(self) -> int:
        """The micro-batch index (always 0 without a pipeline)."""
        return 0

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        return self.tensors.pop((ns, name))

    def copy(
        self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream, ns: Namespace, name: str
    ) -> None:
        raise TypeError("copy is not supported for non-portal skip tensors")


class SkipTrackerThroughPotals(SkipTracker):
    """The tracker of one micro-batch in a :class:`~fairscale.nn.pipe.Pipe`: skips across partitions use portals.

    (The misspelled name is upstream's public name.)
    """

    def __init__(self, skip_layout: "SkipLayout", index: int) -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: Dict[Tuple[Namespace, str], Portal] = {}
        self.__index = index
        # Set by Pipe, which decides checkpointing per partition (a frozen one with an input that needs no grad runs
        # plainly): the pop's partition may recompute where the stash's did not, and the reverse. The extra hand-out
        # for the pop's recomputation is then added when that partition is checkpointed (reserve_recompute), not
        # guessed at the stash: a hand-out never taken kept the skip tensor alive as long as the output (a fuzz).
        self.reserve_per_pop = False

    @property
    def index(self) -> int:
        return self.__index

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if not self.skip_layout.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return
        portal = self.portals.get((ns, name))
        if portal is None:
            # Life: one hand-out at the stash (blue), one at the pop (orange), one more for the pop's
            # recomputation when the pop side is checkpointed.
            tensor_life = 3 if is_checkpointing() and not self.reserve_per_pop else 2
            portal = Portal(tensor, tensor_life, self.index)
            portal.ns_name = (ns, name)
            portal.guard.name = name
            self.portals[(ns, name)] = portal
        else:
            # The stash layer's recomputation: the tensor is only handed out to the blue phony again.
            portal.put_tensor(tensor, 1)
        phony = portal.blue()
        i = _first_grad_index(batch)
        if tensor is not None and tensor.requires_grad and not batch[i].is_floating_point():
            # The skip's gradient reaches the stash through this join; an integer tensor carries none, and the
            # stashing layer got no gradient, silently (token ids as the whole activation; a fuzz, session 43).
            raise TypeError(
                f"skip {name!r} crosses partitions and needs a gradient, but the stashing layer's output has no "
                "floating-point tensor to carry it back (only integer or boolean tensors). Return a floating-point "
                "tensor beside them (e.g. (ids, hidden)), or keep the stash and its pop in one partition."
            )
        batch[i] = join(batch[i], phony)

    def reserve_recompute(self, ns: Namespace, name: str) -> None:
        """One more hand-out of the skip ``(ns, name)``: the partition that pops it will be recomputed."""
        portal = self.portals.get((ns, name))
        if portal is not None:  # a None skip counts its hand-outs too
            portal.tensor_life += 1

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)
        portal = self.portals[(ns, name)]
        i = _first_grad_index(batch)
        batch[i], phony = fork(batch[i])
        return portal.orange(phony)

    def copy(
        self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream, ns: Namespace, name: str
    ) -> None:
        """Move the skip tensor to ``next_stream``'s device, ordered with ``batch`` by fork/join."""
        if not self.skip_layout.requires_copy(ns, name):
            raise RuntimeError(f"fairscale internal error: skip {name!r} copied though its layout needs no copy")
        i = _first_grad_index(batch)
        batch[i], phony = fork(batch[i])
        portal = self.portals[(ns, name)]
        phony = portal.copy(prev_stream, next_stream, phony)
        batch[i] = join(batch[i], phony)


class ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


thread_local = ThreadLocal()


@contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Generator[None, None, None]:
    """Make ``skip_tracker`` the current tracker of this thread for the block."""
    orig = thread_local.skip_tracker
    thread_local.skip_tracker = skip_tracker
    try:
        yield
    finally:
        thread_local.skip_tracker = orig


def current_skip_tracker() -> SkipTracker:
    """The current tracker of this thread (a plain :class:`SkipTracker` is made on first use)."""
    skip_tracker = thread_local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        thread_local.skip_tracker = skip_tracker
    return skip_tracker
