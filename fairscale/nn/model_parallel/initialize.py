# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Process groups of model (tensor), pipeline and data parallelism, and their getters.

The ranks of the world are laid out on a grid of shape ``(data, pipeline, model)`` in row-major
order: global rank ``r = i * pp * mp + j * mp + k`` for data-parallel index ``i``, pipeline stage
``j`` and model-parallel rank ``k``. Model-parallel groups are therefore contiguous blocks of
``mp`` ranks, pipeline groups have stride ``mp`` and data-parallel groups stride ``pp * mp``.

``torch.distributed`` is looked up at call time (``torch.distributed.new_group`` and so on, never
an alias bound at import) so that tests can replace it, as upstream's ``test_adjacency`` does.
"""

import numbers
from typing import Any, List, Optional

import torch
import torch.distributed

from fairscale.internal import collectives
from fairscale.internal.agreement import check_world_agrees_through_store
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.parallel import default_group_timeout

# Upstream's module namespace has it (importers may reach it here); the grid check below says more on failure.
from .utils import ensure_divisibility  # noqa: F401

# torch's own module, bound at import: the one whose groups take a timeout (see _new_group).
_REAL_DISTRIBUTED = torch.distributed

__all__ = [
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "get_model_parallel_group",
    "get_data_parallel_group",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_ranks",
    "get_model_parallel_world_size",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "destroy_model_parallel",
]

# The groups this rank belongs to; None until initialize_model_parallel() ran.
_MODEL_PARALLEL_GROUP: Optional[Any] = None
_DATA_PARALLEL_GROUP: Optional[Any] = None
_PIPELINE_PARALLEL_GROUP: Optional[Any] = None
_PIPELINE_PARALLEL_RANKS: Optional[List[int]] = None


# How many times initialize_model_parallel() has succeeded in this process: layers record it when built, and check
# their partition again when it changed (see layers._check_until_done).
_GENERATION = 0


def _whole_number_at_least_one(value: Any) -> bool:
    """An integer (numpy's too), or an integral float (2.0, as upstream took for the model-parallel size), >= 1."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and float(value).is_integer()
        and float(value) >= 1
    )


def _check_grid(world_size: int, model_parallel_size: int, pipeline_length: int) -> None:
    if model_parallel_size < 1 or pipeline_length < 1:
        raise ValueError(
            f"model_parallel_size_ ({model_parallel_size}) and pipeline_length ({pipeline_length}) must be >= 1"
        )
    checks = [("model_parallel_size_", model_parallel_size)]
    checks.append(("model_parallel_size_ * pipeline_length", model_parallel_size * pipeline_length))
    for what, size in checks:
        if world_size % size != 0:
            # An AssertionError and the leading text as upstream's (ensure_divisibility); the rest says what to do.
            raise FairscaleValueError(
                f"{world_size} is not divisible by {size}: the world size must be a multiple of {what} "
                f"(= {size}); choose sizes whose product divides the world size {world_size}"
            )


