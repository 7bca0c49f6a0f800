# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Loads are collective: every rank of the process group loads, or every rank raises the same error unchanged.

A rank-local all-or-nothing load is not enough: with a bad dict on one rank only, that rank would raise while the
others load, leaving a model that is half old, half new, with buffers that differ between ranks. So each rank
loads under a snapshot of its shards and buffers, then the ranks agree in one small ``all_gather_object`` (each
rank's error, if any, the checkpoint id of the local dict it loaded, and a fresh token). When any rank failed, or
the ranks loaded local shards of different checkpoints, every rank restores its snapshot and raises the same
error; nothing that the load could change is visible to the caller before the agreement.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

from fairscale.internal import collectives

from . import hybrid, identity
from .unit import FSDPUnit

# Exception types a failing rank's error is re-created as on every rank (others become RuntimeError).
_REBUILDABLE: Dict[str, Type[Exception]] = {
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
    "KeyError": KeyError,
}


def load_collectively(
    unit: FSDPUnit, what: str, load: Callable[[], Any], loaded: Optional[Mapping[str, Any]], restore: Any
) -> Any:
    """Run ``load`` on this rank, agree with every rank of the unit's process group, roll back everywhere on failure.

    Args:
        unit: the unit of the instance the load was called on.
        what: the method name, for messages.
        load: performs the rank-local load and returns its result (raises on bad input).
        loaded: the checkpoint identity of the loaded local dict (``None`` for full dicts and upstream files).
        restore: a context manager factory that snapshots shards and buffers and restores them if its body raises.

    Returns:
        ``load()``'s result, on every rank, when every rank succeeded.

    Raises:
        The first failing rank's exception type (``RuntimeError``, ``ValueError`` or ``KeyError``; others become
        ``RuntimeError``), with the same message on every rank.
    """
    with restore(unit):
        error: Optional[Exception] = None
        result = None
        try:
            result = load()
        except Exception as e:  # every rank must reach the agreement, whatever went wrong here
            error = e
        token = identity.new_token()
        mine = (None if error is None else (_kind(error), _message(error)), _id(loaded), token)
        # On the compute device: NCCL object collectives allocate on the current device.
        # With hybrid sharding every replica loads too: a load that failed on one replica only must roll back all.
        group = hybrid.world_group() if unit.config.replicate_process_group is not None else unit.config.process_group
        with collectives.collective_phase("load"), unit.device.as_current():
            views: List[Tuple[Any, Optional[str], str]] = collectives.all_gather_object(mine, group=group)
        ranks = list(collectives.group_ranks(group))
        failed = [(rank, view[0]) for rank, view in zip(ranks, views) if view[0] is not None]
        if failed:
            raise _agreed_error(what, failed) from error
        ids = {view[1] for view in views}
        if len(ids) > 1:
            listing = ", ".join(f"rank {rank}: {view[1]!r}" for rank, view in zip(ranks, views))
            raise RuntimeError(
                f"{what}: the ranks loaded shards of different checkpoints ({listing}); every rank restored its "
                "previous state. Load every rank's file of one checkpoint."
            )
    unit.ckpt_token = views[0][2]
    if loaded is not None and loaded.get("step") is not None:
        unit.ckpt_step = int(loaded["step"])
    return result


def _id(loaded: Optional[Mapping[str, Any]]) -> Optional[str]:
    return None if loaded is None else str(loaded.get("id"))


def _kind(error: Exception) -> str:
    """The most specific of the rebuildable types ``error`` is an instance of (subclasses map to their base)."""
    for cls in type(error).__mro__:
        if cls.__name__ in _REBUILDABLE and issubclass(type(error), _REBUILDABLE[cls.__name__]):
            return cls.__name__
    return "RuntimeError"


def _message(error: Exception) -> str:
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error)


def _agreed_error(what: str, failed: List[Tuple[int, Tuple[str, str]]]) -> Exception:
    kind, first = failed[0][1]
    head = f"{what} failed on rank(s) {[rank for rank, _ in failed]}; every rank restored its previous state. "
    if all(message == first for _, (_, message) in failed):
        text = head + first
    else:
        text = head + "\n" + "\n".join(f"rank {rank}: {message}" for rank, (_, message) in failed)
    return _REBUILDABLE.get(kind, RuntimeError)(text)
