# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Ranks that must agree: one small object all-gather, and the same clear error on every rank when they do not.

Data-parallel wrappers, sharded optimizers, pipelines and MoE layers all assume that every rank of a group holds the
same thing (a model of the same shapes, the same number of micro-batches, the same token count). When one rank
differs, the next tensor collective has mismatched sizes: gloo aborts the process, NCCL corrupts memory or hangs.
:func:`check_ranks_agree` turns that into one cheap ``all_gather_object`` of a small description, compared on every
rank, so that every rank raises the same :class:`RanksDisagreeError` naming the first rank that differs::

    check_ranks_agree("OSS: the parameters (name, shape, dtype)", describe_parameters(params), group)

:func:`check_outcome_agrees` does the same for "did this step fail on some rank?", so that a failure on one rank
becomes an exception on all of them instead of a peer left waiting in its next collective.
"""

import contextlib
import json
import numbers
from typing import Any, ContextManager, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import collectives
from .device import DeviceHandle
from .errors import FairscaleValueError

__all__ = [
    "RanksDisagreeError",
    "check_ranks_agree",
    "check_gathered_agree",
    "comparable_number",
    "gather_from_ranks",
    "check_world_agrees_through_store",
    "check_outcome_agrees",
    "describe_tensors",
    "first_device",
]

# At most this many characters of each differing value go into the message.
_SHOWN_CHARS = 300


class RanksDisagreeError(FairscaleValueError):
    """The ranks of a group hold different values of something that must be the same on all of them.

    A ``ValueError`` (and, as upstream asserted such things, an ``AssertionError``). Raised with the same message on
    every rank of the group.
    """


def describe_tensors(named: Iterable[Tuple[str, Tensor]]) -> List[Tuple[str, Tuple[int, ...], str, bool]]:
    """``(name, shape, dtype, requires_grad)`` of each tensor: what the ranks of a data-parallel group must share."""
    return [(name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)) for name, t in named]


def first_device(tensors: Iterable[Any]) -> Optional[torch.device]:
    """The device of the first tensor in ``tensors`` (``None`` if there is none): the ``device`` to pass to
    :func:`check_ranks_agree` for a model or an optimizer."""
    for t in tensors:
        if isinstance(t, Tensor):
            return t.device
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _first_difference(a: Any, b: Any) -> str:
    """A short pointer to where two gathered descriptions first differ (lists: the first differing entry)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {i}: {_shown(x)} vs {_shown(y)}"
        longer, shorter = (a, b) if len(a) > len(b) else (b, a)
        return f"{len(a)} entries vs {len(b)}; the first extra entry is {_shown(longer[len(shorter)])}"
    return f"{_shown(a)} vs {_shown(b)}"


def _on_device(device: Optional[Union[str, torch.device]]) -> ContextManager[None]:
    """The object gather's device context: NCCL object collectives place their buffers on the *current* CUDA
    device, which is ``cuda:0`` on every rank of a process that never selected its GPU (``set_device``) (NCCL then
    fails with a duplicate-GPU error or hangs). The caller's tensors' device is the one this rank uses."""
    if device is None:
        return contextlib.nullcontext()
    return DeviceHandle.for_device(device).as_current()


def check_ranks_agree(
    what: str,
    value: Any,
    group: Optional[Any] = None,
    hint: str = "",
    device: Optional[Union[str, torch.device]] = None,
) -> None:
    """Raise :class:`RanksDisagreeError` on every rank of ``group`` unless all of them passed an equal ``value``.

    One ``all_gather_object`` (skipped at world size 1). Every rank of ``group`` must call it at the same point.

    Args:
        what (str): what ``value`` describes, for the message (e.g. ``"ShardedDataParallel: the parameters"``).
        value (Any): this rank's description: small, picklable, comparable with ``==``.
        group (Optional[Any]): the process group, ``None`` for the default world group.
        hint (str): what the user should do, appended to the message.
        device (Optional[Union[str, torch.device]]): the device this rank's tensors (and hence its NCCL
            collectives) use, made current for the gather; ``None`` keeps the current one. Pass it whenever the
            group may be NCCL.

    Raises:
        RanksDisagreeError: the values differ; the message names the first rank that differs from the group's
            first rank and where.
    """
    if collectives.group_size(group) == 1:
        return
    with _on_device(device):
        gathered = collectives.all_gather_object(value, group)
    check_gathered_agree(what, gathered, group, hint)


def comparable_number(value: Any) -> str:
    """``value`` as ranks compare it in an agreement check: a real number by its float's ``repr`` (4 and 4.0 agree,
    and NaN agrees with NaN, so that the value's own check raises its clearer error after the comparison), anything
    else by its ``repr`` (``float()`` of a string raised on that rank alone, before the gather, and left the others
    waiting in it)."""
    return repr(float(value)) if isinstance(value, numbers.Real) else repr(value)


