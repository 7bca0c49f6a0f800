# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The hook lifecycle of FullyShardedDataParallel: lazy init, forward, pre/post backward and the final callback.

Order of events for one instance in one training step (ZeRO-3, ``reshard_after_forward=True``):

1. forward: gather full params (all-gather over ``process_group``), run the module on views of them, then free
   them (or keep a zero2 slice), and put tensor hooks on the outputs.
2. pre-backward (first output hook to fire): gather again (from the shards, or from the zero2 slices over the
   zero2 group), park existing shard gradients.
3. post-backward (the parameter's post-accumulate-grad hook): free the full params and reduce-scatter the gradient
   over ``process_group_reduce_scatter``; the reduced shard is accumulated in the handle.
4. final callback (root, once per backward): flush the bucketer, hand every reduced shard to ``p.grad``, return
   every instance to IDLE with ``p.data`` the fp32 shard.
"""

import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import collectives
from fairscale.internal.device import DeviceHandle
from fairscale.nn.checkpoint.checkpoint_activations import is_checkpointing, is_recomputing

from . import grad_accum, identity, prefetch, recovery, ties, zero2
from .handle import FlatHandle
from .io import cast_inputs, for_each_tensor
from .metadata import _clean
from .state import HandleState, TrainingState
from .tree import TreeState


def _weak_post_backward_hook(fsdp: "FSDPRuntime", h: FlatHandle) -> Callable[[Tensor], None]:
    """The per-parameter hook, holding the instance and handle weakly.

    A tensor's hooks live in C++, out of sight of Python's garbage collector: a strong reference from the hook back
    to the module (which owns the parameter) would form a cycle that is never collected, keeping every FSDP model
    and its parameters alive after the user dropped it.
    """
    fsdp_ref, handle_ref = weakref.ref(fsdp), weakref.ref(h)

    def hook(param: Tensor) -> None:
        owner, handle = fsdp_ref(), handle_ref()
        if owner is not None and handle is not None:
            owner._post_backward_hook(handle, param)

    return hook


class FSDPRuntime(nn.Module):
    """Machinery base class of :class:`FullyShardedDataParallel`; see the front class for the public API."""

    # Set by the front's constructor.
    process_group: Any
    process_group_reduce_scatter: Any
    zero2_process_group: Any
    rank: int
    world_size: int
    reshard_after_forward: bool
    _orig_reshard_after_forward: bool
    disable_reshard_on_root: bool
    mixed_precision: bool
    fp32_reduce_scatter: bool
    flatten_parameters: bool
    move_params_to_cpu: bool
    compute_dtype: torch.dtype
    buffer_dtype: torch.dtype
    move_grads_to_cpu: bool
    bucket_cap_mb: int
    compute_device: torch.device
    clear_autocast_cache: bool
    force_input_to_fp32: bool
    gradient_predivide_factor: float
    gradient_postdivide_factor: float
    optimize_backward_concat: bool
    forward_prefetch: bool = False
    backward_prefetch: bool = False
    params: List[nn.Parameter]
    _fsdp_wrapped_module: Any
    _num_flatten_params: int
    state_dict_device: torch.device
    state_dict_on_rank_0_only: bool
    _handles: List[FlatHandle]
    _is_root: Optional[bool]
    _tree: Optional[TreeState]
    training_state: TrainingState
    _require_backward_grad_sync: bool
    _pre_backward_hook_has_run: bool
    _zero2_rank: int
    _zero2_size: int
    _defer_post_backward: bool = False
    _zero2_problem: Optional[str] = None
    _foreign_params: List[Tuple[str, nn.Parameter]]
    # Ties between instances that FSDP cannot honour (see _fsdp/ties.py); raised at the first forward.
    _tie_problems: List[str] = []
    # Set when a parent FSDP instance wraps this one (known before any lazy init).
    _has_fsdp_parent: bool = False
    # Checkpoint identity (see _fsdp/identity.py): a token all ranks agreed on, and the synchronizing backward count.
    _ckpt_token: Optional[str] = None
    _ckpt_step: int = 0
    no_broadcast_optim_state: bool
    children_share_process_group: bool

    # ------------------------------------------------------------------ tree helpers
    def _fsdp_instances(self) -> List["FSDPRuntime"]:
        return [m for m in self.modules() if isinstance(m, FSDPRuntime)]

    @property
    def _device(self) -> DeviceHandle:
        return DeviceHandle.for_device(self.compute_device)

    def _owned_modules(self) -> List[nn.Module]:
        """Modules whose buffers belong to this instance: its subtree without nested FSDP subtrees."""
        out: List[nn.Module] = []
        stack: List[nn.Module] = [self]
        while stack:
            m = stack.pop()
            out.append(m)
            for child in m.children():
                if not isinstance(child, FSDPRuntime):
                    stack.append(child)
        return out

    # ------------------------------------------------------------------ lazy init
    def _lazy_init(self) -> None:
        """Materialise handles, find the root and share the tree state (spec 1.6). Cheap after the first call."""
        if self._is_root is None:
            # Every instance of the tree, before anything is materialised or communicated: a tie error then leaves
            # the model as it was and is raised on every rank at the same point.
            for m in self._fsdp_instances():
                if m._foreign_params or m._tie_problems:
                    m._check_foreign_params()
        for h in self._handles:
            h.materialize(self._device, self.compute_dtype, self.move_params_to_cpu)
        if self._foreign_params or self._tie_problems:
            self._check_foreign_params()
        if self._is_root is None:
            self._set_is_root()
            # Once per lazy-init cycle: `.to()`/`_apply` resets lazy init, so buffers are re-cast after a move.
            self._cast_buffers()
            if self.disable_reshard_on_root:
                self.reshard_after_forward = False

    def _check_foreign_params(self) -> None:
        declared = {id(h.param) for h in self._handles if h.borrowed}
        undeclared = [name for name, p in self._foreign_params if id(p) not in declared]
        if undeclared or self._tie_problems:
            ties.raise_for_ties(self._tie_problems, undeclared)
        self._foreign_params = []

    def _has_inner_checkpoint_regions(self) -> bool:
        """Whether activation checkpointing covers only part of this unit.

        Each checkpointed region recomputes inside its own nested backward, so the unit's parameter gradients then
        arrive in several pieces; the full parameters must stay until the whole backward is done, and the gradient
        is reduced once in the final callback. (A checkpoint around the whole unit is a single region: no deferral.)
        """
        from fairscale.nn.checkpoint.checkpoint_activations import _CheckpointedForward

        whole_unit = getattr(self._fsdp_wrapped_module, "module", None)
        return any(
            isinstance(m.__dict__.get("forward"), _CheckpointedForward)
            for m in self._owned_modules()
            if m is not whole_unit
        )

    def _bucket_cap_for_tree(self) -> float:
        """``bucket_cap_mb``, but never more than the whole tree's gradients need.

        The bucket is sized to what it holds (see :class:`~fairscale.internal.reduce_scatter_bucketer.Bucket`); the
        cap only bounds one fill, and never needs to exceed all full gradients of the tree (in fp32, an upper bound).
        """
        if self.bucket_cap_mb <= 0:
            return self.bucket_cap_mb
        need = sum(h.shard_numel * h.world_size * 4 for m in self._fsdp_instances() for h in m._handles)
        return min(float(self.bucket_cap_mb), need / 2**20)

    def _set_is_root(self) -> None:
        self._is_root = True
        tree = TreeState(self._device, self._bucket_cap_for_tree())
        tree.set_finalizer(self._finalize_backward)
        self._tree = tree
        instances = self._fsdp_instances()
        self.children_share_process_group = all(m.process_group is self.process_group for m in instances)
        for m in instances:
            m._defer_post_backward = m._has_inner_checkpoint_regions()
            if m is not self and m.world_size == 1 and self.world_size > 1 and not self.children_share_process_group:
                # Upstream's MoE rule: an expert instance on a 1-rank group keeps its optimizer state rank-local.
                m.no_broadcast_optim_state = True
            if m is not self:
                if m._is_root:
                    # It ran on its own first; it now becomes part of this tree.
                    m.reshard_after_forward = m._orig_reshard_after_forward
                m._is_root = False
                m._tree = tree

    def _reset_lazy_init(self) -> None:
        """Forget lazy-init results so the model can be moved/changed as before the first forward."""
        self._is_root = None
        self._tree = None
        for h in self._handles:
            h.reset()
        self.reshard_after_forward = self._orig_reshard_after_forward

    @torch.no_grad()
    def _cast_buffers(self) -> None:
        for m in self._fsdp_instances():
            for owned in m._owned_modules():
                for name, buf in list(owned.named_buffers(recurse=False)):
                    if buf is None:
                        continue
                    dtype = m.buffer_dtype if buf.is_floating_point() else buf.dtype
                    if buf.device != m.compute_device or buf.dtype != dtype:
                        setattr(owned, name, buf.to(device=m.compute_device, dtype=dtype))

    def _check_zero2_groups_once(self) -> None:
        """The root's first forward: zero2 settings agree across ranks, then each zero2 group is valid.

        Both are small collectives (contract 2.6). The first one runs on every rank, with or without a zero2 group,
        because a group passed on some ranks and ``None`` on others would otherwise make the ranks issue different
        collectives (a hang); it raises the same ``ValueError`` on every rank instead.
        """
        if getattr(self, "_zero2_checked", False):
            return
        instances = self._fsdp_instances()
        ties.check_borrowed_in_tree(instances)  # rank-local, before the collectives below
        # On the compute device: NCCL object collectives allocate on the current device.
        with collectives.collective_phase("init"), self._device.as_current():
            token = identity.new_token()
            if self.world_size > 1:
                named = [(_clean(n), m) for n, m in self._named_instances()]
                token = zero2.check_same_setting(self.process_group, named, token)
            if self._ckpt_token is None:  # a load may have set one already, agreed the same way
                self._ckpt_token = token
            seen = set()
            for m in instances:
                if m.zero2_process_group is not None and id(m.zero2_process_group) not in seen:
                    seen.add(id(m.zero2_process_group))
                    zero2.check_partition(m.process_group, m.zero2_process_group, m._zero2_problem)
        # Only once it passed: a caught ValueError must not let a retry skip the check and hang later instead.
        self._zero2_checked = True

    def _checkpoint_identity(self) -> Dict[str, Any]:
        """The identity of a sharded checkpoint taken from this instance now (see :mod:`.identity`)."""
        return identity.make_identity(self._ckpt_token, self._ckpt_step, self.rank, self.world_size)

    def _named_instances(self) -> List[Tuple[str, "FSDPRuntime"]]:
        return [(name, m) for name, m in self.named_modules() if isinstance(m, FSDPRuntime)]

    # ------------------------------------------------------------------ gathering
    def _rebuild_full_params(self, phase: str) -> None:
        """Bring every owned handle to FULL (from its shard, or its zero2 slice over the zero2 group)."""
        todo = [h for h in self._handles if h.state != HandleState.FULL]
        if not todo:
            return
        tree = self._tree
        assert tree is not None
        current = tree.device.current_stream()
        tree.all_gather_stream.wait_stream(current)
        with collectives.collective_phase(phase), tree.device.stream(tree.all_gather_stream):
            for h in todo:
                self._gather_one(h)
        current.wait_stream(tree.all_gather_stream)

    def _gather_one(self, h: FlatHandle, async_op: bool = False) -> None:
        """Gather ``h`` into its full buffer; with ``async_op`` (prefetch) the handle keeps the work in flight."""
        if not h.has_full_buffer:
            h.set_state(HandleState.FULL)
            return
        out = h.alloc_full()
        work: Optional[collectives.WorkHandle] = None
        if h.state == HandleState.ZERO2_SLICE:
            assert h.zero2_slice is not None
            source = h.zero2_slice
            work = collectives.all_gather_into_flat(out, source, self.zero2_process_group, async_op=async_op)
            h.zero2_slice = None
        else:
            h.gathered_version = h.shard_version()
            source = h.gather_input()
            if h.is_sharded:
                work = collectives.all_gather_into_flat(out, source, self.process_group, async_op=async_op)
            else:
                out.copy_(source.reshape(-1))
        h.set_state(HandleState.FULL)
        if work is not None:
            h.pending_gather = (work, source)

    def _drop_stale_full_params(self) -> None:
        """A new forward must not reuse gathered params (or zero2 slices) whose fp32 shard changed since the gather
        (optimizer step or summon write-back after a forward whose backward never ran)."""
        for h in self._handles:
            if h.state != HandleState.SHARDED and h.has_full_buffer and h.gathered_version != h.shard_version():
                h.free_full()
                h.drop_zero2_slice()

    def _use_full_params(self) -> None:
        for h in self._handles:
            h.use_full()

    def _use_fp32_shards(self) -> None:
        for h in self._handles:
            h.use_shard()

    def _reshard(self, after_forward: bool) -> None:
        """Free full params; after a forward with a zero2 group keep this rank's zero2 slice instead."""
        keep_slice = after_forward and self.zero2_process_group is not None
        for h in self._handles:
            if h.state != HandleState.FULL:
                continue
            if keep_slice and h.is_sharded:
                h.keep_zero2_slice(self._zero2_rank, self._zero2_size)
            else:
                h.free_full()

    # ------------------------------------------------------------------ forward
    def _fsdp_forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        if self._is_root:
            # At the first forward, not in _lazy_init: local_state_dict() and friends before any forward must stay
            # rank-local (no collective that the other ranks would have to join).
            self._check_zero2_groups_once()
        if self._is_root and torch._C._current_graph_task_id() == -1:
            self._recover_from_aborted_backward()
        root_pass = bool(self._is_root) and not is_recomputing() and self._tree is not None
        if root_pass:
            self._tree.forward_order.restart()  # type: ignore[union-attr]
            self._tree.forward_running = True  # type: ignore[union-attr]
        previous = self.training_state
        if previous not in (TrainingState.IDLE, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            raise RuntimeError(
                f"FullyShardedDataParallel.forward called while the instance is in {previous.name}; a forward "
                "cannot run inside summon_full_params() or inside its own forward."
            )
        self.training_state = TrainingState.FORWARD
        try:
            if self._is_root and self.mixed_precision:
                args, kwargs = cast_inputs(self.compute_dtype, (torch.float32,), True, args, kwargs)
            elif self.force_input_to_fp32 and not self.mixed_precision:
                args, kwargs = cast_inputs(torch.float32, (torch.float16, torch.bfloat16), False, args, kwargs)
            # A recomputation (activation checkpointing) runs in backward, right before this unit's own backward:
            # its gathers are backward traffic, and resharding after it would only force one more gather.
            recomputing = is_recomputing()
            if not recomputing:
                self._drop_stale_full_params()
            # Nothing of a forward without autograd (evaluation) may stay gathered: no backward will use it, and
            # an optimizer writing through p.data would leave it stale. Checkpointing's first pass is the exception.
            grad_off = not torch.is_grad_enabled() and not is_checkpointing()
            self._rebuild_full_params("backward" if recomputing else "forward")
            if not recomputing:
                prefetch.on_forward(self)
            self._use_full_params()
            outputs = self._fsdp_wrapped_module(*args, **kwargs)
            if (self.reshard_after_forward or grad_off) and not recomputing:
                self._reshard(after_forward=not grad_off)
            self._use_fp32_shards()
            if torch.is_grad_enabled():
                outputs = self._register_pre_backward_hooks(outputs)
        finally:
            self.training_state = previous
            if root_pass:
                self._tree.forward_running = False  # type: ignore[union-attr]
        if root_pass:
            self._tree.forward_order.finish()  # type: ignore[union-attr]  # only a completed forward is an order
        if self.clear_autocast_cache:
            torch.clear_autocast_cache()
        return outputs

    def _recover_from_aborted_backward(self) -> None:
        """A backward that raised never ran its final callback: reset the tree (see :mod:`.recovery`)."""
        recovery.recover_from_aborted_backward(self)

    def _register_pre_backward_hooks(self, outputs: Any) -> Any:
        tree = self._tree
        assert tree is not None
        token = tree.new_pending_backward()
        registered = [False]

        def hook(_grad: Tensor) -> None:
            token.done = True
            self._pre_backward_hook()

        def register(t: Tensor) -> None:
            if t.requires_grad:
                t.register_hook(hook)
                registered[0] = True

        for_each_tensor(outputs, register)
        if not registered[0]:
            token.done = True
        return outputs

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self) -> None:
        """Runs when the gradient of one of this instance's forward outputs is ready (idempotent)."""
        tree = self._tree
        assert tree is not None
        tree.queue_final_callback()
        self._rebuild_full_params("backward")
        self._use_full_params()
        if not self._pre_backward_hook_has_run:
            if self.training_state not in (TrainingState.IDLE, TrainingState.BACKWARD_PRE):
                raise RuntimeError(f"pre-backward hook in unexpected state {self.training_state.name}")
            self._prep_grads_for_backward()
            self._pre_backward_hook_has_run = True
            prefetch.on_pre_backward(self)
        if self.training_state == TrainingState.IDLE:
            self.training_state = TrainingState.BACKWARD_PRE

    def _prep_grads_for_backward(self) -> None:
        """Park reduced shard gradients of earlier backwards so autograd can write full-size ones (spec 1.10)."""
        for h in self._handles:
            p = h.param
            g = p.grad
            h.grad_before_backward = (h.saved_grad_shard, None)
            h.keep_intact = h.saved_grad_shard
            if g is None:
                continue
            # The shape alone is ambiguous when shard and full shapes coincide (a 1-element parameter): a full-size
            # gradient is an unreduced no_sync accumulation unless it is the shard FSDP itself assigned.
            is_reduced_shard = h.is_assigned_grad(g) or (
                h.is_sharded and g.shape == h.fp32_shard.shape and g.shape != h.orig_size  # type: ignore[union-attr]
            )
            if is_reduced_shard:
                h.grad_before_backward = (h.saved_grad_shard, g)
                if g.device != self.compute_device:
                    # move_grads_to_cpu: the parked shard joins the next reductions, which land on the compute device.
                    g = g.to(self.compute_device)
                h.saved_grad_shard = g if h.saved_grad_shard is None else h.saved_grad_shard + g
                h.keep_intact = h.saved_grad_shard
                p.grad = None
            elif g.shape != h.orig_size:
                raise RuntimeError(
                    f"{h.name}: found a gradient of shape {tuple(g.shape)} that is neither the full shape "
                    f"{tuple(h.orig_size)} nor the shard shape; was p.grad assigned by hand?"
                )

    def _register_post_backward_hooks(self) -> None:
        """Once per handle: a post-accumulate-grad hook (persistent, so hooks never pile up across iterations)."""
        for h in self._handles:
            if h.param.requires_grad and not getattr(h, "post_hook_registered", False):
                h.param.register_post_accumulate_grad_hook(_weak_post_backward_hook(self, h))
                h.post_hook_registered = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def _post_backward_hook(self, h: FlatHandle, param: Tensor) -> None:
        """The full gradient of ``param`` is in ``param.grad``: free params and start its reduction."""
        if param.grad is None or self._tree is None:
            return
        if param.grad.requires_grad:
            raise RuntimeError("FSDP only works with gradients that do not require grad (no double backward)")
        sync = self._require_backward_grad_sync
        if not self._begin_post_backward(h, sync):
            return
        if sync:  # else (no_sync) the full-size gradient stays in p.grad and accumulates
            grad = param.grad
            param.grad = None
            self._start_reduction(h, grad)

    # ------------------------------------------------------------------ optimize_backward_concat
    @torch.no_grad()
    def _on_view_grads_accumulated(self, h: FlatHandle, sync: bool) -> None:
        """Post-backward point of a unit whose views feed the flat buffer (replaces the AccumulateGrad hook)."""
        if self._begin_post_backward(h, sync) and sync:
            self._reduce_accumulated(h)

    def _reduce_accumulated(self, h: FlatHandle) -> None:
        """Reduce-scatter a window's buffer once, exactly as the default path reduces ``flat_param.grad``.

        The buffer has the dtype of that gradient (see grad_accum), so the reduction (fp32_reduce_scatter's cast
        included) is the same code on the same values: gradient shards are bitwise equal with the flag on and off.
        """
        self._start_reduction(h, grad_accum.take_buffer_for_reduction(h))

    # ------------------------------------------------------------------ shared post-backward steps
    def _begin_post_backward(self, h: FlatHandle, sync: bool) -> bool:
        """Common start of a unit's post-backward point: bookkeeping, then reshard.

        Returns:
            False when the work is deferred to the final callback (more gradient pieces may still come from
            checkpointed regions of this unit), True when the caller should go on and reduce (if syncing).
        """
        tree = self._tree
        assert tree is not None
        tree.queue_final_callback()
        if self.training_state == TrainingState.IDLE:
            raise RuntimeError(
                f"the gradient of {h.name} arrived, but no output of this FullyShardedDataParallel's forward got a "
                "gradient hook: return tensors (or tuples, lists, dicts, namedtuples or dataclasses of tensors) from "
                "the wrapped module's forward so FSDP can see them"
            )
        if self.training_state != TrainingState.BACKWARD_PRE and self.training_state != TrainingState.BACKWARD_POST:
            raise RuntimeError(f"post-backward of {h.name} in unexpected state {self.training_state.name}")
        tree.any_post_backward = True
        self.training_state = TrainingState.BACKWARD_POST
        if self._defer_post_backward:
            return False
        if sync or self.reshard_after_forward:
            h.free_full()
        h.use_shard()
        return True

    def _start_reduction(self, h: FlatHandle, grad: Tensor) -> None:
        """Reduce ``grad`` (full, unsharded) on the post-backward stream; the shard lands in ``saved_grad_shard``."""
        tree = self._tree
        assert tree is not None
        tree.post_backward_stream.wait_stream(tree.device.current_stream())
        # The caller drops its reference when this returns: without this, the allocator could hand the gradient's
        # memory to the next backward kernel on the compute stream while the post-backward stream still reads and
        # divides it in place.
        tree.device.record_stream(grad, tree.post_backward_stream)
        with collectives.collective_phase("backward"), tree.device.stream(tree.post_backward_stream):
            self._reduce_grad(h, grad)

    def _reduce_grad(self, h: FlatHandle, grad: Tensor) -> None:
        if self.fp32_reduce_scatter and grad.dtype != h.param.dtype:
            grad = grad.to(h.param.dtype)
        if self.gradient_predivide_factor > 1:
            grad.div_(self.gradient_predivide_factor)
        callback = functools.partial(self._post_reduction_hook, h)
        if h.is_sharded:
            tree = self._tree
            assert tree is not None
            # The reduce-scatter group has the sharding group's size (checked at construction), so padding the flat
            # gradient to shard_numel * world_size lines rank r's chunk up with shard r (chunk-and-pad, spec 1.3).
            flat = grad.reshape(-1)
            padded = h.shard_numel * h.world_size
            if flat.numel() != padded:
                flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
            tree.bucketer.reduce_scatter_flat_async(
                flat.contiguous(), group=self.process_group_reduce_scatter, callback_fn=callback
            )
        else:
            callback(grad)

    def _post_reduction_hook(self, h: FlatHandle, reduced: Tensor) -> None:
        if self.gradient_postdivide_factor > 1:
            reduced.div_(self.gradient_postdivide_factor)
        shard_grad = reduced.to(h.param.dtype)
        if shard_grad._base is not None:
            shard_grad = shard_grad.clone()  # do not keep a whole bucket output alive through a view
        shard_grad = shard_grad.view(h.fp32_shard.shape)  # type: ignore[union-attr]
        if h.saved_grad_shard is None:
            h.saved_grad_shard = shard_grad
        elif h.saved_grad_shard is h.keep_intact:
            # The gradient of completed backwards (or the user's p.grad): a failing backward must be able to go back.
            h.saved_grad_shard = h.saved_grad_shard + shard_grad
        else:
            h.saved_grad_shard.add_(shard_grad)

    def _finalize_backward(self) -> None:
        """Root only, once after the whole backward graph ran (spec 1.12)."""
        tree = self._tree
        assert tree is not None and self._is_root
        syncing = self._require_backward_grad_sync
        if syncing:
            # Gradients not reduced by a post-backward hook: a unit that got no gradient in the synchronizing
            # microbatch (its no_sync sum is still owed), or a unit whose reduction was deferred.
            for m in self._fsdp_instances():
                m._reduce_leftover_grads()
            with collectives.collective_phase("backward"), tree.device.stream(tree.post_backward_stream):
                tree.bucketer.flush()
            tree.device.current_stream().wait_stream(tree.post_backward_stream)
        tree.bucketer.teardown()
        if syncing:
            self._ckpt_step += 1  # the "step" of the checkpoint identity
        # autograd.grad() (e.g. a gradient penalty built with create_graph=True) runs no post-backward point; the
        # graph it built still reads the full parameters of instances that keep them after forward.
        keep_full = not tree.any_post_backward
        for m in self._fsdp_instances():
            m._finalize_instance(syncing, keep_full)
        tree.final_callback_queued = False
        tree.any_post_backward = False
        tree.backward_order.finish()

    @torch.no_grad()
    def _reduce_leftover_grads(self) -> None:
        for h in self._handles:
            if not h.materialized:
                continue
            if h.grad_accum_flat is not None:
                self._reduce_accumulated(h)
            g = h.param.grad
            if g is not None and not h.is_assigned_grad(g) and g.shape == h.orig_size:
                h.param.grad = None
                h.use_shard()
                self._start_reduction(h, g)

    def _finalize_instance(self, syncing: bool, keep_full: bool) -> None:
        for h in self._handles:
            h.grad_before_backward = h.keep_intact = None  # this backward completed: nothing to undo
            if not h.materialized:
                continue  # this instance never ran a forward since its lazy init
            if (syncing and not keep_full) or self.reshard_after_forward:
                h.free_full()
            h.drop_zero2_slice()
            h.use_shard()
            if syncing and h.param.requires_grad and h.saved_grad_shard is not None:
                grad = h.saved_grad_shard
                h.saved_grad_shard = None
                if self.move_grads_to_cpu:
                    grad = grad.to("cpu")
                if grad.dtype != h.param.dtype:
                    grad = grad.to(h.param.dtype)
                h.param.grad = grad
                h.remember_assigned_grad(grad)
        self._pre_backward_hook_has_run = False
        self.training_state = TrainingState.IDLE

    def _summary_state(self) -> Dict[str, Any]:
        """Debug snapshot: handle states and training state (used by tests)."""
        return {
            "training_state": self.training_state,
            "handles": [(h.name, h.state) for h in self._handles],
        }
