# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SlowMo's construction checks: what every rank must share, the rank numbers no two ranks may share, and the kind
of value each setting must be.

Upstream checked none of this across ranks: ranks built with other settings diverged silently or waited in
different collectives, and two ranks given the same ``process_rank`` built groups that never matched.
"""

import itertools
import math
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import torch.nn as nn

from fairscale.internal.agreement import (
    RanksDisagreeError,
    check_gathered_agree,
    describe_tensors,
    first_device,
    gather_from_ranks,
)
from fairscale.internal.collectives import group_ranks
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError
from fairscale.internal.sparse_layers import sparse_gradient_layer

from .graph_manager import GraphManager
from .mixing_manager import MixingManager

__all__ = [
    "check_algorithm_settings",
    "check_construction_agrees",
    "check_counts",
    "check_dense_embeddings",
    "check_real_numbers",
    "check_sizes",
    "graph_mismatch",
    "is_integer",
    "meta_sgp_error",
]

# The values of ``SlowMoBaseAlgorithm``, a ``str`` enum whose members equal them: the enum lives in ``distributed``
# (its public home since upstream), which imports this module.
_LOCALSGD, _SGP = "localsgd", "sgp"


def check_construction_agrees(
    module: nn.Module,
    settings: Sequence[Tuple[str, Any]],
    process_rank: int,
    process_world_size: int,
    group: Any,
    local_error: Optional[Exception] = None,
) -> None:
    """One all-gather: the settings and the module's tensors must be equal on every rank of ``group``, the
    ``process_rank`` values distinct and each the rank's own, and no rank may have found its own arguments wrong.

    Args:
        local_error: what this rank found wrong with arguments that differ by rank (``None``: nothing); raised here,
            and the other ranks raise an error naming this rank, instead of waiting for it in their next collective.

    Raises:
        RanksDisagreeError: on every rank of ``group``, naming the first rank that differs or the shared rank.
    """
    tensors = describe_tensors(list(module.named_parameters()) + list(module.named_buffers()))
    device = first_device(itertools.chain(module.parameters(), module.buffers()))
    refused = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    gathered = gather_from_ranks((tuple(settings), tensors, process_rank, refused), group, device)
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
    # The gathered list is in group-rank order. The groups, the slow-momentum reduce and broadcast, and the master
    # test address ranks by their number in the group, so another rank's number (distinct, in range) made the rank
    # that updates a shard another than the one that received its reduce: the slow momentum was silently lost.
    foreign = [i for i, r in enumerate(ranks) if r != i]
    if foreign:
        i = foreign[0]
        raise RanksDisagreeError(
            f"SlowMoDistributedDataParallel: the ranks' process_rank values are {ranks}, but the process of rank {i} "
            f"in the global group (global rank {group_ranks(group)[i]}) passed process_rank {ranks[i]}; process_rank "
            "must be the process's own rank in the global group (torch.distributed.get_rank(global_group)): pass "
            "that, or leave it None"
        )
    if local_error is not None:
        raise local_error
    for i, entry in enumerate(gathered):
        if entry[3] is not None:
            raise RanksDisagreeError(
                f"SlowMoDistributedDataParallel: global rank {group_ranks(group)[i]} refused its arguments "
                f"({entry[3]}); fix them on that rank"
            )


def check_real_numbers(**values: Any) -> None:
    """Each value must be a finite real number (not a bool), at least 0: the slow-momentum step uses them as a
    learning rate and a momentum (NaN or inf turned every parameter into NaN at the first step; torch's SGD refuses
    negative ones)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise FairscaleTypeError(f"SlowMoDistributedDataParallel: {name} must be a real number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel: {name} must be a finite number >= 0, got {value!r}; pass e.g. the "
                "defaults slowmo_lr=1.0, slowmo_momentum=0.5"
            )


def check_sizes(nprocs_per_node: Any, process_world_size: Any) -> int:
    """``nprocs_per_node`` as an int, once it and the world size are integers and it is at least 1 (a float or a
    string failed deep inside group creation, after the global group was made)."""
    for name, value, meaning in (
        ("nprocs_per_node", nprocs_per_node, "the number of processes per node"),
        ("process_world_size", process_world_size, "the number of processes (or leave it None)"),
    ):
        if not is_integer(value):
            raise FairscaleTypeError(
                f"SlowMoDistributedDataParallel: {name} must be an integer, got {value!r} ({type(value).__name__}); "
                f"pass {meaning}"
            )
    if nprocs_per_node < 1:
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel: nprocs_per_node must be at least 1, got {nprocs_per_node}; "
            "pass the number of processes per node"
        )
    return int(nprocs_per_node)


