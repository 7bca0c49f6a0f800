# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What SlowMo communicates over the groups of :mod:`._groups`, besides SGP's gossip.

The module's buffers are broadcast from the group's first rank before each forward, the gradients averaged inside the node
after each backward, and on a LocalSGD (or exact SGP) average the parameters are averaged among the node masters,
which then broadcast them inside their node. Each call runs one collective per dtype (:func:`communicate` flattens
the tensors of one dtype into one buffer).
"""

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal.collectives import all_reduce, broadcast, group_ranks

from .utils.helpers import communicate

__all__ = ["average_gradients_in_node", "average_params_among_masters", "broadcast_from"]


def broadcast_from(tensors: Sequence[Tensor], src: int, group: Any) -> None:
    """Overwrite ``tensors`` with those of global rank ``src``, a member of ``group``."""
    with torch.no_grad():  # the flat buffers of parameters need no autograd history
        communicate(tensors, lambda tensor: broadcast(tensor, src=src, group=group))


def average_gradients_in_node(params: Iterable[Tensor], nprocs_per_node: int, group: Any) -> None:
    """Average the gradients of ``params`` over the ``nprocs_per_node`` ranks of the node's ``group``."""
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        for g in grads:
            g.div_(nprocs_per_node)
    communicate(grads, lambda tensor: all_reduce(tensor, group=group))


def average_params_among_masters(params: Sequence[Tensor], n_nodes: int, master_group: Any) -> None:
    """Average ``params`` over the ``n_nodes`` node masters; on the other ranks they are left divided by ``n_nodes``,
    to be overwritten by their master's broadcast (:func:`broadcast_from` over the node's group)."""
    with torch.no_grad():
        for p in params:
            p.div_(n_nodes)
    # Only node masters are members of the master group.
    if dist.get_rank() in group_ranks(master_group):
        communicate(params, lambda tensor: all_reduce(tensor, group=master_group))
