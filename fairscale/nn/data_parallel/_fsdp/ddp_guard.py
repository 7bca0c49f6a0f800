# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Refuse being wrapped by torch's ``DistributedDataParallel``.

An FSDP instance already reduces its gradients over its process group, and its parameters are this rank's shards.
Torch DDP around it would broadcast rank 0's shards over every other rank's at construction (each rank's part of
the model replaced by rank 0's) and then all-reduce shard gradients that belong to different parts of the model:
training goes on and silently learns nothing useful (upstream behaved the same). transformers 4.30-4.34's Trainer does
this with ``--sharded_ddp zero_dp_2``/``zero_dp_3`` (its accelerate ``prepare`` wraps the FSDP model in DDP).

DDP's constructor reads ``module._ddp_params_and_buffers_to_ignore`` when the module has it (``hasattr``), and nothing
else in torch does: a descriptor under that name on FSDP is where the wrapping can be refused, before DDP sends
anything, on every rank alike. DDP only reads it on the module it is given: DDP around a plain module that holds FSDP
instances is caught later, by :func:`refuse_enclosing_ddp` at the root's forward (DDP's constructor has broadcast by
then, so the error says to rebuild or reload the model). DDP that syncs FSDP parameters trains wrong whatever its
group: with its ranks each holding another shard index (DDP across nodes around FSDP within a node) the weights ended
0.03 off plain DDP's after 3 steps, and with a group of one rank 0.05 off (its hooks reduce and rewrite the gradients
that FSDP reduces itself). Only DDP told to leave the FSDP parameters alone (``_ddp_params_and_buffers_to_ignore`` on
the outer module, torch's hook for that) is correct.
"""

import weakref
from typing import TYPE_CHECKING, Any, NoReturn, Optional, Set

from torch.nn.parallel import DistributedDataParallel

from fairscale.internal.errors import FairscaleTypeError

if TYPE_CHECKING:
    from .unit import FSDPUnit

__all__ = ["RefuseTorchDDP", "refuse_enclosing_ddp"]

# DDP instances whose forward already ran the check for a tree (by the tree root's id): the check costs a pass over
# DDP's parameters, once per pair instead of once per step.
_CHECKED: "weakref.WeakKeyDictionary[Any, Set[int]]" = weakref.WeakKeyDictionary()


class RefuseTorchDDP:
    """A data descriptor whose read and write raise: torch DDP reads it when given an FSDP instance."""

    def __get__(self, obj: Optional[Any], owner: Optional[type] = None) -> Any:
        if obj is None:
            return self  # class access (documentation tools, mock.patch.object) finds the descriptor itself
        _refuse()

    def __set__(self, obj: Any, value: Any) -> NoReturn:
        # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(fsdp, ...) writes it.
        _refuse()


def _refuse() -> NoReturn:
    raise FairscaleTypeError(
        "torch.nn.parallel.DistributedDataParallel cannot wrap a FullyShardedDataParallel instance: FSDP already "
        "reduces the gradients over its process group, and DDP would overwrite every rank's parameter shards with "
        "rank 0's and mix the gradients of different shards. Train the FSDP instance directly, without DDP around "
        "it. (transformers 4.30-4.34's Trainer does this with --sharded_ddp zero_dp_2/zero_dp_3: use "
        "--sharded_ddp simple, or transformers <= 4.29.)"
    )


def refuse_enclosing_ddp(root: "FSDPUnit") -> None:
    """At a root's forward: raise if torch DDP, running its forward around this tree, syncs FSDP parameters.

    torch (2.0 and newer) records the DDP whose forward is running in ``DistributedDataParallel._active_ddp_module``.
    Same answer on every rank (it depends on the module only), so every rank raises alike.
    """
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None:
        return
    done = _CHECKED.setdefault(ddp, set())
    if id(root) in done:
        return
    synced = getattr(ddp, "_module_parameters", None)
    if synced is None:  # not in every torch release: the same list, from what DDP keeps
        ignored: Set[str] = getattr(ddp, "parameters_to_ignore", set())
        synced = [p for n, p in ddp.module.named_parameters() if n not in ignored]
    synced_ids = {id(p) for p in synced}
    if any(id(p) in synced_ids for unit in root.tree_units() for p in unit.params):
        raise FairscaleTypeError(
            "torch.nn.parallel.DistributedDataParallel wraps a module that holds FullyShardedDataParallel instances "
            "and syncs their parameters: DDP's constructor has already overwritten every rank's shards with rank 0's, "
            "and its backward hooks reduce and rewrite the gradients that FSDP reduces itself (wrong even in a group "
            "of one rank). Rebuild or reload the model and train it without DDP around the FSDP instances (for "
            "sharding within a node and replication across nodes, use FSDP's hybrid sharding), or name the FSDP "
            "parameters in the outer module's _ddp_params_and_buffers_to_ignore so that DDP leaves them to FSDP."
        )
    done.add(id(root))
