# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Loads are collective: every rank of the process group loads, or every rank raises the same error unchanged.

A rank-local all-or-nothing load is not enough: with a bad dict on one rank only, that rank would raise while the
others load, leaving a model that is half old, half new, with buffers that differ between ranks. So each rank
loads under a snapshot of its shards and buffers, then the ranks agree in one small ``all_gather_object`` (each
rank's error, if any, the checkpoint id of the local dict it loaded, and a fresh token). When any rank failed, or
the ranks loaded local shards of different checkpoints, or full dicts with different parameter values (compared by
fingerprint), every rank restores its snapshot and raises the same error; nothing that the load could change is
visible to the caller before the agreement.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import torch

from fairscale.internal import collectives
from fairscale.internal.agreement import check_outcome_agrees

from . import hybrid, identity
from .naming import clean_path
from .state import TrainingState
from .unit import FSDPUnit

# Exception types a failing rank's error is re-created as on every rank (others become RuntimeError).
_REBUILDABLE: Dict[str, Type[Exception]] = {
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
    "KeyError": KeyError,
}


def load_group(unit: FSDPUnit) -> Any:
    """The group whose ranks load together: with hybrid sharding every replica loads too."""
    return hybrid.world_group() if unit.config.replicate_process_group is not None else unit.config.process_group


def agree_before_load(unit: FSDPUnit, what: str, check: Callable[[], None]) -> None:
    """Run ``check`` (raises when the load must be refused here); raise on every rank if it raised on any.

    A refusal decided on one rank alone (a backward pending there: when an aborted step's graph is freed depends on
    each process's garbage collection) left the other ranks in the load's collectives until the group's timeout.
    """
    error: Optional[Exception] = None
    try:
        check()
    except Exception as e:  # every rank must reach the agreement
        error = e
    group = load_group(unit)
    if isinstance(group, str):
        # An unpickled model ("MISSING" groups): the load itself says what to set; there is nothing to agree over.
        if error is not None:
            raise error
        return
    with collectives.collective_phase("load"), unit.device.as_current():
        check_outcome_agrees(what, error, group)


def load_collectively(
    unit: FSDPUnit,
    what: str,
    load: Callable[[], Any],
    loaded: Optional[Mapping[str, Any]],
    restore: Any,
    fingerprints: Optional[List[Tuple[str, int]]] = None,
) -> Any:
    """Run ``load`` on this rank, agree with every rank of the unit's process group, roll back everywhere on failure.

    Args:
        unit: the unit of the instance the load was called on.
        what: the method name, for messages.
        load: performs the rank-local load and returns its result (raises on bad input).
        loaded: the checkpoint identity of the loaded local dict (``None`` for full dicts and upstream files).
        restore: a context manager factory that snapshots shards and buffers and restores them if its body raises.
        fingerprints: filled by ``load`` with :func:`parameter_fingerprints` of what it loaded (full dicts): ranks
            whose fingerprints differ loaded different values, each keeping its own slice of them.

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
        prints = tuple(fingerprints) if fingerprints else None
        mine = (None if error is None else (_kind(error), _message(error)), _id(loaded), token, prints)
        # On the compute device: NCCL object collectives allocate on the current device.
        # With hybrid sharding every replica loads too: a load that failed on one replica only must roll back all.
        group = load_group(unit)
        with collectives.collective_phase("load"), unit.device.as_current():
            views: List[Tuple[Any, Optional[str], str, Any]] = collectives.all_gather_object(mine, group=group)
        ranks = list(collectives.group_ranks(group))
        failed = [(rank, view[0]) for rank, view in zip(ranks, views) if view[0] is not None]
        if failed:
            raise _agreed_error(what, failed) from error
        ids = {view[1] for view in views}
        if len(ids) > 1:
            listing = ", ".join(f"rank {rank}: {view[1]!r}" for rank, view in zip(ranks, views))
            raise RuntimeError(
                f"{what}: the ranks loaded shards of different checkpoints ({listing}); every rank restored its "
                "previous state. Load every rank's file of one checkpoint (each call of reshard_checkpoint or "
                "reshard_full_state_dict makes a new one: re-shard once and give every rank its part of that result)."
            )
        _check_same_values(what, ranks, [view[3] for view in views], "every rank restored its previous state")
    unit.ckpt_token = views[0][2]
    if loaded is not None and loaded.get("step") is not None:
        unit.ckpt_step = int(loaded["step"])
    return result


# Integer views of each element size: fingerprints sum bit patterns, which is exact and the same on any CPU or
# accelerator (a float sum depends on the order of the additions).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parameter_fingerprints(unit: FSDPUnit) -> List[Tuple[str, int]]:
    """``(name, fingerprint)`` of every full parameter of the tree sharded over the root's group; call inside
    ``summon_full_params``.

    The fingerprint is the wrapped-around sum of the values' bit patterns: one reduction per parameter, about the
    cost of the copy the load made, to compare what the ranks loaded without sending it.
    """
    out = []
    root_ranks = collectives.group_ranks(unit.config.process_group)
    for path, u in unit.named_units():
        if u is not unit and collectives.group_ranks(u.config.process_group) != root_ranks:
            # Sharded over another group than the root's (MoE experts, each on its own rank): the ranks hold, and
            # load, different values by design (upstream's per-rank expert checkpoints).
            continue
        if u.training_state != TrainingState.SUMMON_FULL_PARAMS:
            continue  # not summoned (a load inside summon_full_params(recurse=False)): its shards differ by design
        for h, names in zip(u.handles, u.param_name_groups):
            if not h.borrowed:
                data = h.param.data.detach().reshape(-1)
                words = data.view(_WORDS.get(data.element_size(), torch.uint8))
                shown = ", ".join(clean_path(f"{path}.{n}" if path else n) for n in names[:3])
                if len(names) > 1:  # one fingerprint per flat parameter: which member differs is not known
                    shown = f"one of the {len(names)} parameters flattened together ({shown}{', ...' if len(names) > 3 else ''})"
                out.append((shown, int(words.sum(dtype=torch.int64))))
    return out


def check_loaded_same_values(unit: FSDPUnit, what: str, fingerprints: List[Tuple[str, int]]) -> None:
    """After a full load that did not go through :func:`load_collectively` (a plain parent module's
    ``load_state_dict``): raise the same ``RuntimeError`` on every rank unless every rank loaded the same values.

    One ``all_gather_object`` of the :func:`parameter_fingerprints` each rank took. A rank whose load failed part way
    (torch copies what fits and reports the rest at the end) differs too, so every rank fails with it.
    """
    group = hybrid.world_group() if unit.config.replicate_process_group is not None else unit.config.process_group
    with collectives.collective_phase("load"), unit.device.as_current():
        prints: List[Any] = collectives.all_gather_object(tuple(fingerprints), group=group)
    _check_same_values(
        what,
        list(collectives.group_ranks(group)),
        prints,
        "every rank restored the previous parameters and buffers of its FSDP instances",
    )


def _check_same_values(what: str, ranks: List[int], prints: List[Any], outcome: str) -> None:
    """Raise ``RuntimeError`` naming the first parameters whose fingerprints differ from the first rank's."""
    for rank, mine in zip(ranks[1:], prints[1:]):
        if mine != prints[0]:
            name = next((a[0] for a, b in zip(prints[0] or (), mine or ()) if a != b), "the parameters")
            raise RuntimeError(
                f"{what}: the ranks loaded different full state dicts (the values of {name} differ between rank "
                f"{ranks[0]} and rank {rank}); {outcome}. Each rank keeps its slice of the dict it loads, so every "
                "rank must load the same one (e.g. torch.load the same file, or broadcast what one rank read)."
            )


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
