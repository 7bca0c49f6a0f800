# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The constructor arguments of FullyShardedDataParallel after validation (:class:`FSDPConfig`), and the pure helpers
that resolve them, with upstream's defaults."""

import dataclasses
import logging
import math
import numbers
from typing import Any, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fairscale.internal.collectives import group_order
from fairscale.internal.device import default_compute_device
from fairscale.internal.parallel import ProcessGroupName, get_process_group_cached

from . import hybrid, zero2

# The public module's logger: users configure and filter FSDP's messages under the name they import it from.
log = logging.getLogger("fairscale.nn.data_parallel.fully_sharded_data_parallel")


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """What one FullyShardedDataParallel instance was asked to do, resolved and validated once at construction.

    Frozen: the runtime, the handles and the checkpoint code read it, and nothing changes it behind their back. The
    few values that legitimately change later (``compute_dtype`` after ``.half()``, the divide factors set by
    ``set_gradient_divide_factors``, upstream's MoE rule for ``no_broadcast_optim_state``) are changed by replacing
    the whole object (:meth:`replace`). Field meanings are those of the constructor arguments of the same names.
    """

    process_group: Any
    process_group_reduce_scatter: Any
    rank: int
    world_size: int
    reshard_after_forward: bool
    disable_reshard_on_root: bool
    mixed_precision: bool
    fp32_reduce_scatter: bool
    flatten_parameters: bool
    move_params_to_cpu: bool
    compute_dtype: torch.dtype
    buffer_dtype: torch.dtype
    buffer_dtype_given: bool
    move_grads_to_cpu: bool
    bucket_cap_mb: int
    compute_device: torch.device
    no_broadcast_optim_state: bool
    state_dict_device: torch.device
    clear_autocast_cache: bool
    force_input_to_fp32: bool
    verbose: bool
    state_dict_on_rank_0_only: bool
    gradient_predivide_factor: float
    gradient_postdivide_factor: float
    allow_reset_parameters: bool
    zero2_process_group: Any
    zero2_problem: Optional[str]
    zero2_rank: int
    zero2_size: int
    optimize_backward_concat: bool
    forward_prefetch: Optional[bool]  # None: auto (see prefetch.py)
    backward_prefetch: bool
    replicate_process_group: Any = None
    replicate_problem: Optional[str] = None
    replicate_rank: int = 0
    replicate_size: int = 1

    def replace(self, **changes: Any) -> "FSDPConfig":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def without_groups(self) -> "FSDPConfig":
        """A picklable copy: process groups cannot cross processes, so they become the string ``"MISSING"``."""
        groups = ("process_group", "process_group_reduce_scatter", "zero2_process_group", "replicate_process_group")
        return self.replace(**{k: "MISSING" for k in groups if getattr(self, k) is not None})


