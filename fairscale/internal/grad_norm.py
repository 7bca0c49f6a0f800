# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The total gradient norm of a model whose gradients are split over ranks, with the ranks' arguments compared."""

import functools
import math
from typing import Any, Optional

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.agreement import check_gathered_agree
from fairscale.internal.errors import FairscaleRuntimeError

# The dtypes a norm may have, by code (sent as a float among the norm's parts).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UNKNOWN = -1  # a dtype not in the table
_NO_VOTE = -2  # a rank without gradients (its local norm is a plain fp32 zero)


def total_norm_across_ranks(
    local_norm: Tensor,
    max_norm: float,
    norm_type: float,
    group: Any,
    what: str,
    has_grads: bool = True,
    refusal: Optional[str] = None,
    refused_elsewhere: str = "{what}: rank(s) {ranks} of the group refused (see the error there); nothing was clipped",
) -> Tensor:
    """Combine each rank's ``norm_type``-norm of its own gradients into the norm of them all.

    One all-gather of five numbers per rank (the rank's part, ``norm_type``, ``max_norm``, its dtype, whether it
    refuses), in place of the all-reduce of the part alone: a rank with another ``norm_type`` would combine its part
    by another rule (or join a max with a sum), and one with another ``max_norm`` would clip its gradients by another
    factor, both silently; a rank that refused before the collective left the others waiting in it forever. The
    parts are combined in float64.

    Args:
        local_norm (Tensor): 0-dim, this rank's norm of its gradients.
        max_norm (float): the caller's clipping threshold (compared only).
        norm_type (float): the p of the p-norm, ``inf`` for the max norm.
        group (Optional[ProcessGroup]): the ranks whose gradients make up the model (``None``: the default group).
        what (str): the caller's name, for the error message.
        has_grads (bool): whether this rank measured any gradient; one that did not has no say in the dtype.
        refusal (Optional[str]): why this rank cannot clip, its error's message (``None``: it can).
        refused_elsewhere (str): the message of the other ranks when some refuse (``{what}`` and ``{ranks}``, the
            refusing ranks of ``group``, are filled in).

    Returns:
        Tensor: 0-dim, the total norm, on ``local_norm``'s device, in the dtype the ranks with gradients share, else
        in the dtype theirs promote to (fp16 and bf16: fp32): the same on every rank.

    Raises:
        RanksDisagreeError: the ranks passed different ``norm_type`` or ``max_norm`` (on every rank alike).
        FairscaleRuntimeError: a rank passed a ``refusal`` (on every rank: the refusing ones raise their message).
    """
    part = local_norm.detach().to(torch.float64)
    if not math.isinf(norm_type):
        part = part**norm_type
    # The dtype rides along: ranks whose gradients have other dtypes (OSS giving one rank the fp32 parameters and
    # another the bf16 ones) returned the norm in their own dtype, so they clipped by other factors (an fp16 rank got
    # inf above 65504 and zeroed its gradients) and a loop testing the norm stepped on some ranks only.
    if not has_grads:
        code = float(_NO_VOTE)
    else:
        code = float(_DTYPES.index(local_norm.dtype)) if local_norm.dtype in _DTYPES else float(_UNKNOWN)
    refuses = part.new_tensor(0.0 if refusal is None else 1.0)
    mine = torch.stack([part, part.new_tensor(norm_type), part.new_tensor(max_norm), part.new_tensor(code), refuses])
    size = collectives.group_size(group)
    gathered = mine.new_empty(size * 5)
    collectives.all_gather_into_flat(gathered, mine, group=group)
    rows = gathered.view(size, 5)
    named = [[("norm_type", norm), ("max_norm", limit)] for norm, limit in rows[:, 1:3].tolist()]
    check_gathered_agree(f"{what}: (norm_type, max_norm)", named, group)
    refusing = [rank for rank, flag in enumerate(rows[:, 4].tolist()) if flag]
    if refusing:
        raise FairscaleRuntimeError(refusal or refused_elsewhere.format(what=what, ranks=refusing))
    parts = rows[:, 0]
    total = parts.max() if math.isinf(norm_type) else parts.sum() ** (1.0 / norm_type)
    votes = {int(c) for c in rows[:, 3].tolist()} - {_NO_VOTE}
    if not votes or _UNKNOWN in votes:
        return total.to(local_norm.dtype)  # no gradient anywhere, or a dtype this table lacks: the rank's own
    return total.to(functools.reduce(torch.promote_types, [_DTYPES[c] for c in sorted(votes)]))
