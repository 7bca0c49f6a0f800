# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Changes of the user's to FSDP parameters between steps: hooks FSDP cannot honour, and data replaced."""

from typing import List, Optional

import torch

from .handle import FlatHandle
from .state import HandleState, TrainingState
from .unit import FSDPUnit

__all__ = ["check_data_is_the_shard", "check_no_user_post_accumulate_hooks", "take_pending_data"]


def take_pending_data(unit: FSDPUnit, units: Optional[List[FSDPUnit]] = None) -> None:
    """:func:`check_data_is_the_shard` for every idle unit of ``unit``'s tree, before a call that reads or writes the
    shards directly (local and DCP state dicts, loads and their snapshots): a pending ``p.data =`` was read stale
    there, or copied over the loaded values at the next forward (found by a review, session 43).

    ``units``: ``unit.tree_units()`` when the caller listed them already.
    """
    for u in unit.tree_units() if units is None else units:
        if u.training_state == TrainingState.IDLE:  # in a summon p.data is the full parameter
            for h in u.handles:
                check_data_is_the_shard(h)


def check_data_is_the_shard(handle: FlatHandle) -> None:
    """Refuse a parameter whose data was replaced by one of another shape between steps, take one of the shard's shape.

    Checked at each forward and summon (``state_dict()`` too), while the instance is idle.

    Between steps ``p.data`` is this rank's 1-D shard. ``p.data = full_tensor`` (a plain module's way to load a
    pretrained weight) was taken as the shard at the first forward, which then failed in the all-gather with a message
    about element counts, and after a step was overwritten by the next forward, silently (found by a fuzz of init
    patterns, session 42). The shape is compared: one attribute read per parameter.
    """
    if handle.borrowed or handle.state is not HandleState.SHARDED:
        return  # a borrower's parameter is the owner's; in the other states p.data is not the shard
    param = handle.param
    if handle.is_sharded:
        fits = param.dim() == 1 and param.shape[0] == handle.shard_numel
    else:
        fits = param.shape == handle.orig_size
    if not fits:
        held = f"this rank's 1-D shard of {handle.shard_numel} elements" if handle.is_sharded else "the parameter"
        raise RuntimeError(
            f"FullyShardedDataParallel: the data of parameter {handle.name!r} was replaced by a tensor of shape "
            f"{tuple(param.shape)} after wrapping, where FSDP keeps {held} between steps (shape "
            f"{(handle.shard_numel,) if handle.is_sharded else tuple(handle.orig_size)}). Load values with "
            "model.load_state_dict(), or assign them inside `with model.summon_full_params():`."
        )
    _take_replaced_shard(handle)


def _take_replaced_shard(handle: FlatHandle) -> None:
    """Take ``p.data = tensor`` of the shard's shape (``vector_to_parameters``) into FSDP's shard.

    The all-gather reads FSDP's own reference to the shard, and the end of the next forward set ``p.data`` back to
    it: the user's values were lost, silently (found by a fuzz of FSDP with torch utilities, session 42). They are
    copied into the shard, which keeps its storage (pinned memory, the optimizer's view of it), as a load does.
    """
    shard = handle.fp32_shard
    param = handle.param
    if shard is None or param.data_ptr() == shard.data_ptr():
        return  # not materialized yet (lazy init takes p.data as it is), or untouched: one pointer compare
    data = param.data
    if data.dtype != shard.dtype or data.device != shard.device:
        raise RuntimeError(
            f"FullyShardedDataParallel: the data of parameter {handle.name!r} was replaced by a {data.dtype} tensor "
            f"on {data.device} after wrapping, where FSDP keeps a {shard.dtype} shard on {shard.device}. Convert "
            "the whole model with model.to(...), or copy values in (p.data.copy_(...), model.load_state_dict())."
        )
    with torch.no_grad():
        shard.copy_(data)
    param.data = shard


def check_no_user_post_accumulate_hooks(handle: FlatHandle) -> None:
    """Refuse a post-accumulate-grad hook of the user's on ``handle``'s parameter (called before training forwards).

    Such a hook (an optimizer stepped in backward, torchtune's idiom for plain modules and FSDP2) runs when autograd
    accumulated the full unreduced gradient, before FSDP reduce-scatters it; FSDP hands the reduced shard to
    ``p.grad`` only at the end of the backward. The hook saw ``p.grad`` as ``None`` and its optimizer stepped
    nothing: the model silently did not train (found by a fuzz of FSDP with ordinary torch code, session 41).
    ``register_hook`` hooks are fine: they see this rank's gradient before the reduction, as torch DDP's do.
    """
    if handle.borrowed:
        return  # the owner's parameter, with the owner's FSDP hook: the owner's check covers it
    param = handle.param
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks is not None and len(hooks) > int(handle.post_hook_registered) and param.requires_grad:
        raise RuntimeError(
            "FullyShardedDataParallel: a post-accumulate-grad hook (register_post_accumulate_grad_hook, e.g. an "
            f"optimizer stepped in backward) is registered on the FSDP parameter {handle.name!r}. FSDP reduces the "
            "gradient after autograd accumulates it and sets the reduced shard in p.grad at the end of the "
            "backward, so the hook would see p.grad as None and its step would change nothing. Remove the hook "
            "(handle.remove()) and call optimizer.step() after loss.backward()."
        )