def make_config(
    params: Iterable[nn.Parameter],
    process_group: Any,
    process_group_reduce_scatter: Any,
    reshard_after_forward: bool,
    disable_reshard_on_root: bool,
    mixed_precision: bool,
    fp32_reduce_scatter: bool,
    flatten_parameters: bool,
    move_params_to_cpu: bool,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    move_grads_to_cpu: Optional[bool],
    bucket_cap_mb: int,
    compute_device: Optional[torch.device],
    no_broadcast_optim_state: Optional[bool],
    state_dict_device: Optional[torch.device],
    clear_autocast_cache: bool,
    force_input_to_fp32: bool,
    verbose: bool,
    state_dict_on_rank_0_only: bool,
    gradient_predivide_factor: Optional[float],
    allow_reset_parameters: bool,
    zero2_process_group: Any,
    optimize_backward_concat: bool,
    forward_prefetch: Optional[bool],
    backward_prefetch: bool,
    replicate_process_group: Any = None,
) -> FSDPConfig:
    """Validate the constructor arguments (``cpu_offload`` already folded into ``move_params_to_cpu``) and resolve
    their defaults against the parameters the instance will own.

    Raises:
        RuntimeError: no process group is given and ``torch.distributed`` is not initialised.
        ValueError: an argument, or a combination of arguments, that no training step could honour; the message
            says which and what to pass instead.
    """
    if process_group is None and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed to be initialized (e.g. "
            "dist.init_process_group('gloo') on CPU or 'nccl' on CUDA), or an explicit process_group."
        )
    if process_group is not None and not _is_group_like(process_group):
        raise TypeError(
            "FullyShardedDataParallel: process_group must be a torch.distributed ProcessGroup (e.g. from "
            f"dist.new_group(ranks)) or None for the default group, got {type(process_group).__name__}: "
            f"{process_group!r}"
        )
    for name, value, maker in (
        ("zero2_process_group", zero2_process_group, "zero2_groups(ranks_per_group)"),
        ("replicate_process_group", replicate_process_group, "hybrid_groups(shard_size)"),
    ):
        if value is not None and not _is_group_like(value):
            # Before: accepted here, then the first forward blamed an unpickled model (a string) or rank membership
            # (an int, a list of ranks).
            raise TypeError(
                f"FullyShardedDataParallel: {name} must be a torch.distributed ProcessGroup (e.g. from "
                f"fairscale.nn.data_parallel.{maker}) or None, got {type(value).__name__}: {value!r}"
            )
    validate_numbers(bucket_cap_mb, gradient_predivide_factor, buffer_dtype)
    group = process_group if process_group is not None else get_process_group_cached()
    check_group_membership(group, process_group_reduce_scatter)
    world_size = group.size()
    if fp32_reduce_scatter and not mixed_precision:
        raise ValueError("fp32_reduce_scatter=True needs mixed_precision=True (fp32 params already reduce in fp32)")
    resolved_dtype = resolve_compute_dtype(mixed_precision, compute_dtype)
    params = list(params)
    if any(p.device.type == "meta" for p in params):
        # Nothing to shard: the first forward would fail copying out of them ("Cannot copy out of meta tensor").
        raise ValueError(
            "FullyShardedDataParallel: the module has parameters on the meta device (built under "
            "torch.device('meta')?); materialise them before wrapping (module.to_empty(device=...), then initialise "
            "them, e.g. with reset_parameters() or a checkpoint)"
        )
    if compute_device is not None and torch.device(compute_device).type == "meta":
        raise ValueError("FullyShardedDataParallel: compute_device cannot be 'meta'; pass the device to compute on")
    device = resolve_compute_device(params, compute_device)
    grads_to_cpu = move_params_to_cpu if move_grads_to_cpu is None else move_grads_to_cpu
    validate_grad_placement(device, move_params_to_cpu, grads_to_cpu)
    validate_param_dtypes(params, mixed_precision, resolved_dtype)
    problem = zero2.local_problem(zero2_process_group, group)
    zero2_rank, zero2_size = zero2.rank_and_size(zero2_process_group, problem)
    if replicate_process_group is not None:
        hybrid.world_group()  # created now, in construction order on every rank (see hybrid.world_group)
        if process_group_reduce_scatter == ProcessGroupName.reduce_scatter:
            # Not used (see below), but an instance without a replicate group creates it here: a rank given no
            # replicate group by mistake then still makes the same new_group calls and reaches the first forward's
            # check, which raises, instead of waiting in new_group.
            get_process_group_cached(ProcessGroupName.reduce_scatter)
    replicate_problem = hybrid.local_problem(replicate_process_group, group)
    replicate_rank, replicate_size = hybrid.rank_and_size(replicate_process_group, replicate_problem)
    if replicate_process_group is not None and process_group_reduce_scatter == ProcessGroupName.reduce_scatter:
        # The default name means "a group like process_group"; the cached one spans the whole world, which is not
        # the shard group here (it would only fall back with a warning).
        process_group_reduce_scatter = ProcessGroupName.default
    # Gradients are averaged over every rank: summed by the reduce-scatter inside the shard group, then by the
    # all-reduce across the replicate group.
    pre, post = divide_factors(world_size * replicate_size, gradient_predivide_factor)
    return FSDPConfig(
        process_group=group,
        process_group_reduce_scatter=resolve_reduce_scatter_group(process_group_reduce_scatter, group),
        rank=group.rank(),
        world_size=world_size,
        reshard_after_forward=reshard_after_forward,
        disable_reshard_on_root=disable_reshard_on_root,
        mixed_precision=mixed_precision,
        fp32_reduce_scatter=fp32_reduce_scatter,
        flatten_parameters=flatten_parameters,
        move_params_to_cpu=move_params_to_cpu,
        compute_dtype=resolved_dtype,
        buffer_dtype=buffer_dtype or resolved_dtype,
        buffer_dtype_given=buffer_dtype is not None,
        move_grads_to_cpu=grads_to_cpu,
        bucket_cap_mb=bucket_cap_mb,
        compute_device=device,
        no_broadcast_optim_state=bool(no_broadcast_optim_state),
        state_dict_device=torch.device(state_dict_device) if state_dict_device else device,
        clear_autocast_cache=clear_autocast_cache,
        force_input_to_fp32=force_input_to_fp32,
        verbose=verbose,
        state_dict_on_rank_0_only=state_dict_on_rank_0_only,
        gradient_predivide_factor=pre,
        gradient_postdivide_factor=post,
        allow_reset_parameters=allow_reset_parameters,
        zero2_process_group=zero2_process_group,
        zero2_problem=problem,
        zero2_rank=zero2_rank,
        zero2_size=zero2_size,
        optimize_backward_concat=optimize_backward_concat,
        forward_prefetch=None if forward_prefetch is None else bool(forward_prefetch),
        backward_prefetch=bool(backward_prefetch),
        replicate_process_group=replicate_process_group,
        replicate_problem=replicate_problem,
        replicate_rank=replicate_rank,
        replicate_size=replicate_size,
    )


