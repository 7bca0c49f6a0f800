# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Post-backward: a unit's full gradient is ready; free its full parameters and reduce-scatter the gradient.

The reduced shard is accumulated in the handle (:meth:`FlatHandle.accumulate_reduced`) and handed to ``p.grad``
at the end of the backward (:mod:`.runtime`). Reductions run on the tree's post-backward stream (inert on CPU) and
go through the tree's bucketer, which merges small gradients into fewer collectives.
"""

import functools
import weakref

import torch
from torch import Tensor

from fairscale.internal import collectives, tensor_hooks

from . import nested_backward, ties
from .handle import FlatHandle
from .state import TrainingState
from .unit import FSDPUnit


def begin_post_backward(unit: FSDPUnit, h: FlatHandle, sync: bool) -> bool:
    """Common start of a unit's post-backward point: bookkeeping, then reshard.

    Returns:
        False when the work is deferred to the final callback (more gradient pieces may still come from
        checkpointed regions of this unit), True when the caller should go on and reduce (if syncing).
    """
    tree = unit.tree
    assert tree is not None
    tree.queue_final_callback()
    if unit.training_state == TrainingState.IDLE:
        raise RuntimeError(
            f"the gradient of {h.name} arrived, but no output of this FullyShardedDataParallel's forward got a "
            "gradient hook: return tensors (or tuples, lists, dicts, namedtuples or dataclasses of tensors) from "
            "the wrapped module's forward so FSDP can see them"
        )
    if not unit.pre_backward_ran:
        if unit.training_state == TrainingState.FORWARD:
            # A backward run inside the instance's own forward: Lightning's manual optimization under its root FSDP
            # wrapper (training_step runs inside the wrapper's forward), or a forward that calls backward itself.
            raise RuntimeError(
                f"the gradient of {h.name} arrived while this FullyShardedDataParallel instance's forward was still "
                "running: a backward inside the wrapped module's forward (e.g. manual optimization in a training "
                "step that runs inside the root instance's forward) is not supported, as upstream; call backward "
                "after the outermost instance's forward returned (wrap the model's layers, not the training step)"
            )
        raise RuntimeError(f"post-backward of {h.name} in unexpected state {unit.training_state.name}")
    tree.any_post_backward = True
    unit.transition(TrainingState.BACKWARD_POST)
    if (
        unit.defer_post_backward
        or unit.live_grad_forwards() > 1
        or (unit.outer_task_uses_params and tensor_hooks.current_graph_task() != unit.backward_task)
    ):
        # A reentrant checkpoint's nested backward over part of the unit: keep the full parameters (the outer
        # backward still reads them) and let the gradient accumulate; the outer task's hook reduces the whole of it.
        # (A checkpoint around the whole unit leaves the outer task no use of them: reduced here, as before.)
        # Likewise a unit used by several forwards of this backward: reducing at the first use's hook reduce-
        # scattered each use's part on its own (and the next use gathered the parameters again, over the whole
        # group even with zero2): the end of backward reduces the sum once.
        return False
    if sync or unit.reshard_after_forward:
        if nested_backward.only_nested_tasks_use_params(unit):
            # Another nested backward (a second reentrant checkpoint over this unit's parameters) may still read
            # them: freed when the unit's own backward task reaches the next unit, or at the end of backward.
            tree.free_after_nested_backwards(unit, h)
        else:
            h.free_full()
    h.use_shard()
    return True


def on_param_grad_ready(unit: FSDPUnit, h: FlatHandle, param: Tensor) -> None:
    """The parameter's post-accumulate-grad hook: its full gradient is in ``param.grad``."""
    if torch.is_grad_enabled():  # backward(create_graph=True): nothing here may join the graph
        with torch.no_grad():
            _on_param_grad_ready(unit, h, param)
    else:  # the usual backward runs without grad mode, and a no_grad context per unit and step is not free
        _on_param_grad_ready(unit, h, param)


def _on_param_grad_ready(unit: FSDPUnit, h: FlatHandle, param: Tensor) -> None:
    if param.grad is None or unit.tree is None:
        return
    if param.grad.requires_grad:
        # Upstream asserted the same; the message says what to do instead (a fuzz of forward patterns, session 44).
        raise RuntimeError(
            f"FullyShardedDataParallel: the gradient of {unit.qualified_name(h.name)!r} requires grad (a backward with "
            "create_graph=True); FSDP reduces gradients across ranks and cannot keep their graph, so a double "
            "backward through .grad is not supported. For a gradient penalty, take torch.autograd.grad(..., "
            "create_graph=True) of what the penalty needs, add the penalty to the loss, and call loss.backward() "
            "without create_graph."
        )
    if not unit.pre_backward_ran and ties.grad_is_a_borrowers_part(unit, param):
        return  # the borrower's part of a shared parameter's gradient: it waits in p.grad for the owner's part
    sync = unit.require_backward_grad_sync
    if not begin_post_backward(unit, h, sync):
        return
    if sync:  # else (no_sync) the full-size gradient stays in p.grad and accumulates
        grad = param.grad
        param.grad = None
        h.close_window()  # FSDP itself took the window's gradient out of p.grad: not the user's zero_grad()
        start_reduction(unit, h, grad)


@torch.no_grad()
def on_view_grads_accumulated(unit: FSDPUnit, h: FlatHandle, sync: bool) -> None:
    """Post-backward point of a unit whose views feed the flat buffer (``optimize_backward_concat``)."""
    if begin_post_backward(unit, h, sync) and sync:
        reduce_accumulated(unit, h)


