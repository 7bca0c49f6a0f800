# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What SlowMo communicates over the groups of :mod:`._groups`, besides SGP's gossip.

The module's buffers are broadcast from the group's first rank before each forward, the gradients averaged inside the node
after each backward, and on a LocalSGD (or exact SGP) average the parameters are averaged among the node masters,
which then broadcast them inside their node. Each call runs one collective per dtype (:func:`communicate` flattens
the tensors of one dtype into one buffer).
"""

from typing import Any, Dict, Iterable, List, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal.collectives import all_reduce, broadcast, group_ranks
from fairscale.internal.errors import FairscaleRuntimeError

from .utils.helpers import communicate, unflatten_tensors

__all__ = ["average_gradients_in_node", "average_params_among_masters", "broadcast_from", "check_dense_gradients"]


def broadcast_from(tensors: Sequence[Tensor], src: int, group: Any) -> None:
    """Overwrite ``tensors`` with those of global rank ``src``, a member of ``group``."""
    with torch.no_grad():  # the flat buffers of parameters need no autograd history
        communicate(tensors, lambda tensor: broadcast(tensor, src=src, group=group))


def check_dense_gradients(named_params: Iterable[Tuple[str, Tensor]]) -> None:
    """Raise for a sparse gradient, naming its parameter: :func:`average_gradients_in_node` flattens the gradients
    into one buffer per dtype, which a sparse one cannot join (torch's "reshape is not implemented for sparse
    tensors" named no parameter). Every rank of the node has the same layout, so all of them raise."""
    for name, p in named_params:
        if p.grad is not None and p.grad.layout != torch.strided:
            raise FairscaleRuntimeError(
                f"SlowMoDistributedDataParallel: parameter {name!r} has a sparse gradient ({p.grad.layout}), which "
                "SlowMo's gradient averaging inside a node (nprocs_per_node > 1) does not support; make its "
                "module produce dense gradients (e.g. nn.Embedding(..., sparse=False)), or use nprocs_per_node=1"
            )


def average_gradients_in_node(params: Iterable[Tensor], nprocs_per_node: int, group: Any) -> None:
    """Average the gradients of ``params`` over the ``nprocs_per_node`` ranks of the node's ``group``.

    Every parameter that requires grad takes part, as torch DDP with ``find_unused_parameters=True`` does: a rank
    whose backward did not reach a parameter contributes zeros, and gets the average when another rank's backward
    reached it (the gradient stays ``None`` where no rank's did). Upstream reduced only the gradients present, so
    ranks whose backwards reached different parameters reduced buffers of different sizes (gloo aborted the process)
    or, with equal sizes, added one parameter's gradient to another's. Each flat buffer carries one presence flag
    per parameter; they are read back (a host sync) only on a rank that lacks a gradient.
    """
    by_dtype: Dict[torch.dtype, List[Tensor]] = {}
    for p in params:
        if p.requires_grad:
            # The gradient's dtype, the same on every rank (a parameter may keep gradients in another dtype than its
            # own: torch's grad_dtype, e.g. fp32 gradients of bf16 parameters, which must not be rounded to bf16).
            by_dtype.setdefault(getattr(p, "grad_dtype", None) or p.dtype, []).append(p)
    for dtype, group_params in by_dtype.items():
        all_present = all(p.grad is not None for p in group_params)
        with torch.no_grad():
            device = group_params[0].device
            grads = [p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype) for p in group_params]
            if all_present:  # the usual case: a fill, no host-to-device copy of the flags
                present = torch.ones(len(group_params), dtype=dtype, device=device)
            else:
                present = torch.tensor([p.grad is not None for p in group_params], dtype=dtype, device=device)
            flat = torch.cat([g.reshape(-1).to(dtype) for g in grads] + [present])
            flat[: flat.numel() - present.numel()].div_(nprocs_per_node)
        all_reduce(flat, group=group)
        with torch.no_grad():
            reduced = unflatten_tensors(flat, grads)
            if all_present:
                for p, r in zip(group_params, reduced):
                    cast(Tensor, p.grad).copy_(r)
                continue
            # A rank lacks some gradient: only the flags say whether another rank's backward reached it (compared
            # with 0 on the device: complex flags have no order).
            reached = (flat[flat.numel() - present.numel() :] != 0).tolist()
            for p, r, any_rank in zip(group_params, reduced, reached):
                if p.grad is not None:
                    p.grad.copy_(r)
                elif any_rank:
                    p.grad = r.clone()


def average_params_among_masters(params: Sequence[Tensor], n_nodes: int, master_group: Any) -> None:
    """Average ``params`` over the ``n_nodes`` node masters; on the other ranks they are left divided by ``n_nodes``,
    to be overwritten by their master's broadcast (:func:`broadcast_from` over the node's group)."""
    with torch.no_grad():
        for p in params:
            p.div_(n_nodes)
    # Only node masters are members of the master group.
    if dist.get_rank() in group_ranks(master_group):
        communicate(params, lambda tensor: all_reduce(tensor, group=master_group))
