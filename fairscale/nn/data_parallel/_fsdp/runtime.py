# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The hook lifecycle of an FSDP unit: lazy init, forward, pre-backward and the end-of-backward callback.

Order of events for one unit in one training step (ZeRO-3, ``reshard_after_forward=True``):

1. forward: gather full params (all-gather over ``process_group``), run the module on views of them, then free
   them (or keep a zero2 slice), and put tensor hooks on the outputs.
2. pre-backward (first output hook to fire): gather again (from the shards, or from the zero2 slices over the
   zero2 group), park existing shard gradients.
3. post-backward (the parameter's post-accumulate-grad hook, :mod:`.reduction`): free the full params and
   reduce-scatter the gradient over ``process_group_reduce_scatter``; the reduced shard is accumulated in the handle.
4. final callback (root, once per backward): flush the bucketer, hand every reduced shard to ``p.grad``, return
   every unit to IDLE with ``p.data`` the fp32 shard.

The docs page "Architecture" draws these objects and this data path.
"""

import contextlib
import functools
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives, tensor_hooks
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.internal.params import conversion_in_place
from fairscale.nn.checkpoint.checkpoint_activations import is_checkpointing, is_recomputing

from . import (
    ddp_guard,
    failed_load,
    fast_paths,
    hybrid,
    identity,
    layout_check,
    nested_backward,
    output_hooks,
    prefetch,
    recovery,
    reduction,
    step_guard,
    ties,
    zero2,
)
from .handle import FlatHandle
from .io import cast_inputs, for_each_tensor, map_tensors
from .naming import clean_path
from .param_hooks import check_no_user_post_accumulate_hooks, take_pending_data
from .reentrant_checkpoint import in_reentrant_checkpoint_first_pass
from .state import TrainingState
from .tree import TreeState
from .unit import FSDPUnit

# ---------------------------------------------------------------------------------------------------- lazy init


recover_between_steps = recovery.recover_between_steps


def _assert_between_steps(unit: FSDPUnit, what: str, why: str) -> None:
    """Raise unless every unit of the tree is idle and no forward's backward is pending (``why`` says what the
    pending backward would lack)."""
    recovery.recover_between_steps(unit)
    unit.assert_idle_tree(what)
    tree = unit.tree
    if tree is not None and tree.backward_pending:
        raise FairscaleRuntimeError(
            f"{what} called between a forward and its backward: {why}. Run the backward first (or the forward under "
            "torch.no_grad()), then call it; a forward whose outputs are still referenced counts as pending (after a "
            "backward that raised before reaching FSDP, drop its loss: del loss)."
        )


def check_copyable(unit: FSDPUnit, what: str = "copy.deepcopy") -> None:
    """Raise unless a copy of the tree (``what`` makes it) can be a usable model: idle, with no backward pending."""
    _assert_between_steps(unit, what, "the copy could not run that backward")


def _check_has_groups(unit: FSDPUnit) -> None:
    for u in unit.tree_units():
        c = u.config
        names = ("process_group", "process_group_reduce_scatter", "zero2_process_group", "replicate_process_group")
        missing = [name for name in names if isinstance(getattr(c, name), str)]
        if missing:
            raise FairscaleRuntimeError(
                "this FullyShardedDataParallel model was unpickled (pickle, torch.load of a whole model, or a copy "
                f"made in another process): its {', '.join(missing)} did not cross processes. Set them again on "
                "every FullyShardedDataParallel instance of it (e.g. m.process_group = group, as upstream's tests "
                "do), or load its state_dict() into a model wrapped in this process (copy.deepcopy in the same "
                "process keeps the groups)."
            )


def lazy_init(unit: FSDPUnit) -> None:
    """Materialise handles, find the root and share the tree state. Cheap after the first call."""
    failed_load.undo_failed_parent_loads(unit)
    if unit.is_root is None:
        _check_has_groups(unit)
        # Every unit of the tree, before anything is materialised or communicated: a tie error then leaves the
        # model as it was and is raised on every rank at the same point.
        paths = {id(m): clean_path(name) for name, m in unit.owner.named_modules()}
        for u in unit.tree_units():
            if u.foreign_params or u.tie_problems:
                _check_foreign_params(u, paths.get(id(u.owner)))
        ties.raise_for_unmanaged(unit.owner)
        ties.raise_for_late_ties(unit.tree_units(), paths)
    c = unit.config
    for h in unit.handles:
        if h.fp32_shard is None:  # not materialized yet
            with outside_inference_mode():
                h.materialize(unit.device, c.compute_dtype, c.move_params_to_cpu)
    if unit.foreign_params or unit.tie_problems:
        _check_foreign_params(unit)
    if unit.is_root is None:
        with outside_inference_mode():
            _become_root(unit)
            # Once per lazy-init cycle: `.to()`/`_apply` resets lazy init, so buffers are re-cast after a move.
            casts: Dict[int, Tuple[Tensor, Tensor]] = {}
            for u in unit.tree_units():
                u.cast_buffers(casts)


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Make what lazy init makes as normal tensors. Under a first forward in torch.inference_mode() (a validation
    sanity check before training) the full buffers, moved shards and cast buffers, which last across steps, would be
    inference tensors that no later training step could write."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            yield
    else:
        yield


def reset_lazy_init(unit: FSDPUnit) -> None:
    """Forget lazy-init results so the model can be moved/changed as before the first forward."""
    unit.is_root = None
    unit.tree = None
    unit.grad_accs = None
    unit.forward_grad_accs = None
    unit.grad_forward_tokens = None
    for h in unit.handles:
        h.reset()


def reset_lazy_init_between_steps(unit: FSDPUnit) -> None:
    """:func:`reset_lazy_init` as a user's call (``FSDP._reset_lazy_init``): refused during a step.

    On a unit inside an initialised tree (not its root) the whole tree is reset: forgotten alone, the unit would make
    itself the root of its subtree at its next forward, beside the tree's root, whose recorded execution order would
    then change (spurious "order changed" warnings, prefetch off its plan). The next forward of the root, or of the
    unit if it is now used on its own, initialises again what it runs.
    """
    _assert_between_steps(unit, "_reset_lazy_init", "that backward would find the instance uninitialised")
    tree = unit.tree
    root = tree.root() if tree is not None and unit.is_root is False and tree.root is not None else None
    for u in root.tree_units() if isinstance(root, FSDPUnit) else [unit]:
        if u is unit or u.tree is tree:
            reset_lazy_init(u)


@contextlib.contextmanager
def lazy_init_for_call(unit: FSDPUnit) -> Iterator[None]:
    """Lazy init for one call (state_dict, load, apply...) that leaves the model as uninitialised as it found it.

    A call before the first forward must not fix the root: the model may still be wrapped further or moved.
    """
    uninitialized = unit.is_root is None
    lazy_init(unit)
    take_pending_data(unit)
    try:
        yield
    finally:
        # A call left open by a load that raised (see failed_load) may end here when its model is already gone.
        alive = unit._owner_ref is not None and unit._owner_ref() is not None
        if uninitialized and unit.is_root and alive:
            for u in unit.tree_units():
                reset_lazy_init(u)


def _check_foreign_params(unit: FSDPUnit, where: Optional[str] = None) -> None:
    """``where``: the instance's path in the root's tree, named in the error (the tie's names are relative to it)."""
    declared = {id(h.param) for h in unit.handles if h.borrowed}
    undeclared = [name for name, p in unit.foreign_params if id(p) not in declared]
    if undeclared or unit.tie_problems:
        ties.raise_for_ties(unit.tie_problems, undeclared, where)
    unit.foreign_params = []


def _bucket_cap_for_tree(unit: FSDPUnit) -> float:
    """``bucket_cap_mb``, but never more than the whole tree's gradients need.

    The bucket is sized to what it holds (see :class:`~fairscale.internal.reduce_scatter_bucketer.Bucket`); the cap
    only bounds one fill, and never needs to exceed all full gradients of the tree (in fp32, an upper bound).
    """
    cap = unit.config.bucket_cap_mb
    if cap <= 0:
        return cap
    need = sum(h.padded_numel * 4 for u in unit.tree_units() for h in u.handles)
    return min(float(cap), need / 2**20)


def _become_root(unit: FSDPUnit) -> None:
    unit.is_root = True
    tree = TreeState(unit.device, _bucket_cap_for_tree(unit))
    tree.root = weakref.ref(unit)
    # The front's method, looked up now (not at construction) so that it can be wrapped before the first forward.
    tree.set_finalizer(getattr(unit.owner, "_finalize_backward"))
    unit.tree = tree
    step_guard.recover_before_steps(unit)
    units = unit.tree_units()
    group = unit.config.process_group
    unit.children_share_process_group = all(u.config.process_group is group for u in units)
    for u in units:
        u.defer_post_backward = u.has_inner_checkpoint_regions()
        if u is unit:
            continue
        if u.config.world_size == 1 and unit.config.world_size > 1 and not unit.children_share_process_group:
            # Upstream's MoE rule: an expert instance on a 1-rank group keeps its optimizer state rank-local.
            u.config = u.config.replace(no_broadcast_optim_state=True)
        u.is_root = False  # a unit that ran on its own first now becomes part of this tree
        u.tree = tree
    tree.sharing = ties.units_sharing_params(units)
    for u in units:
        nested_backward.watch_whole_unit_recomputation(u)
    fast_paths.keep_encoder_layers_off_their_fast_path(unit.owner, {id(u.owner) for u in units})


def check_zero2_groups_once(root: FSDPUnit) -> None:
    """The root's first forward: zero2 and replicate settings agree across ranks, then each group is valid.

    Both are small collectives. The first one runs on every rank, with or without such groups, because a group
    passed on some ranks and ``None`` on others would otherwise make the ranks issue different collectives (a hang);
    it raises the same ``ValueError`` on every rank instead. With hybrid sharding it runs over FSDP's cached group of
    the whole world (the shard group is then a part of the world, and the layout of the replicate groups can only be
    checked from every rank's view); that is also the ``process_group`` of an instance built without one, so a rank
    given no replicate group meets the hybrid ranks in the same gather and raises the same error. Not the default
    group: other code (an asynchronous checkpoint save, say) may use it from another thread at the same time.
    """
    if root.zero2_checked:
        return
    units = root.tree_units()
    ties.check_borrowed_in_tree([u.handles for u in units])  # rank-local, before the collectives below
    c = root.config
    # On the compute device: NCCL object collectives allocate on the current device.
    with collectives.collective_phase("init"), root.device.as_current():
        token = identity.new_token()
        tree = root.named_units()
        named_units = [(clean_path(n), u.config) for n, u in tree]
        hybrid_views = hybrid.views_of_tree(named_units)
        group = hybrid.world_group() if hybrid_views else c.process_group
        if hybrid_views or c.world_size > 1:
            named = [(path, uc.zero2_process_group, uc.replicate_process_group) for path, uc in named_units]
            ranks = collectives.group_ranks(group)
            layouts = [layout_check.describe(u, ranks) for _, u in tree]
            token, views, layout_views = zero2.check_same_setting(group, named, token, hybrid_views, layouts)
            if hybrid_views:
                hybrid.check_grid(views, collectives.group_size(group))
            layout_check.check_agree([path for path, _ in named_units], layout_views, ranks)
        if root.ckpt_token is None:  # a load may have set one already, agreed the same way
            root.ckpt_token = token
        seen = set()
        for u in units:
            group = u.config.zero2_process_group
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                zero2.check_partition(u.config.process_group, group, u.config.zero2_problem)
    # Only once it passed: a caught ValueError must not let a retry skip the check and hang later instead.
    root.zero2_checked = True


@contextlib.contextmanager
def no_sync(root: FSDPUnit) -> Iterator[None]:
    """See :meth:`FullyShardedDataParallel.no_sync`."""
    # The same rule before the first forward as after it: a nested instance's own lazy init would otherwise make it a
    # root of its own subtree and accept the call.
    if root.has_fsdp_parent or root.is_root is False:
        raise FairscaleRuntimeError(
            "no_sync() must be called on the root FullyShardedDataParallel instance; this one is nested inside "
            "another FullyShardedDataParallel instance"
        )
    lazy_init(root)
    if not root.is_root:
        raise FairscaleRuntimeError("no_sync() must be called on the root FullyShardedDataParallel instance")
    recovery.recover_between_steps(root)
    root.assert_state([TrainingState.IDLE])
    units = root.tree_units()
    saved = [u.require_backward_grad_sync for u in units]
    for u in units:
        u.require_backward_grad_sync = False
    try:
        yield
    finally:
        for u, flag in zip(units, saved):
            u.require_backward_grad_sync = flag


@contextlib.contextmanager
def moving(unit: FSDPUnit) -> Iterator[None]:
    """Around torch's ``_apply`` of an idle tree (``.to()/.half()/.cuda()``): every handle back to its shard alone,
    lazy init forgotten; afterwards, without mixed precision, the compute dtype follows the parameters' dtype.

    The parameters are converted in place (same objects) whatever ``torch.__future__``'s conversion settings say: the
    handles hold them and swap shards in through ``.data``.
    """
    # The pending backward would gather shards that no longer exist in that dtype/device (and lazy init is forgotten
    # below): it used to fail in the pre-backward hook with a bare assertion.
    _assert_between_steps(
        unit, "_apply (.to/.half/.float/.cuda)", "the pending backward needs the parameters as the forward used them"
    )
    units = unit.tree_units()
    for u in units:
        u.release_all()
        reset_lazy_init(u)
    with conversion_in_place():
        yield
    for u in units:
        c = u.config
        if not c.mixed_precision and u.handles:
            dtype = u.handles[0].param.dtype
            u.config = c.replace(compute_dtype=dtype, buffer_dtype=c.buffer_dtype if c.buffer_dtype_given else dtype)


# ---------------------------------------------------------------------------------------------------- forward


def forward(unit: FSDPUnit, args: Any, kwargs: Any) -> Any:
    """The forward of one FSDP instance (see the module docstring for what happens around the user's forward)."""
    units = None  # the tree's units, listed once for the root's checks below (a walk of every module: profiled)
    if unit.training_state == TrainingState.IDLE and unit.is_root is not False:  # None: a first forward
        units = unit.tree_units()
        take_pending_data(unit, units)  # the whole tree: the root prefetches nested units' gathers before they run
    lazy_init(unit)
    if unit.is_root:
        # At the first forward, not in lazy_init: local_state_dict() and friends before any forward must stay
        # rank-local (no collective that the other ranks would have to join).
        check_zero2_groups_once(unit)
        ddp_guard.refuse_enclosing_ddp(unit)
        if torch._C._current_graph_task_id() == -1:
            recovery.recover_from_aborted_backward(unit, units)
    tree = unit.tree
    assert tree is not None
    root_pass = bool(unit.is_root) and not is_recomputing()
    if root_pass:
        tree.forward_order.restart()
        tree.forward_running = True
        tree.root_forwards += 1
    previous = unit.training_state
    if previous not in (TrainingState.IDLE, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
        raise RuntimeError(
            f"FullyShardedDataParallel.forward called while the instance is in {previous.name}; a forward "
            "cannot run inside summon_full_params() or inside its own forward."
        )
    unit.transition(TrainingState.FORWARD)
    # See FSDPUnit.grad_forward_tokens. Not a recomputation inside backward (activation checkpointing, torch's
    # non-reentrant one included): it redoes a use already counted, and counting it would keep every checkpointed
    # unit's full parameters to the end of backward.
    counted = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 and not is_recomputing()
    try:
        outputs = _run_forward(unit, args, kwargs, counted)
    finally:
        unit.transition(previous)
        if root_pass:
            tree.forward_running = False
    if root_pass:
        tree.forward_order.finish()  # only a completed forward is an order
        prefetch.end_of_forward(tree, evaluation=not torch.is_grad_enabled())
    if unit.config.clear_autocast_cache:
        torch.clear_autocast_cache()
    return outputs


def _run_forward(unit: FSDPUnit, args: Any, kwargs: Any, counted: bool) -> Any:
    c = unit.config
    if unit.is_root and c.mixed_precision:
        args, kwargs = cast_inputs(c.compute_dtype, (torch.float32,), False, args, kwargs)  # see io.py
    elif c.force_input_to_fp32 and not c.mixed_precision:
        args, kwargs = cast_inputs(torch.float32, (torch.float16, torch.bfloat16), False, args, kwargs)
    passed_in: Dict[int, Any] = {}
    if torch.is_grad_enabled():
        for h in unit.handles:
            check_no_user_post_accumulate_hooks(h)
        passed_in = output_hooks.passed_in_graph_tensors((args, kwargs))  # before the forward may change them
    # A recomputation (activation checkpointing) runs in backward, right before this unit's own backward: its
    # gathers are backward traffic, and resharding after it would only force one more gather. A forward with grad on
    # inside a backward is one too: torch's reentrant checkpoint (HF's gradient checkpointing) around a unit gathered
    # it twice per backward, tagged "forward" (a fuzz of real-world architectures, session 45).
    recomputing = is_recomputing() or (torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1)
    if not recomputing:
        unit.drop_stale_full_params()
    # Nothing of a forward without autograd (evaluation) may stay gathered: no backward will use it, and an optimizer
    # writing through p.data would leave it stale. Checkpointing's first pass is the exception.
    grad_off = not torch.is_grad_enabled() and not is_checkpointing() and not in_reentrant_checkpoint_first_pass()
    unit.rebuild_full_params("backward" if recomputing else "forward")
    if not recomputing:
        prefetch.on_forward(unit)
    unit.use_full_params()
    try:
        outputs = _unalias_outputs(unit, unit.wrapped(*args, **kwargs))
    except BaseException:
        # A forward that raised (a bad batch caught and skipped, an OOM): its parameters are the fp32 shards again.
        # They stayed the gathered full parameters until the next forward: an optimizer step then failed on the
        # shapes, or (one rank, mixed precision) updated the temporary low-precision copy and was lost, silently.
        # Not inside a backward: a recomputation there may be stopped on purpose by an exception (torch's
        # non-reentrant checkpoint stops it once it has what it needs), and the backward goes on with the gathered
        # parameters.
        if not recomputing and torch._C._current_graph_task_id() == -1:
            unit.reshard(after_forward=False)
            unit.use_fp32_shards()
        raise
    # Before the full parameters are freed (a view of a freed one fails) and before use_fp32_shards (see below).
    accs = _forward_grad_accumulators(unit) if torch.is_grad_enabled() else []
    if (unit.reshard_after_forward or grad_off) and not recomputing:
        unit.reshard(after_forward=not grad_off)
    unit.use_fp32_shards()
    if torch.is_grad_enabled():
        outputs = output_hooks.register_pre_backward_hooks(
            unit, (args, kwargs), outputs, accs, counted, pre_backward, passed_in
        )
    elif grad_off:
        output_hooks.refuse_backward_of_evaluation_outputs((args, kwargs), outputs)
    return outputs


def _unalias_outputs(unit: FSDPUnit, outputs: Any) -> Any:
    """Outputs that share memory with the unit's full parameters, as copies (the others as they are).

    A forward may return a parameter or a view of it (a prompt, a class token, a positional table expanded to the
    batch). The full parameters are freed after the forward (or, unsharded, swapped back for the fp32 shard): such an
    output then pointed at freed memory (a segmentation fault in the next ``torch.cat``, or "setStorage ... storage of
    size 0"), or, with ``flatten_parameters=False``, *was* the parameter, now this rank's 1-D shard (rank 1 multiplied
    by its zero padding, silently). A copy keeps the values and the gradient path (``clone`` is differentiable).
    """
    full = set()
    for h in unit.handles:
        shard = h.fp32_shard
        if shard is None:
            continue
        ptr = h.param.data.untyped_storage().data_ptr()
        if ptr and ptr != shard.untyped_storage().data_ptr():
            full.add(ptr)
    if not full:
        return outputs
    aliased = [False]

    def check(t: Tensor) -> None:
        if t.untyped_storage().data_ptr() in full:
            aliased[0] = True

    for_each_tensor(outputs, check)
    if not aliased[0]:
        return outputs
    return map_tensors(lambda t: t.clone() if t.untyped_storage().data_ptr() in full else t, outputs)


def _forward_grad_accumulators(unit: FSDPUnit) -> List[Any]:
    """The accumulator nodes this forward's graph leads to, for parameters whose full and shard tensors differ in
    dtype or device (empty otherwise, which is the common fp32 case: nothing is looked up).

    Pointing ``param.data`` back at the shard (another dtype or device) makes autograd drop the parameter's
    accumulator; the one this forward made is then reachable only through its graph, so it is taken now, while
    ``param.data`` is still the full parameter and autograd still hands it out.
    """
    accs: List[Any] = []
    for h in unit.handles:
        p, shard = h.param, h.fp32_shard
        if shard is not None and p.requires_grad and (p.dtype is not shard.dtype or p.device != shard.device):
            acc = tensor_hooks.grad_accumulator(p)
            if acc is not None:
                accs.append(acc)
    return accs


# ---------------------------------------------------------------------------------------------------- backward


def pre_backward(unit: FSDPUnit) -> None:
    """Runs when the gradient of one of the unit's forward outputs is ready (idempotent within a backward)."""
    tree = unit.tree
    assert tree is not None
    tree.queue_final_callback()
    tree.free_nested_leftovers()
    # Every time, a late hook too: an output the unit also used itself (T5's position bias) fires after part of the
    # unit's backward and gathers the parameters reduced by then again (with flatten_parameters=False: extra,
    # temporary gathers). Leaving them alone was tried (session 45) and reverted: a second use's hook, or a reentrant
    # checkpoint inside the unit recomputing with a parameter already reduced, still reads them.
    unit.rebuild_full_params("backward")
    unit.use_full_params()
    if unit.pre_backward_ran:
        # Reached again from a nested task (an inner unit's outputs in a checkpoint_wrapper recomputation).
        nested_backward.adopt_nested_task_if_it_uses_params(unit)
        return
    if unit.training_state != TrainingState.IDLE:
        raise RuntimeError(f"pre-backward hook in unexpected state {unit.training_state.name}")
    for h in unit.handles:
        # Park reduced shard gradients of earlier backwards so autograd can write full-size ones.
        h.park_grad_for_backward(unit.config.compute_device)
    unit.transition(TrainingState.BACKWARD_PRE)
    unit.backward_task = tensor_hooks.current_graph_task()
    unit.outer_task_uses_params = nested_backward.task_uses_params(unit)
    prefetch.on_pre_backward(unit)


def _weak_post_backward_hook(unit: FSDPUnit, h: FlatHandle) -> Callable[[Tensor], None]:
    """The per-parameter hook, holding the unit and handle weakly.

    A tensor's hooks live in C++, out of sight of Python's garbage collector: a strong reference from the hook back
    to the unit (whose module owns the parameter) would form a cycle that is never collected, keeping every FSDP
    model and its parameters alive after the user dropped it.
    """
    unit_ref, handle_ref = weakref.ref(unit), weakref.ref(h)

    def hook(param: Tensor) -> None:
        u, handle = unit_ref(), handle_ref()
        if u is not None and handle is not None:
            reduction.on_param_grad_ready(u, handle, param)

    return hook


def register_post_backward_hooks(unit: FSDPUnit) -> None:
    """A post-accumulate-grad hook on every owned parameter that trains (once per handle).

    Not on a parameter borrowed with ``append_shared_param``: its owner's hook reduces its gradient, the borrower's
    part included (a model and its copies, which register the hooks again, behave alike).
    """
    for h in unit.handles:
        if not h.borrowed:
            h.install_post_backward_hook(functools.partial(_weak_post_backward_hook, unit, h))


def finalize_backward(root: FSDPUnit) -> None:
    """Root only, once after the whole backward graph ran."""
    tree = root.tree
    assert tree is not None
    if not root.is_root:
        raise RuntimeError("fairscale internal error: finalize_backward called on a unit that is not the root")
    syncing = root.require_backward_grad_sync
    units = root.tree_units()
    if syncing:
        for u in units:
            reduction.reduce_leftover_grads(u)
        with collectives.collective_phase("backward"), tree.device.stream(tree.post_backward_stream):
            tree.bucketer.flush()
        tree.device.current_stream().wait_stream(tree.post_backward_stream)
        if any(u.has_shared_params for u in units):
            ties.merge_borrowed_grads([u.handles for u in units])
    tree.release_held()
    tree.bucketer.teardown()
    tree.free_nested_leftovers()
    if syncing:
        root.ckpt_step += 1  # the "step" of the checkpoint identity
    # autograd.grad() (e.g. a gradient penalty built with create_graph=True) runs no post-backward point; the graph it
    # built still reads the full parameters of units that keep them after forward, and, when it built a graph of its
    # own, of the resharding units too (the penalty's backward reads them; they are freed at its end).
    keep_full = not tree.any_post_backward
    keep_resharded = keep_full and tree.backward_builds_graph
    for u in units:
        _finalize_unit(u, syncing, keep_full, keep_resharded)
    if not syncing:
        step_guard.watch(root)
    tree.final_callback_queued = False
    tree.any_post_backward = False
    tree.backward_order.finish()


def _finalize_unit(unit: FSDPUnit, syncing: bool, keep_full: bool, keep_resharded: bool) -> None:
    unit.forget_finished_forwards()
    to_cpu = unit.config.move_grads_to_cpu
    for h in unit.handles:
        h.end_backward()
        if not h.materialized:
            continue  # this unit never ran a forward since its lazy init
        if (syncing and not keep_full) or (unit.reshard_after_forward and not keep_resharded):
            h.free_full()
        h.drop_zero2_slice()
        h.use_shard()
        if syncing:
            h.close_window()
            h.hand_reduced_grad_to_param(to_cpu)
        else:
            h.leave_window_grad()
    unit.transition(TrainingState.IDLE)
