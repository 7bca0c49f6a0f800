# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Random-number states kept outside torch's generators, replayed by a checkpointed recomputation.

torch's checkpoint replays the CPU and accelerator generators. Some states live elsewhere: the model-parallel
RNG tracker (``fairscale.nn.model_parallel.random.get_cuda_rng_tracker()``) keeps named streams that its ``fork()``
swaps into the generator and advances; dropout under it drew new masks in the recomputation (silently wrong
gradients). Such a source registers a getter and a setter here (the model-parallel package does at import), and
:func:`checkpoint_wrapper` records every source at the forward and replays it in the recomputation.
"""

import contextlib
from typing import Any, Callable, Iterator, List, Tuple

__all__ = ["RngSource", "captured_rng_sources", "register_rng_source", "replaying_rng_sources"]

#: A getter returning the source's current state, and a setter taking such a state back.
RngSource = Tuple[Callable[[], Any], Callable[[Any], None]]

_SOURCES: List[RngSource] = []

#: What :func:`captured_rng_sources` returns: each source with its state.
Captured = Tuple[Tuple[RngSource, Any], ...]


def register_rng_source(get_state: Callable[[], Any], set_state: Callable[[Any], None]) -> None:
    """Have checkpointed recomputations replay this state (``get_state()`` must return a value that later changes
    of the source do not modify)."""
    _SOURCES.append((get_state, set_state))


def captured_rng_sources() -> Captured:
    """The current state of every registered source (at a checkpointed forward)."""
    return tuple((source, source[0]()) for source in _SOURCES)


@contextlib.contextmanager
def replaying_rng_sources(captured: Captured) -> Iterator[None]:
    """Run the block with the sources in their ``captured`` states; put their current states back after, so that
    the recomputation leaves the streams where the training loop has them."""
    current = [(source, source[0]()) for source, _ in captured]
    for (_, set_state), state in captured:
        set_state(state)
    try:
        yield
    finally:
        for (_, set_state), state in current:
            set_state(state)