def reduce_accumulated(unit: FSDPUnit, h: FlatHandle) -> None:
    """Reduce-scatter a window's buffer once, exactly as the default path reduces ``flat_param.grad``.

    The buffer has the dtype of that gradient (see grad_accum), so the reduction (fp32_reduce_scatter's cast
    included) is the same code on the same values: gradient shards are bitwise equal with the flag on and off.
    """
    start_reduction(unit, h, h.take_accum_buffer())


def start_reduction(unit: FSDPUnit, h: FlatHandle, grad: Tensor) -> None:
    """Reduce ``grad`` (full, unsharded) on the post-backward stream; the shard lands in ``saved_grad_shard``."""
    tree = unit.tree
    assert tree is not None
    if not tree.device.is_accelerator:
        # CPU: the post-backward stream is inert (and nothing is held, see below); skip its calls.
        with collectives.collective_phase("backward"):
            _reduce_grad(unit, h, grad)
        return
    tree.post_backward_stream.wait_stream(tree.device.current_stream())
    with collectives.collective_phase("backward"), tree.device.stream(tree.post_backward_stream):
        _reduce_grad(unit, h, grad)
    # The caller drops its reference: without this the allocator could hand the gradient's memory to the next
    # backward kernel on the compute stream while the post-backward stream still reads and divides it in place.
    tree.hold_until_reduced(grad)


def _reduce_grad(unit: FSDPUnit, h: FlatHandle, grad: Tensor) -> None:
    c = unit.config
    if c.fp32_reduce_scatter and grad.dtype != h.param.dtype:
        grad = grad.to(h.param.dtype)
    # != 1, not > 1: a factor below 1 (or a post factor below 1, when the pre factor exceeds the world size) must
    # divide as well, or the gradients come out scaled (upstream skipped those silently).
    if c.gradient_predivide_factor != 1:
        grad.div_(c.gradient_predivide_factor)
    # Weak: the bucketer (held by the tree, which the unit holds) keeps this callback until the reduction completes;
    # after a backward that raised that is the next forward, and a strong reference would keep a dropped model alive
    # in a cycle (unit -> tree -> bucketer -> callback -> unit) until the cycle collector runs.
    callback = functools.partial(_post_reduction_if_alive, weakref.ref(unit), weakref.ref(h))
    if not h.is_sharded:
        if c.replicate_size > 1:  # a one-rank shard group: hybrid sharding degenerates to DDP's all-reduce
            grad = grad.contiguous()
            collectives.all_reduce(grad, group=c.replicate_process_group)
        callback(grad)
        return
    tree = unit.tree
    assert tree is not None
    # The reduce-scatter group has the sharding group's size (checked at construction), so padding the flat gradient
    # to the padded full size lines rank r's chunk up with shard r (chunk-and-pad).
    flat = grad if grad.dim() == 1 else grad.reshape(-1)  # a flat parameter's gradient is 1-D already
    if flat.numel() != h.padded_numel:
        flat = torch.nn.functional.pad(flat, (0, h.padded_numel - flat.numel()))
    tree.bucketer.reduce_scatter_flat_async(
        flat.contiguous(),
        group=c.process_group_reduce_scatter,
        callback_fn=callback,
        replicate_group=c.replicate_process_group if c.replicate_size > 1 else None,
    )


def _post_reduction_if_alive(
    unit_ref: "weakref.ReferenceType[FSDPUnit]", h_ref: "weakref.ReferenceType[FlatHandle]", reduced: Tensor
) -> None:
    unit, h = unit_ref(), h_ref()
    if unit is not None and h is not None:  # else the model was dropped: nobody can read this gradient
        _post_reduction(unit, h, reduced)


def _post_reduction(unit: FSDPUnit, h: FlatHandle, reduced: Tensor) -> None:
    if unit.config.gradient_postdivide_factor != 1:
        reduced.div_(unit.config.gradient_postdivide_factor)
    dtype = h.param.dtype
    shard_grad = reduced if reduced.dtype is dtype else reduced.to(dtype)
    if shard_grad._base is not None:
        shard_grad = shard_grad.clone()  # do not keep a whole bucket output alive through a view
    assert h.fp32_shard is not None
    shape = h.fp32_shard.shape
    # Reduced shards arrive shaped like the fp32 shard already (1-D); a view would only cost its argument parsing.
    h.accumulate_reduced(shard_grad if shard_grad.shape == shape else shard_grad.view(shape))


def reduce_leftover_grads(unit: FSDPUnit) -> None:
    """End of a synchronizing backward: reduce what no post-backward point reduced.

    That is a unit that got no gradient in the synchronizing microbatch (its no_sync sum is still owed), or one
    whose reduction was deferred (partial activation checkpointing).
    """
    if torch.is_grad_enabled():
        with torch.no_grad():
            _reduce_leftover_grads(unit)
    else:  # the end-of-backward callback runs without grad mode: no context per unit and step
        _reduce_leftover_grads(unit)


def _reduce_leftover_grads(unit: FSDPUnit) -> None:
    for h in unit.iter_materialized():
        if h.grad_before_backward is None:
            # Not parked by this backward (no gradient in the synchronizing microbatch): its window may have been
            # cleared since the last one.
            h.drop_window_if_cleared()
        if h.grad_accum_flat is not None:
            # On its shard first, as every other reduction is: the reduction reads the parameter's dtype (the fp32
            # shard's, not the compute copy's) to cast for fp32_reduce_scatter and to store the reduced shard.
            h.use_shard()
            reduce_accumulated(unit, h)
        g = h.param.grad
        if g is not None and not h.is_assigned_grad(g) and g.shape == h.orig_size:
            h.param.grad = None
            h.close_window()
            h.use_shard()
            start_reduction(unit, h, g)
