# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A ``no_sync()`` accumulation window cleared in place (``zero_grad(set_to_none=False)``) before a clip or a step.

After a ``no_sync()`` backward a sharded parameter's ``p.grad`` is this rank's unreduced, full-size gradient (or a
view of the ``optimize_backward_concat`` window buffer). ``zero_grad()`` inside the window drops it: with
``set_to_none=True`` ``p.grad`` is ``None`` and the optimizer skips the parameter, as a plain module's would. With
``set_to_none=False`` the full-size gradient stayed, all zero: the next backward saw the window as cleared
(:meth:`FlatHandle.drop_window_if_cleared`), but ``clip_grad_norm_`` and ``optimizer.step()`` refused it as "not
reduced yet", where a plain module clips a zero norm and steps with zero gradients (weight decay and momentum still
apply). Before either, such a gradient becomes what a reduction of zeros gives: a zero gradient of the shard's shape.
"""

import torch

from .unit import FSDPUnit


def settle_cleared_windows(root: FSDPUnit) -> None:
    """Turn the in-place cleared window gradients of ``root``'s tree into zero shard gradients (see the module)."""
    for unit in root.tree_units():
        for h in unit.handles:
            had_grad = h.param.grad is not None  # None: zero_grad(set_to_none=True), which stays None
            if not h.drop_window_if_cleared() or not had_grad:  # still the window's sum, or cleared to None
                continue
            # Where and how the reduction hands a shard to p.grad (hand_reduced_grad_to_param).
            shard = h.fp32_shard if h.fp32_shard is not None else h.param.data
            device = torch.device("cpu") if unit.config.move_grads_to_cpu else shard.device
            zero = torch.zeros(shard.shape, dtype=h.param.dtype, device=device)
            h.param.grad = zero
            h.remember_assigned_grad(zero)
