# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's construction checks: what every rank must share, the rank numbers no two ranks may share, and the kind
of value each setting must be.

Upstream checked none of this across ranks: ranks built with other settings diverged silently or waited in
different collectives, and two ranks given the same ``process_rank`` built groups that never matched.
"""

import itertools
import numbers
from typing import Any, List, Sequence, Tuple

import torch.nn as nn

from fairscale.internal.agreement import (
    RanksDisagreeError,
    check_gathered_agree,
    describe_tensors,
    first_device,
    gather_from_ranks,
)
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

__all__ = ["check_algorithm_settings", "check_construction_agrees", "check_counts", "check_real_numbers"]

# The values of ``SlowMoBaseAlgorithm``, a ``str`` enum whose members equal them: the enum lives in ``distributed``
# (its public home since upstream), which imports this module.
_LOCALSGD, _SGP = "localsgd", "sgp"


def check_construction_agrees(
    module: nn.Module,
    settings: Sequence[Tuple[str, Any]],
    process_rank: int,
    process_world_size: int,
    group: Any,
) -> None:
    """One all-gather: the settings and the module's tensors must be equal on every rank of ``group``, and the
    ``process_rank`` values distinct and below ``process_world_size``.

    Raises:
        RanksDisagreeError: on every rank of ``group``, naming the first rank that differs or the shared rank.
    """
    tensors = describe_tensors(list(module.named_parameters()) + list(module.named_buffers()))
    device = first_device(itertools.chain(module.parameters(), module.buffers()))
    gathered = gather_from_ranks((tuple(settings), tensors, process_rank), group, device)
    check_gathered_agree(
        "SlowMoDistributedDataParallel: the settings ("
        + ", ".join(name for name, _ in settings)
        + ") and the module's parameters and buffers (name, shape, dtype, requires_grad)",
        [entry[:2] for entry in gathered],
        group,
        hint="Build it with the same arguments around the same model on every rank.",
    )
    ranks: List[Any] = [entry[2] for entry in gathered]
    shared = sorted({r for r in ranks if ranks.count(r) > 1}, key=repr)
    outside = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < process_world_size]
    if shared or outside:
        problem = f"{shared[0]!r} is given to several ranks" if shared else f"{outside[0]!r} is not a rank"
        raise RanksDisagreeError(
            f"SlowMoDistributedDataParallel: the ranks' process_rank values are {ranks}, but {problem} of a world "
            f"of {process_world_size}; pass each rank its own process_rank in [0, {process_world_size}) (or leave it "
            "None for the global rank)"
        )


def check_real_numbers(**values: Any) -> None:
    """Each value must be a real number (not a bool): the slow-momentum arithmetic uses them as floats."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise FairscaleTypeError(f"SlowMoDistributedDataParallel: {name} must be a real number, got {value!r}")


def check_counts(*counts: Tuple[str, Any]) -> None:
    """Each ``(name, value)`` must be a positive integer (not a bool)."""
    for name, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel: {name} must be a positive integer, got {value!r}"
            )


def check_algorithm_settings(
    algorithm: Any, slowmo: bool, memory_efficient: bool, slowmo_frequency: Any, localsgd_frequency: Any, shards: Any
) -> None:
    """Refuse what would hang or be ignored silently (upstream checked the algorithm on one node only; the counts
    divided by zero at the first slow-momentum step, or, for a negative shard count, looped without end). A count
    is checked only where the configuration can use it (localsgd_frequency with LocalSGD, even on one node, where
    the groups built later turn LocalSGD off), so that a value it never reads is still accepted."""
    if algorithm not in (_LOCALSGD, _SGP):
        # On several nodes an unknown value (a typo such as "local_sgd") ran neither base algorithm: the ranks never
        # synchronised.
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel: unknown slowmo_base_algorithm {algorithm!r}; "
            "pass SlowMoBaseAlgorithm.LOCALSGD or SlowMoBaseAlgorithm.SGP"
        )
    counts = [("slowmo_frequency", slowmo_frequency)] if slowmo else []
    if algorithm == _LOCALSGD:
        counts.append(("localsgd_frequency", localsgd_frequency))
    if slowmo and memory_efficient:
        counts.append(("slowmo_num_shards", shards))
    check_counts(*counts)
