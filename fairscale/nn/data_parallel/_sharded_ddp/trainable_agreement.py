# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Before a backward's first reduction, ShardedDataParallel's ranks check that they reduce the same parameters.

Ranks that froze different parameters (or refreshed on some ranks only) would send reductions that never match up:
they would wait until the group's timeout, or reduce one parameter's gradient into another's. One all-reduce of a
fingerprint of each rank's description tells; only when they differ are the descriptions gathered, to name the first
parameter that differs in the error every rank raises.
"""

import hashlib
from typing import Any, Callable, List, Optional

import torch

from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError, check_ranks_agree
from fairscale.internal.errors import FairscaleRuntimeError

__all__ = ["TrainableAgreement"]


class TrainableAgreement:
    """The check, with what it remembers between backwards.

    Args:
        describe: returns the callable that describes the managed parameters (one ``(name, requires_grad, hooked)``
            tuple each), or ``None`` once its owner is gone (a weak method, see ``reducer._weak_callable``).
        strict (bool): once the ranks agreed, refuse a backward in which some parameter's ``requires_grad`` flag
            differs from whether it is hooked (trainability changed without a refresh).
        group: the process group.
        world_size (int): its size.
    """

    def __init__(
        self,
        describe: Optional[Callable[[], Optional[Callable[[], List[Any]]]]],
        strict: bool,
        group: Any,
        world_size: int,
    ) -> None:
        self._describe = describe
        self.strict = strict
        self.group = group
        self.world_size = world_size
        # The last description and its fingerprint: hashing is skipped while the flags do not change.
        self._described: Optional[List[Any]] = None
        self._fingerprint = 0
        # The described parameters whose requires_grad flag differs from whether they are hooked (computed with the
        # fingerprint, i.e. only when the description changes).
        self._stale: List[Any] = []

    def check(self, device: torch.device) -> None:
        """Before this backward's first reduction: one all-reduce of ``[h, -h]`` (max) with ``h`` a fingerprint of
        this rank's description; if the maxima say the fingerprints differ, every rank gathers the descriptions and
        raises the same :class:`RanksDisagreeError`, naming the first parameter that differs."""
        describe = self._describe() if self._describe is not None else None
        if describe is None or (self.world_size == 1 and not self.strict):
            return
        description = describe()
        if description != self._described:
            digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
            self._fingerprint = int.from_bytes(digest, "big") >> 1  # 63 bits: -h fits in int64 too
            self._described = description
            self._stale = [entry for entry in description if bool(entry[1]) != bool(entry[2])]
        if self.world_size > 1:
            # On the gradients' device: any backend that reduces them can reduce this.
            both = torch.tensor([self._fingerprint, -self._fingerprint], dtype=torch.int64, device=device)
            collectives.all_reduce(both, group=self.group, op="max")
            highest, lowest = both.tolist()
            if highest != -lowest:
                what = "ShardedDataParallel: the parameters to reduce (name, requires_grad, hooked for reduction)"
                hint = (
                    "Freeze or unfreeze parameters on every rank alike, and call refresh_trainable() on every rank (or "
                    "keep auto_refresh_trainable=True): every rank must reduce the same gradients."
                )
                check_ranks_agree(what, description, self.group, hint, device=device)
                raise RanksDisagreeError(f"{what} differ between ranks. {hint}")  # pragma: no cover - raised above
        if self.strict and self._stale:
            self._raise_stale()

    def _raise_stale(self) -> None:
        """Trainability changed on every rank alike without a refresh: the hooks no longer match the flags.

        Raised here, after the ranks agreed and before any reduction of this backward, rather than at the forward:
        the flags are then known to be the same on every rank, so every rank raises the same error and none is left
        waiting in a collective (a rank that changed the flags alone gets the agreement error above instead).
        """
        unhooked = [str(entry[0]) for entry in self._stale if entry[1]]
        hooked = [str(entry[0]) for entry in self._stale if not entry[1]]
        parts = []
        if unhooked:
            parts.append(f"unfrozen, never reduced: {', '.join(unhooked)}")
        if hooked:
            parts.append(f"frozen, still hooked: {', '.join(hooked)}")
        raise FairscaleRuntimeError(
            "ShardedDataParallel: requires_grad changed since the gradient hooks were built, and "
            f"auto_refresh_trainable=False ({'; '.join(parts)}). Their gradients would not be reduced as their flags "
            "say (an unfrozen parameter would be trained on each rank's own gradient, and the replicas would drift "
            "apart). Call refresh_trainable() on every rank after changing requires_grad, or build "
            "ShardedDataParallel with auto_refresh_trainable=True."
        )