def _is_group_like(value: Any) -> bool:
    """A ProcessGroup, what ``dist.new_group`` returns outside its ranks (the membership check names that), or what
    upstream's tests pass for one (an object with ``rank()`` and ``size()``)."""
    if isinstance(value, int) and value == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        return True
    return isinstance(value, dist.ProcessGroup) or (
        callable(getattr(value, "rank", None)) and callable(getattr(value, "size", None))
    )


def validate_numbers(bucket_cap_mb: Any, predivide: Optional[float], buffer_dtype: Optional[torch.dtype]) -> None:
    """Raise ``ValueError`` for settings no step could honour (a NaN bucket size compares unequal to itself, so the
    first forward's check reported ranks that "disagree"; a zero pre-divide factor divided by zero)."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real) or math.isnan(bucket_cap_mb):
        raise ValueError(
            "FullyShardedDataParallel: bucket_cap_mb must be a number of MiB (<= 0 reduces each gradient on its "
            f"own), got {bucket_cap_mb!r}"
        )
    if predivide is not None and not (isinstance(predivide, numbers.Real) and 0 < predivide < float("inf")):
        raise ValueError(
            "FullyShardedDataParallel: gradient_predivide_factor must be a positive finite number (None: upstream's "
            f"default for the world size), got {predivide!r}"
        )
    if buffer_dtype is not None and not (isinstance(buffer_dtype, torch.dtype) and buffer_dtype.is_floating_point):
        raise ValueError(
            "FullyShardedDataParallel: buffer_dtype must be a floating-point torch.dtype (floating buffers are cast "
            f"to it; integer buffers keep theirs), got {buffer_dtype!r}"
        )


def resolve_reduce_scatter_group(value: Any, process_group: Any) -> Any:
    """The group gradients are reduce-scattered over (see the ``process_group_reduce_scatter`` argument)."""
    if value == ProcessGroupName.default or value is None:
        return process_group
    if value == ProcessGroupName.reduce_scatter:
        if not isinstance(process_group, dist.ProcessGroup):
            # A stand-in group (DummyProcessGroup: fairseq and metaseq on one process, without torch.distributed)
            # has no communicator to duplicate. Upstream asked torch.distributed for one and raised, except when
            # pytest was imported (so its tests passed, and fairseq's one-process FSDP failed).
            return process_group
        group = get_process_group_cached(ProcessGroupName.reduce_scatter)
        if group is None:
            return process_group
    elif isinstance(value, dist.ProcessGroup) or (hasattr(value, "rank") and not hasattr(value, "allgather")):
        group = value
    else:
        raise TypeError(
            f"process_group_reduce_scatter must be a ProcessGroupName or a ProcessGroup, got {type(value)!r}"
        )
    if group.size() != process_group.size():
        # Said only for a group the user passed: the default is the world's, and an instance on a subgroup (tensor
        # parallelism's data-parallel group, an expert's group of one) warned on every rank for an argument it never
        # set.
        if value != ProcessGroupName.reduce_scatter:
            log.warning(
                "process_group_reduce_scatter has %d ranks but process_group has %d; using process_group for the "
                "reduce-scatter",
                group.size(),
                process_group.size(),
            )
        return process_group
    if isinstance(group, dist.ProcessGroup) and isinstance(process_group, dist.ProcessGroup):
        ours, theirs = group_order(group), group_order(process_group)
        if ours != theirs:
            if value == ProcessGroupName.reduce_scatter:
                return process_group  # the world's, for a process_group of the world's ranks in another order
            # Each rank reduce-scatters into the shard it owns in process_group: over other ranks (a replicate group
            # of a hybrid layout, of the right size) the gradients were averaged over the wrong ranks, silently.
            raise ValueError(
                f"process_group_reduce_scatter holds the ranks {list(ours)} (in the order of their rank in it) but "
                f"process_group holds {list(theirs)}: gradients are reduce-scattered into the shards process_group "
                "gives each rank, so both groups must hold the same ranks in the same order. Pass a group made with "
                "process_group's ranks, ProcessGroupName.reduce_scatter, or ProcessGroupName.default"
            )
    return group


def default_gradient_predivide_factor(world_size: int) -> float:
    """Upstream's default pre-divide factor: the largest power of two ``f`` with ``f * f <= world_size``-ish.

    Starting at 1, keep doubling while ``world_size % f == 0`` and ``world_size / f > f``. Dividing half before and
    half after the reduction keeps fp16 gradients away from both overflow and underflow.

    Args:
        world_size: number of ranks the gradient is averaged over.

    Returns:
        The factor gradients are divided by before the reduce-scatter.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def divide_factors(world_size: int, predivide: Optional[float]) -> Tuple[float, float]:
    """(pre, post) divide factors; their product is ``world_size``."""
    pre = default_gradient_predivide_factor(world_size) if predivide is None else float(predivide)
    return pre, world_size / pre


