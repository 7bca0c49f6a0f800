# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The total gradient norm of a model whose gradients are split over ranks, with the ranks' arguments compared."""

import math
from typing import Any

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.agreement import check_gathered_agree


def total_norm_across_ranks(local_norm: Tensor, max_norm: float, norm_type: float, group: Any, what: str) -> Tensor:
    """Combine each rank's ``norm_type``-norm of its own gradients into the norm of them all.

    One all-gather of three numbers per rank (the rank's part, ``norm_type``, ``max_norm``), in place of the
    all-reduce of the part alone: a rank with another ``norm_type`` would combine its part by another rule (or join
    a max with a sum), and one with another ``max_norm`` would clip its gradients by another factor, both silently.
    The parts are combined in float64.

    Args:
        local_norm (Tensor): 0-dim, this rank's norm of its gradients.
        max_norm (float): the caller's clipping threshold (compared only).
        norm_type (float): the p of the p-norm, ``inf`` for the max norm.
        group (Optional[ProcessGroup]): the ranks whose gradients make up the model (``None``: the default group).
        what (str): the caller's name, for the error message.

    Returns:
        Tensor: 0-dim, the total norm, in ``local_norm``'s dtype and on its device.

    Raises:
        RanksDisagreeError: the ranks passed different ``norm_type`` or ``max_norm`` (on every rank alike).
    """
    part = local_norm.detach().to(torch.float64)
    if not math.isinf(norm_type):
        part = part**norm_type
    mine = torch.stack([part, part.new_tensor(norm_type), part.new_tensor(max_norm)])
    size = collectives.group_size(group)
    gathered = mine.new_empty(size * 3)
    collectives.all_gather_into_flat(gathered, mine, group=group)
    rows = gathered.view(size, 3)
    named = [[("norm_type", norm), ("max_norm", limit)] for norm, limit in rows[:, 1:].tolist()]
    check_gathered_agree(f"{what}: (norm_type, max_norm)", named, group)
    parts = rows[:, 0]
    total = parts.max() if math.isinf(norm_type) else parts.sum() ** (1.0 / norm_type)
    return total.to(local_norm.dtype)
