# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""In-place changes of a skip tensor across partitions that Pipe cannot follow, refused with a clear error.

``nn.Sequential`` pops the very object it stashed, with its graph; a portal hands out a detached alias and takes the
skip's gradient back from the stash point. Two changes then went wrong silently (found by fuzzes of Pipe, session 44):

* a change after the stash, before the pop (``ReLU(inplace=True)`` right after ``stash("s", x)``), of a skip that
  carries a gradient: the gradient missed it (the mask). Checked at the pop (or the copy to its device) when the
  stashed tensor required grad; when it was stashed by a checkpointed pass (no grad then), at its recomputation,
  when the recomputed tensor does require grad.
* a change after the pop, in a checkpointed pop partition (``s.mul_(2)`` in the popping layer): the recomputation
  popped the changed values and applied the change twice. Checked when the recomputation pops.

The change is seen through the tensor's version counter. A view (the micro-batches of an input, a slice of an
activation) shares its counter with its base and other views, so a change elsewhere would look like one of the
skip: views are not followed (as before these checks).
"""

from typing import Optional

from torch import Tensor

from ..checkpoint import is_recomputing

__all__ = ["InPlaceGuard"]


class InPlaceGuard:
    """Follows one skip tensor's version counter from its stash to its pops (one per portal)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version: Optional[int] = None  # at the stash, or at the last copy to another device
        self.grad_at_stash = False
        self.changed_before_pop = False
        self.version_at_pop: Optional[int] = None

    def stashed(self, tensor: Optional[Tensor]) -> None:
        """At the stash, and again at the stash's recomputation."""
        if is_recomputing() and self.changed_before_pop and tensor is not None and tensor.requires_grad:
            raise self._changed_after_stash()
        self.version = _followed_version(tensor)
        self.grad_at_stash = tensor is not None and tensor.requires_grad

    def moved(self, before: Tensor, after: Tensor) -> None:
        """At the copy of the tensor to the pop's device (the copy would carry a change over unseen)."""
        self._check_first_pass(before)
        self.version = _followed_version(after)

    def popped(self, tensor: Tensor) -> None:
        """At the pop, and again at the pop's recomputation."""
        if is_recomputing():
            if self.version_at_pop is not None and tensor._version != self.version_at_pop:
                raise RuntimeError(
                    f"Pipe: skip {self.name!r} was changed in place after its pop (by the popping layer or a later "
                    "one) in a checkpointed partition: its recomputation would pop the changed values and apply "
                    f"the change twice. Change a copy (s = s * 2, not s.mul_(2)), or stash a copy "
                    f"(stash({self.name!r}, x.clone()))."
                )
            return
        self._check_first_pass(tensor)
        self.version_at_pop = _followed_version(tensor)

    def _check_first_pass(self, tensor: Tensor) -> None:
        if self.version is None or tensor._version == self.version:
            return
        if self.grad_at_stash:
            raise self._changed_after_stash()
        self.changed_before_pop = True  # both passes pop the changed values; wrong only if it carries a gradient

    def _changed_after_stash(self) -> RuntimeError:
        return RuntimeError(
            f"Pipe: skip {self.name!r} carries a gradient and was changed in place after it was stashed (an in-place "
            "op after the stash, such as ReLU(inplace=True)). A skip across partitions carries its gradient from "
            f"the stash point, which would miss that change. Stash a copy (stash({self.name!r}, x.clone())), or "
            "use an out-of-place op there."
        )


def _followed_version(tensor: Optional[Tensor]) -> Optional[int]:
    if tensor is None or tensor.is_inference() or tensor._base is not None:
        return None  # nothing to follow: no tensor, no version counter, or one shared with other views
    return tensor._version
