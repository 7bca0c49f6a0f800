# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Refuse being wrapped by torch's ``DistributedDataParallel``.

An FSDP instance already reduces its gradients over its process group, and its parameters are this rank's shards.
Torch DDP around it would broadcast rank 0's shards over every other rank's at construction (each rank's part of
the model replaced by rank 0's) and then all-reduce shard gradients that belong to different parts of the model:
training goes on and silently learns nothing useful (upstream behaved the same). transformers 4.30-4.34's Trainer does
this with ``--sharded_ddp zero_dp_2``/``zero_dp_3`` (its accelerate ``prepare`` wraps the FSDP model in DDP).

DDP's constructor reads ``module._ddp_params_and_buffers_to_ignore`` when the module has it (``hasattr``), and nothing
else in torch does: a descriptor under that name on FSDP is where the wrapping can be refused, before DDP sends
anything, on every rank alike. Only the outermost module is seen: DDP around a plain module holding FSDP instances is
not detected (documented).
"""

from typing import Any, NoReturn, Optional

from fairscale.internal.errors import FairscaleTypeError

__all__ = ["RefuseTorchDDP"]


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