def is_integer(value: Any) -> bool:
    """An integer of any integral type (numpy's too), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


def meta_sgp_error(module: nn.Module, algorithm: Any, nprocs_per_node: Any, world_size: Any) -> Optional[Exception]:
    """The error for SGP around a module with ``meta`` parameters, where SGP will gossip (more than one node).

    SGP copies the parameters into its gossip buffers at construction, and a ``meta`` tensor has no data (torch's
    ``NotImplementedError`` came after the gossip groups were created). LocalSGD reads the parameters when it
    averages, so it takes a ``meta`` model and its weights from ``load_state_dict(assign=True)`` later.
    """
    if algorithm != _SGP or not (is_integer(nprocs_per_node) and is_integer(world_size)) or nprocs_per_node < 1:
        return None  # not SGP, or sizes check_sizes refuses with its own message
    if world_size // nprocs_per_node < 2 or not any(p.is_meta for p in module.parameters()):
        return None  # one node gossips with no one
    return FairscaleValueError(
        "SlowMoDistributedDataParallel: SGP needs the module's parameters materialised when it is wrapped (its "
        "gossip buffers are copied from them), but they are on the meta device; load the weights into the module "
        "first (module.to_empty(device=...) then module.load_state_dict(...)) and wrap it afterwards, or use "
        "slowmo_base_algorithm=SlowMoBaseAlgorithm.LOCALSGD"
    )


def check_dense_embeddings(module: nn.Module) -> None:
    """Refuse embeddings with ``sparse=True`` (sparse gradients), checked where they would be averaged inside a node.

    The averaging flattens the gradients into one buffer per dtype, which a sparse gradient cannot join: torch's
    "reshape is not implemented for sparse tensors" came from the end of the first backward, naming no parameter.
    """
    sparse = sparse_gradient_layer(module, trainable_only=False)
    if sparse is not None:
        name, kind = sparse
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel: {f'module {name!r}' if name else 'the wrapped module'} "
            f"({kind} with sparse=True) gets sparse gradients, which SlowMo's gradient averaging inside a node "
            "(nprocs_per_node > 1) does not support; build it with sparse=False, or use nprocs_per_node=1"
        )


def graph_mismatch(
    graph: Any, mixing: Any, process_rank: Any, process_world_size: Any, nprocs_per_node: Any
) -> Optional[Exception]:
    """Why the SGP ``graph`` (or ``mixing``'s graph) was not built for this process, or ``None``.

    The gossip thread sends along the edges of ``graph.rank``: a graph of another rank (or world or node size) was
    accepted and the thread died at its first round, leaving both ranks to wait 300 s for "Gossip flag timeout".
    Returned rather than raised, so that every rank can raise (:func:`check_construction_agrees`): a rank raising
    alone left the others waiting in the next collective. On one node, or for values that are themselves wrong
    (checked elsewhere), ``None``.
    """
    if not all(is_integer(v) for v in (process_rank, process_world_size, nprocs_per_node)) or nprocs_per_node < 1:
        return None
    expected = (process_rank // nprocs_per_node, process_world_size // nprocs_per_node, nprocs_per_node)
    if expected[1] < 2:
        return None  # one node: SGP is off and no graph is used
    if graph is not None and not isinstance(graph, GraphManager):
        return FairscaleTypeError(
            f"SlowMoDistributedDataParallel: graph must be a GraphManager, got {type(graph).__name__}; pass a "
            "topology such as NPeerDynamicDirectedExponentialGraph, or None for that default"
        )
    if mixing is not None and not isinstance(mixing, MixingManager):
        return FairscaleTypeError(
            f"SlowMoDistributedDataParallel: mixing must be a MixingManager, got {type(mixing).__name__}; pass e.g. "
            "UniformMixing(graph, device), or None for that default"
        )
    for what, g in (("graph", graph), ("mixing's graph", getattr(mixing, "graph_manager", None))):
        if isinstance(g, GraphManager) and (g.rank, g.world_size, g.nprocs_per_node) != expected:
            return FairscaleValueError(
                f"SlowMoDistributedDataParallel: the {what} was built for rank {g.rank} of {g.world_size} nodes "
                f"with nprocs_per_node {g.nprocs_per_node}, but this process is node {expected[0]} of {expected[1]} "
                f"with nprocs_per_node {expected[2]}; build it on each process with rank=process_rank // "
                "nprocs_per_node, world_size=world size // nprocs_per_node and the same nprocs_per_node"
            )
    return None
