# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The two explicit state enums of FullyShardedDataParallel.

``TrainingState`` is per FSDP instance and keeps upstream's names and values (outside code compares against them);
every change goes through :func:`check_training_transition`. ``HandleState`` is per owned parameter and says which
tensors are allocated; every change goes through :func:`check_handle_transition`. An illegal step (a forward inside
a summon, reading a freed buffer, gathering twice) then fails loudly instead of corrupting data.
"""

from enum import Enum, auto
from typing import Dict, FrozenSet


class TrainingState(Enum):
    """Phase of one FSDP instance, as upstream.

    * ``IDLE``: not in forward/backward/summon; ``p.data`` is the fp32 shard of every owned param.
    * ``FORWARD``: inside this instance's forward.
    * ``BACKWARD_PRE``: the pre-backward hook ran (full params rebuilt), no gradient reduced yet.
    * ``BACKWARD_POST``: at least one owned param's gradient was handed to the reduction.
    * ``SUMMON_FULL_PARAMS``: inside :meth:`summon_full_params`.
    """

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()

    # Members are singletons compared by identity, so the identity hash is a valid hash; Enum's own hashes the name
    # in Python, and every transition of every unit looks its state up in a table.
    __hash__ = object.__hash__


_T = TrainingState
# FORWARD may start from a backward state: activation checkpointing recomputes a unit's forward inside its backward,
# and the forward then returns to the state it started from. A backward state goes back to IDLE at the end of the
# backward (the root's final callback) or when the next forward finds that a backward raised (recovery).
_TRAINING_LEGAL: Dict[TrainingState, FrozenSet[TrainingState]] = {
    _T.IDLE: frozenset({_T.IDLE, _T.FORWARD, _T.BACKWARD_PRE, _T.SUMMON_FULL_PARAMS}),
    _T.FORWARD: frozenset({_T.IDLE, _T.BACKWARD_PRE, _T.BACKWARD_POST}),
    _T.BACKWARD_PRE: frozenset({_T.BACKWARD_PRE, _T.BACKWARD_POST, _T.FORWARD, _T.IDLE}),
    _T.BACKWARD_POST: frozenset({_T.BACKWARD_POST, _T.FORWARD, _T.IDLE}),
    _T.SUMMON_FULL_PARAMS: frozenset({_T.IDLE}),
}


def check_training_transition(current: TrainingState, new: TrainingState, what: str) -> None:
    """Raise if ``current -> new`` is not a legal training-state transition.

    Args:
        current: the state the instance is in.
        new: the requested state.
        what: a name for the instance, used in the message.
    """
    if new not in _TRAINING_LEGAL[current]:
        raise RuntimeError(
            f"FullyShardedDataParallel {what}: cannot go from {current.name} to {new.name}. A forward cannot run "
            "inside summon_full_params() or inside its own forward, and a backward hook cannot run outside backward."
        )


class HandleState(Enum):
    """Which tensors one owned parameter holds besides its fp32 shard (always allocated).

    * ``SHARDED``: only the fp32 shard (and gradient state). ``p.data`` is the fp32 shard.
    * ``FULL``: the padded full parameter in compute dtype is allocated and valid; forward/backward run on views of it.
    * ``ZERO2_SLICE``: this rank's 1/G slice of the padded full parameter (compute dtype) is kept for the backward
      all-gather over the zero2 group; the full buffer itself is freed.
    """

    SHARDED = auto()
    FULL = auto()
    ZERO2_SLICE = auto()

    __hash__ = object.__hash__  # as TrainingState's: every handle transition looks its state up


_LEGAL: Dict[HandleState, FrozenSet[HandleState]] = {
    HandleState.SHARDED: frozenset({HandleState.FULL}),
    HandleState.FULL: frozenset({HandleState.SHARDED, HandleState.ZERO2_SLICE}),
    HandleState.ZERO2_SLICE: frozenset({HandleState.FULL, HandleState.SHARDED}),
}


def check_handle_transition(current: HandleState, new: HandleState, what: str) -> None:
    """Raise if ``current -> new`` is not a legal handle transition.

    Args:
        current: the state the handle is in.
        new: the requested state.
        what: a name for the parameter, used in the message.
    """
    if new not in _LEGAL[current]:
        raise RuntimeError(
            f"FSDP internal state error for {what}: cannot go from {current.name} to {new.name}. "
            "This usually means a forward/backward ran in an unsupported order; please report it."
        )
