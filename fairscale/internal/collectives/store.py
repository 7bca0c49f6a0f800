# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Decisions made through the default group's rendezvous store: no collective, no device, any backend.

An object collective on an NCCL group runs on the *current* CUDA device, which is ``cuda:0`` on every rank of a
process that has not selected its GPU yet (Llama's reference code calls ``initialize_model_parallel`` before
``torch.cuda.set_device``). The key-value store that ``init_process_group`` rendezvoused through works the same on
every backend and touches no device, so a check that must run that early goes through it: every rank publishes a
short text, global rank 0 reads them all and publishes a verdict, every rank reads the verdict. ``2 * world_size``
store writes and reads in all (rank 0 reads each rank's text once), no all-to-all traffic.
"""

import itertools
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from ..errors import FairscaleRuntimeError
from .groups import _dist_ready

# Per tag, how many decisions this process has taken: the keys of the n-th decision of a tag are the same on every
# rank as long as every rank makes the same calls, which any collective requires anyway.
_generations: Dict[str, "itertools.count[int]"] = {}


def _default_store() -> Optional[Any]:
    """The default group's store, or ``None`` where torch keeps it elsewhere (then the caller cannot decide)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:  # pragma: no cover - every supported torch has it
        return None
    try:
        return get()
    except (RuntimeError, ValueError):  # pragma: no cover - a default group without a store
        return None


def _read(store: Any, key: str, what: str, waiting_for: str) -> str:
    try:
        return bytes(store.get(key)).decode()
    except RuntimeError as e:  # torch's DistStoreError is a RuntimeError; it ends at the store's timeout
        raise FairscaleRuntimeError(
            f"{what}: {waiting_for} did not arrive before the store's timeout (init_process_group's timeout): every "
            f"rank of the default group must make this call, at the same point of its program ({e})"
        ) from e


def decide_through_store(tag: str, text: str, judge: Callable[[List[str]], str], what: str) -> Optional[str]:
    """Publish ``text``; global rank 0 applies ``judge`` to every rank's text; return its verdict on every rank.

    Every rank of the default group must call this with the same ``tag``, as often as the others, like a
    collective. At world size 1, or where the default store cannot be found, nothing is communicated and the
    result is ``None``: the caller decides another way.

    Args:
        tag (str): names the decision (one key space per tag).
        text (str): this rank's contribution.
        judge (Callable[[List[str]], str]): run on global rank 0 with the texts in rank order; its result is the
            verdict.
        what (str): the calling function, for the timeout's message.

    Returns:
        Optional[str]: the verdict, the same on every rank; ``None`` when nothing was decided.

    Raises:
        FairscaleRuntimeError: a rank did not publish (or rank 0 did not judge) within the store's timeout.
    """
    if not _dist_ready() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "fake":
        # torch's single-process stand-in for a world (tracing, tests): no other rank will ever write its text.
        return None
    store = _default_store()
    if store is None:  # pragma: no cover - see _default_store
        return None
    generation = next(_generations.setdefault(tag, itertools.count()))
    prefix = f"fairscale/decide/{tag}/{generation}"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        store.set(f"{prefix}/{rank}", text)
    except RuntimeError:  # a store that cannot be written (torch's FakeStore): nothing can be decided through it
        return None
    if rank == 0:
        texts = [_read(store, f"{prefix}/{r}", what, f"global rank {r}'s call") for r in range(world_size)]
        try:
            verdict = judge(texts)
        except Exception as e:
            # The other ranks wait for a verdict: they get this one rather than a timeout.
            store.set(f"{prefix}/verdict", f"{what}: global rank 0 could not compare the ranks' calls: {e!r}")
            raise
        store.set(f"{prefix}/verdict", verdict)
        return verdict
    return _read(store, f"{prefix}/verdict", what, "global rank 0's verdict")