def initialize_model_parallel(
    model_parallel_size_: int,
    pipeline_length: int = 1,
    *,
    model_parallel_backend: Optional[str] = None,
    pipeline_backend: Optional[str] = None,
    ddp_backend: Optional[str] = None,
) -> None:
    """Create the model-, pipeline- and data-parallel groups and remember the ones of this rank.

    Every rank of the default group must call this with the same arguments (creating a group is a
    collective). With 8 ranks, ``model_parallel_size_=2`` and ``pipeline_length=2``: model-parallel
    groups ``[0, 1], [2, 3], [4, 5], [6, 7]``, pipeline groups ``[0, 2], [1, 3], [4, 6], [5, 7]``,
    data-parallel groups ``[0, 4], [1, 5], [2, 6], [3, 7]``.

    Args:
        model_parallel_size_ (int): ranks per model-parallel group; clamped to the world size.
        pipeline_length (int): pipeline stages per pipeline group (not clamped).
        model_parallel_backend (Optional[str]): backend of the model-parallel groups (default: the
            default group's).
        pipeline_backend (Optional[str]): backend of the pipeline groups.
        ddp_backend (Optional[str]): backend of the data-parallel groups.

    Raises:
        FairscaleRuntimeError: ``torch.distributed`` is not initialised, or the groups already exist (call
            :func:`destroy_model_parallel` first); an ``AssertionError`` as upstream. Also when another rank does
            not make this call within ``init_process_group``'s timeout.
        RanksDisagreeError: the ranks passed other arguments, or only some of them hold groups (on every rank).
        AssertionError: the world size is not divisible by the model-parallel size times ``pipeline_length``.
    """
    if not torch.distributed.is_initialized():
        raise FairscaleRuntimeError(
            "torch.distributed must be initialized before initialize_model_parallel: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    world_size = torch.distributed.get_world_size()
    size = model_parallel_size_
    valid = _whole_number_at_least_one(size)
    # Clamped: 4 and 8 on two ranks are the same request.
    model_parallel_size = int(min(model_parallel_size_, world_size)) if valid else 0
    # Before any group exists, and before the rank-local checks below (a rank that raised alone would leave the
    # others waiting): ranks that asked for other sizes or backends, or of which only some already hold groups, would
    # create other groups, and new_group() would wait for the missing ranks forever (its store wait does not end at
    # the group timeout). The same RanksDisagreeError on every rank instead. Through the rendezvous store, not an
    # object gather: on an NCCL group that gather would run on the current CUDA device, and callers such as Llama's
    # reference code select their device only after this call (every rank would use cuda:0).
    stages = pipeline_length
    stages_valid = _whole_number_at_least_one(stages)
    _check_ranks_agree(
        model_parallel_size if valid else repr(model_parallel_size_),
        int(stages) if stages_valid else repr(stages),
        model_parallel_backend,
        pipeline_backend,
        ddp_backend,
    )
    if not valid:
        # A fraction was truncated silently (1.5 gave 1); an integral float (2.0) stays accepted, as upstream.
        raise FairscaleValueError(
            f"initialize_model_parallel: model_parallel_size_ must be a whole number >= 1, got {model_parallel_size_!r}"
        )
    if not stages_valid:
        # A float failed in a reshape, a string in a comparison, with Python's words (upstream the same).
        raise FairscaleValueError(
            f"initialize_model_parallel: pipeline_length must be a whole number >= 1, got {pipeline_length!r}"
        )
    pipeline_length = int(pipeline_length)  # an integral float (2.0) is taken, as model_parallel_size_ is
    _check_grid(world_size, model_parallel_size, pipeline_length)
    _check_backends_available(model_parallel_backend, pipeline_backend, ddp_backend)
    rank = torch.distributed.get_rank()
    data_parallel_size = world_size // (model_parallel_size * pipeline_length)
    if rank == 0:
        # Upstream prints the requested size, not the clamped one.
        print("> initializing model parallel with size {}".format(model_parallel_size_))
        print("> initializing ddp with size {}".format(data_parallel_size))
        print("> initializing pipeline with size {}".format(pipeline_length))

    grid = _Grid(data_parallel_size, pipeline_length, model_parallel_size)
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _PIPELINE_PARALLEL_GROUP, _PIPELINE_PARALLEL_RANKS, _GENERATION
    # All checked before any group is made (upstream's wording for both pipeline checks).
    _check_not_initialized(_DATA_PARALLEL_GROUP, "data parallel group is already initialized")
    _check_not_initialized(_MODEL_PARALLEL_GROUP, "model parallel group is already initialized")
    _check_not_initialized(_PIPELINE_PARALLEL_GROUP, "model parallel group is already initialized")
    _check_not_initialized(_PIPELINE_PARALLEL_RANKS, "model parallel group is already initialized")
    try:
        # new_group() is collective: every rank creates every group, in the same order (data, model, pipeline).
        for ranks in grid.data_parallel_groups():
            group = _new_group(ranks, ddp_backend)
            if rank in ranks:
                _DATA_PARALLEL_GROUP = group
        for ranks in grid.model_parallel_groups():
            group = _new_group(ranks, model_parallel_backend)
            if rank in ranks:
                _MODEL_PARALLEL_GROUP = group
        for ranks in grid.pipeline_groups():
            group = _new_group(ranks, pipeline_backend)
            if rank in ranks:
                _PIPELINE_PARALLEL_GROUP = group
                _PIPELINE_PARALLEL_RANKS = ranks
    except BaseException:
        # A backend that cannot make groups (nccl without CUDA, a misspelt name) failed after the data-parallel group
        # was set: a retry then said "already initialized" while model_parallel_is_initialized() said False.
        destroy_model_parallel()
        raise
    _GENERATION += 1


def _check_backends_available(*backends: Optional[str]) -> None:
    """Refuse a backend that cannot make groups before any group is made.

    torch's ``new_group`` fails on each rank at the first group that rank belongs to, after the ranks outside it
    have counted it: the ranks' group counters then differ and every later ``new_group`` (a retry included) waits
    for a group the others never make.
    """
    available = getattr(torch.distributed, "is_backend_available", None)
    if available is None:  # torch < 2.1 cannot say; new_group will
        return
    for backend in backends:
        if backend is not None and not available(str(backend)):
            raise FairscaleValueError(
                f"initialize_model_parallel: the backend {backend!r} is not available in this torch build (nccl "
                "needs CUDA; registered third-party backends must be imported first); pass 'gloo', 'nccl' or None "
                "(the default group's)"
            )


def _new_group(ranks: List[int], backend: Optional[str]) -> Any:
    """``torch.distributed.new_group(ranks, backend)`` with the default group's timeout (the ``timeout`` given to
    ``init_process_group``): alone it takes the backend's default (30 minutes for gloo), so a rank that skipped a
    collective of these groups kept the others waiting that long, whatever the user set (found by a fuzz)."""
    # Only for torch's own module: a stand-in that tests put in its place (as upstream's do) takes no timeout.
    timeout = default_group_timeout() if torch.distributed is _REAL_DISTRIBUTED else None
    if timeout is None:
        return torch.distributed.new_group(ranks, backend=backend)
    return torch.distributed.new_group(ranks, backend=backend, timeout=timeout)


def _check_ranks_agree(
    mp: Any, pp: Any, mp_backend: Optional[str], pp_backend: Optional[str], dp: Optional[str]
) -> None:
    """The same ``RanksDisagreeError`` on every rank unless all of them passed these arguments and hold no groups
    yet, or all of them hold groups (then the rank-local "already initialized" error follows on every rank)."""
    check_world_agrees_through_store(
        "initialize_model_parallel: (model parallel size as clamped, pipeline_length, model_parallel_backend, "
        "pipeline_backend, ddp_backend, groups already initialized)",
        [mp, pp, mp_backend, pp_backend, dp, model_parallel_is_initialized()],
        hint="Call it once on every rank with the same arguments (destroy_model_parallel() on every rank first to "
        "start again).",
    )


class _Grid:
    """The ``(data, pipeline, model)`` rank grid; each method lists groups in creation order."""

    def __init__(self, dp: int, pp: int, mp: int) -> None:
        self.dp, self.pp, self.mp = dp, pp, mp

    def _rank(self, i: int, j: int, k: int) -> int:
        return i * self.pp * self.mp + j * self.mp + k

    def data_parallel_groups(self) -> List[List[int]]:
        return [[self._rank(i, j, k) for i in range(self.dp)] for j in range(self.pp) for k in range(self.mp)]

    def model_parallel_groups(self) -> List[List[int]]:
        return [[self._rank(i, j, k) for k in range(self.mp)] for i in range(self.dp) for j in range(self.pp)]

    def pipeline_groups(self) -> List[List[int]]:
        return [[self._rank(i, j, k) for j in range(self.pp)] for i in range(self.dp) for k in range(self.mp)]


def _check_not_initialized(current: Any, message: str) -> None:
    if current is not None:
        raise FairscaleRuntimeError(
            f"{message}: call fairscale.nn.model_parallel.destroy_model_parallel() before initializing again"
        )


def _initialized(group: Optional[Any], message: str) -> Any:
    """``group``, or the error upstream asserted with (kept under ``python -O``) plus what to do.

    Without it, ``torch.distributed`` would take the missing group for the default one, and layers built before
    :func:`initialize_model_parallel` would silently shard their weights over the whole world.
    """
    if group is None:
        raise FairscaleRuntimeError(
            f"{message}: call fairscale.nn.model_parallel.initialize_model_parallel(model_parallel_size) on every "
            "rank (after torch.distributed.init_process_group) before building model-parallel layers or asking "
            "for the groups"
        )
    return group


def model_parallel_is_initialized() -> bool:
    """Whether the model-, data- and pipeline-parallel groups of this rank exist."""
    return not (_MODEL_PARALLEL_GROUP is None or _DATA_PARALLEL_GROUP is None or _PIPELINE_PARALLEL_GROUP is None)


def get_model_parallel_group() -> Any:
    """The model-parallel group of this rank (raises an ``AssertionError`` subclass before initialisation)."""
    return _initialized(_MODEL_PARALLEL_GROUP, "model parallel group is not initialized")


def get_data_parallel_group() -> Any:
    """The data-parallel group of this rank (raises an ``AssertionError`` subclass before initialisation)."""
    return _initialized(_DATA_PARALLEL_GROUP, "data parallel group is not initialized")


def get_pipeline_parallel_group() -> Any:
    """The pipeline group of this rank (raises an ``AssertionError`` subclass before initialisation)."""
    return _initialized(_PIPELINE_PARALLEL_GROUP, "pipeline parallel group is not initialized")


def get_pipeline_parallel_ranks() -> List[int]:
    """The global ranks of this rank's pipeline group, in stage order."""
    ranks: List[int] = _initialized(_PIPELINE_PARALLEL_RANKS, "pipeline parallel group is not initialized")
    return ranks


def get_model_parallel_world_size() -> int:
    """Number of ranks in this rank's model-parallel group."""
    return int(torch.distributed.get_world_size(group=get_model_parallel_group()))


def get_model_parallel_rank() -> int:
    """This rank's index inside its model-parallel group."""
    return int(torch.distributed.get_rank(group=get_model_parallel_group()))


def get_model_parallel_src_rank() -> int:
    """The global rank of model-parallel rank 0 of this rank's group (groups are contiguous blocks)."""
    global_rank = torch.distributed.get_rank()
    local_world_size = get_model_parallel_world_size()
    return int((global_rank // local_world_size) * local_world_size)


def get_data_parallel_world_size() -> int:
    """Number of ranks in this rank's data-parallel group."""
    return int(torch.distributed.get_world_size(group=get_data_parallel_group()))


def get_data_parallel_rank() -> int:
    """This rank's index inside its data-parallel group."""
    return int(torch.distributed.get_rank(group=get_data_parallel_group()))


def destroy_model_parallel() -> None:
    """Forget the groups so :func:`initialize_model_parallel` can run again (the groups stay alive)."""
    global _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _PIPELINE_PARALLEL_GROUP, _PIPELINE_PARALLEL_RANKS
    _MODEL_PARALLEL_GROUP = None
    _DATA_PARALLEL_GROUP = None
    _PIPELINE_PARALLEL_GROUP = None
    _PIPELINE_PARALLEL_RANKS = None