def resolve_compute_device(params: Iterable[nn.Parameter], compute_device: Optional[torch.device]) -> torch.device:
    """The fork's rule: explicit value, else the params' accelerator, else the current accelerator, else CPU."""
    if compute_device is not None:
        return torch.device(compute_device)
    first = next(iter(params), None)
    return default_compute_device(first.device if first is not None else None)


def resolve_compute_dtype(mixed_precision: bool, compute_dtype: Optional[torch.dtype]) -> torch.dtype:
    """``compute_dtype``, else fp16 with mixed precision, else fp32. Rejects what no forward could run in.

    Raises:
        ValueError: ``compute_dtype`` is not a floating-point ``torch.dtype`` (at construction, rather than as an
            unrelated error deep in the first forward).
    """
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(
                f"compute_dtype must be a floating-point torch.dtype (torch.float32, torch.float16 or "
                f"torch.bfloat16), got {compute_dtype!r}"
            )
        return compute_dtype
    return torch.float16 if mixed_precision else torch.float32


def validate_param_dtypes(params: Iterable[nn.Parameter], mixed_precision: bool, compute_dtype: torch.dtype) -> None:
    """Upstream's rule: pure fp16 needs fp16 params; every other mode needs fp32 params."""
    pure_fp16 = compute_dtype == torch.float16 and not mixed_precision
    expected = torch.float16 if pure_fp16 else torch.float32
    for p in params:
        if p.dtype.is_complex:  # model.float() keeps them complex: the advice below would not help
            raise ValueError(
                f"FullyShardedDataParallel: found a {p.dtype} parameter of shape {tuple(p.shape)}: complex parameters "
                "are not supported (as upstream). Keep its real and imaginary parts as a real parameter "
                "(torch.view_as_real(w), and torch.view_as_complex in forward), or hold it in a buffer if it is "
                "not trained"
            )
        if p.dtype != expected:
            if pure_fp16:
                hint = "compute_dtype=torch.float16 without mixed_precision ('pure fp16') needs fp16 parameters"
            else:
                # Name the ways that work (a fuzz of client code found the old hint advising what the caller did).
                hint = (
                    "parameters must be fp32 at wrapping in this mode (upstream's rule). Call model.float() before "
                    "wrapping: mixed_precision=True keeps fp32 master weights and computes in compute_dtype; for fp16 "
                    "parameters use 'pure fp16' (compute_dtype=torch.float16, mixed_precision=False); for other "
                    "dtypes (.double(), .bfloat16()) wrap the fp32 model and convert it afterwards (fsdp.double())"
                )
            raise ValueError(f"FullyShardedDataParallel: found a {p.dtype} parameter of shape {tuple(p.shape)}: {hint}")


