# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What every rank's FSDP tree must share: each instance's parameter layout and the settings its collectives follow.

FSDP's all-gathers and reduce-scatters assume that every rank of a group holds the same padded flat parameters in
the same dtypes and issues the same collectives in the same order. A rank built with another hidden size, another
``flatten_parameters``, ``mixed_precision`` or ``fp32_reduce_scatter`` sends buffers of another size or dtype: gloo
aborts the whole process (SIGABRT, no Python exception), NCCL hangs or reads garbage. Settings that only change the
order or number of collectives (``reshard_after_forward``, the prefetch flags, ``bucket_cap_mb``) hang instead, or
reduce into the wrong buffer.

:func:`describe` turns one instance into a small tuple that travels in the root's first-forward agreement gather
(:func:`.zero2.check_same_setting`: no extra collective), and :func:`check_agree` names the first instance and field
that differ, with the same message on every rank.
"""

from typing import Any, Optional, Sequence, Tuple

from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError

from .unit import FSDPUnit

# At most this many characters of the difference go into the message (original shapes can be long lists).
_SHOWN_CHARS = 400

#: The config fields that decide the size, dtype, order or arithmetic of an instance's collectives.
_SETTINGS = (
    "flatten_parameters",
    "mixed_precision",
    "fp32_reduce_scatter",
    "compute_dtype",
    "reshard_after_forward",
    "disable_reshard_on_root",
    "bucket_cap_mb",
    "gradient_predivide_factor",
    "gradient_postdivide_factor",
    "forward_prefetch",
    "backward_prefetch",
)

#: One instance's description: ((setting name, value) pairs, (parameter name, shape, dtype, original shapes,
#: requires_grad) per flat parameter), or ``None`` for an instance whose collectives do not involve the gathering group.
#: ``requires_grad`` decides whether the parameter's gradient is reduce-scattered at all: a rank that froze a layer
#: alone would skip a reduce-scatter its peers issue.
Layout = Optional[
    Tuple[Tuple[Tuple[str, Any], ...], Tuple[Tuple[str, Tuple[int, ...], str, Tuple[Any, ...], bool], ...]]
]


def describe(unit: FSDPUnit, group_ranks: Sequence[int]) -> Layout:
    """The layout of ``unit`` as the ranks of the gathering group (global ranks ``group_ranks``) must share it.

    An instance sharded over one rank (upstream's MoE experts) or over a group other than the gathering one (and not
    hybrid) is ``None``: its parameters never meet the other ranks' in a collective of this group, so they may differ.
    An expert of a mixture-of-experts layer (an instance of one rank whose parameters the layer marked
    ``expert = True``) still shares the dtypes of what it computes: its inputs and outputs travel in all-to-alls, and an
    expert without the root's ``mixed_precision`` failed with a dtype error on its rank while the others waited in the
    next all-to-all until the timeout. Other instances of one rank (a rank-local module) may differ in that too.
    """
    c = unit.config
    if c.world_size == 1:
        if not any(getattr(h.param, "expert", False) for h in unit.handles):
            return None
        return (("mixed_precision", _plain(c.mixed_precision)), ("compute_dtype", _plain(c.compute_dtype))), ()
    if c.replicate_process_group is None and list(collectives.group_ranks(c.process_group)) != list(group_ranks):
        return None
    settings = tuple((name, _plain(getattr(c, name))) for name in _SETTINGS) + (
        ("compute_device", c.compute_device.type),
    )
    handles = tuple(
        (
            h.name,
            tuple(h.orig_size),
            str(h.param.dtype),
            tuple(tuple(s) for s in getattr(h.param, "_param_shapes", ())),
            bool(h.param.requires_grad),
        )
        for h in unit.handles
    )
    return settings, handles


def check_agree(paths: Sequence[str], views: Sequence[Sequence[Layout]], ranks: Sequence[int]) -> None:
    """Raise :class:`RanksDisagreeError` naming the first instance and field where a rank differs from the first.

    Args:
        paths: the instances' paths (the same on every rank: checked before this).
        views: every rank's layouts, in group order, one per path.
        ranks: the global ranks of the group, in group order.
    """
    first = views[0]
    for rank, view in zip(ranks[1:], views[1:]):
        for path, mine, theirs in zip(paths, first, view):
            if mine != theirs:
                what = _what_differs(mine, theirs)
                if len(what) > _SHOWN_CHARS:
                    what = what[: _SHOWN_CHARS - 3] + "..."
                raise RanksDisagreeError(
                    f"FullyShardedDataParallel: the instance at {path or '<root>'} differs between global rank "
                    f"{ranks[0]} and global rank {rank} ({what}); their all-gathers and "
                    "reduce-scatters would not match (gloo aborts the process, NCCL hangs). Build the same model, "
                    "freeze the same parameters and pass the same FullyShardedDataParallel arguments on every rank of "
                    "the group."
                )


def _what_differs(a: Layout, b: Layout) -> str:
    if a is None or b is None:
        return "sharded over this group on one rank only"
    for (name, x), (_, y) in zip(a[0], b[0]):
        if x != y:
            return f"{name}: {x} vs {y}"
    ha, hb = a[1], b[1]
    if len(ha) != len(hb):
        return f"{len(ha)} flat parameters vs {len(hb)}"
    for x, y in zip(ha, hb):
        if x != y:
            if x[:4] == y[:4]:
                return f"parameter {x[0]}: requires_grad {x[4]} vs {y[4]} (frozen on one rank only)"
            return (
                f"parameter {x[0]}: shape {x[1]} {x[2]} (original shapes {list(x[3])}) vs {y[0]}: shape {y[1]} {y[2]} "
                f"(original shapes {list(y[3])})"
            )
    return "the layouts differ"


def _plain(value: Any) -> Any:
    """A picklable value that compares equal across processes (dtypes and devices as their names)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
