# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A stand-in process group that knows only its rank and size.

It lives here, with no test dependency, because clients use it outside tests: fairseq and metaseq pass
``DummyProcessGroup(rank=0, size=1)`` as FSDP's ``process_group`` when they train on one process without
``torch.distributed``. Upstream's import paths (``fairscale.fair_dev.testing.testing`` and, before 0.4.7,
``fairscale.utils.testing``) re-export it.
"""


class DummyProcessGroup:
    """A stand-in process group that only knows its rank and size (no communication).

    Args:
        rank: the rank to report.
        size: the size to report.

    Raises:
        ValueError: ``size`` is below 1 or ``rank`` is not in ``[0, size)``.
    """

    def __init__(self, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"DummyProcessGroup needs size >= 1 and 0 <= rank < size, got rank={rank}, size={size}")
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        """The rank given at construction."""
        return self._rank

    def size(self) -> int:
        """The size given at construction."""
        return self._size

    def __repr__(self) -> str:
        return f"DummyProcessGroup(rank={self._rank}, size={self._size})"