def validate_grad_placement(compute_device: torch.device, move_params_to_cpu: bool, move_grads_to_cpu: bool) -> None:
    """A gradient must live on its parameter's device: reject flag pairs that would put them apart.

    On a CPU compute device both always live on the CPU, so any pair works there.
    """
    if compute_device.type == "cpu" or move_params_to_cpu == move_grads_to_cpu:
        return
    if move_grads_to_cpu:
        raise ValueError(
            f"move_grads_to_cpu=True needs move_params_to_cpu=True when computing on {compute_device}: the fp32 "
            "shards (and so the optimizer) live on the compute device and a CPU gradient cannot be assigned to them. "
            "Pass move_params_to_cpu=True to offload both, or leave move_grads_to_cpu unset."
        )
    raise ValueError(
        f"move_params_to_cpu=True with move_grads_to_cpu=False is not supported when computing on {compute_device}: "
        "the fp32 shards live on the CPU, so their gradients must too. Leave move_grads_to_cpu unset (it follows "
        "move_params_to_cpu)."
    )


def _is_member(group: Any) -> bool:
    if group is None or isinstance(group, ProcessGroupName) or isinstance(group, str):
        return True  # a name: FSDP creates (or reuses) a group over all ranks
    if group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    ):
        return False
    rank = getattr(group, "rank", None)
    return not callable(rank) or int(rank()) >= 0


def check_group_membership(process_group: Any, process_group_reduce_scatter: Any) -> None:
    """Raise a clear ``ValueError`` when this rank is not a member of a group it was given.

    ``dist.new_group(ranks)`` returns ``GroupMember.NON_GROUP_MEMBER`` on the ranks outside ``ranks``; an FSDP
    instance cannot shard over a group it is not in. Before raising, the rank makes the same group-creation calls
    as a member would at construction (the cached reduce-scatter group): ``new_group`` is collective over the
    whole world, so skipping it here would leave the member ranks blocked in it instead of going on.
    """
    bad = [
        (arg, group)
        for arg, group in (
            ("process_group", process_group),
            ("process_group_reduce_scatter", process_group_reduce_scatter),
        )
        if not _is_member(group)
    ]
    if not bad:
        return
    if process_group_reduce_scatter == ProcessGroupName.reduce_scatter:
        get_process_group_cached(ProcessGroupName.reduce_scatter)
    arg, group = bad[0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise ValueError(
        f"FullyShardedDataParallel: global rank {rank} is not a member of the {arg} it was given ({group!r}, "
        "which dist.new_group(ranks) returns on ranks outside `ranks`). Construct this FSDP instance only on the "
        f"ranks of its group, or pass a {arg} that contains rank {rank}."
    )