def gather_from_ranks(
    value: Any, group: Optional[Any] = None, device: Optional[Union[str, torch.device]] = None
) -> List[Any]:
    """Every rank's ``value``, in group-rank order: one ``all_gather_object`` (``[value]`` at world size 1).

    For checks of values that differ by design (a rank number): every rank then sees the same list and can raise
    the same error. Pass what must be equal in the same value and check it with :func:`check_gathered_agree`, so
    that one collective does both.

    Args:
        value (Any): this rank's value: small and picklable.
        group (Optional[Any]): the process group, ``None`` for the default world group.
        device (Optional[Union[str, torch.device]]): as for :func:`check_ranks_agree`.

    Returns:
        List[Any]: one value per rank of ``group``.
    """
    if collectives.group_size(group) == 1:
        return [value]
    with _on_device(device):
        return list(collectives.all_gather_object(value, group))


def check_gathered_agree(what: str, gathered: Sequence[Any], group: Optional[Any] = None, hint: str = "") -> None:
    """:func:`check_ranks_agree` for values the caller gathered itself, riding in a collective it makes anyway.

    Args:
        what (str): what the values describe, for the message.
        gathered (Sequence[Any]): one value per rank of ``group``, in group-rank order (the same on every rank).
        group (Optional[ProcessGroup]): the group they were gathered over (``None``: the default group).
        hint (str): appended to the message: what to do about it.

    Raises:
        RanksDisagreeError: the values differ (on every rank, as each sees the same ``gathered``).
    """
    for i, other in enumerate(gathered[1:], start=1):
        if other != gathered[0]:
            ranks = collectives.group_ranks(group)
            # The caller's hint says what to do; without one, the generic advice.
            advice = hint or "Every rank of the group must pass the same."
            raise RanksDisagreeError(
                f"{what} differ between ranks: global rank {ranks[i]} differs from global rank {ranks[0]} "
                f"({_first_difference(gathered[0], other)}). {advice}"
            )


def check_world_agrees_through_store(what: str, value: Any, hint: str = "") -> None:
    """:func:`check_ranks_agree` over the default group, made through its rendezvous store instead of a collective.

    For checks that run before a rank may have selected its device (the object gather of an NCCL group would then
    run on ``cuda:0`` on every rank), and before any group of the caller exists: the store works the same on every
    backend and touches no device. Global rank 0 compares; every rank raises the same error.

    Args:
        what (str): what ``value`` describes, for the message.
        value (Any): this rank's description: numbers, strings, ``None``, lists, tuples (other objects are compared
            by their ``repr``).
        hint (str): what the user should do, appended to the message.

    Raises:
        RanksDisagreeError: the values differ (on every rank).
        FairscaleRuntimeError: a rank did not make the call within the store's timeout.
    """
    # JSON rather than pickle: rank 0 decodes what other processes wrote. Tuples come back as lists on every rank.
    verdict = collectives.decide_through_store(
        "check_world_agrees",
        json.dumps(value, default=repr),
        lambda texts: _disagreement([json.loads(t) for t in texts], what, hint),
        what,
    )
    if verdict:  # None: world size 1 (nothing to compare), or a torch that keeps no default store
        raise RanksDisagreeError(verdict)


def _disagreement(gathered: Sequence[Any], what: str, hint: str) -> str:
    """The message :func:`check_gathered_agree` would raise for ``gathered``, or ``""`` when the values agree."""
    try:
        check_gathered_agree(what, gathered, None, hint)
    except RanksDisagreeError as e:
        return str(e)
    return ""


def check_outcome_agrees(
    what: str,
    error: Optional[BaseException],
    group: Optional[Any] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> None:
    """Make a failure on any rank of ``group`` a failure on all of them.

    Every rank calls this after a step that may have failed locally, with the exception it caught (or ``None``).
    A rank that failed re-raises its own exception; the others raise ``RuntimeError`` naming the failed rank and its
    error, so no rank goes on to a collective that a failed peer will never join.

    Args:
        what (str): the step, for the message.
        error (Optional[BaseException]): this rank's exception, or ``None`` if the step succeeded here.
        group (Optional[Any]): the process group, ``None`` for the default world group.
        device (Optional[Union[str, torch.device]]): as for :func:`check_ranks_agree`.
    """
    if collectives.group_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    with _on_device(device):
        outcomes: Sequence[Optional[str]] = collectives.all_gather_object(mine, group)
    if error is not None:
        raise error
    ranks = collectives.group_ranks(group)
    for rank, outcome in zip(ranks, outcomes):
        if outcome is not None:
            raise RuntimeError(f"{what} failed on global rank {rank}: {outcome}")
