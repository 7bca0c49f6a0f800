# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Hooks of the user's on FSDP parameters that FSDP cannot honour."""

from .handle import FlatHandle

__all__ = ["check_no_user_post_accumulate_hooks"]


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
