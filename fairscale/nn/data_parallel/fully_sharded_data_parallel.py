# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel: the public front. The machinery lives in :mod:`fairscale.nn.data_parallel._fsdp`.

The front is an ``nn.Module`` that owns one :class:`~._fsdp.unit.FSDPUnit` (the typed runtime state: config,
handles, training state); its methods carry the user docstrings and delegate to free functions of ``_fsdp``
(lifecycle in ``runtime``, state dicts in ``state_dict``, checkpoint formats in ``metadata`` and ``optim_state``).
The docs page "Architecture" draws the objects.
"""

import contextlib
from typing import Any, Dict, Generator, Iterator, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch import Tensor, nn

from fairscale.internal.compiler import is_compiling
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.forwarding import refuse_shadowing_assignment
from fairscale.internal.parallel import ProcessGroupName, enable_pytorch_sync_bn
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

from ._fsdp import batchnorm_wrap, compile_support, construction, grad_accum, grad_norm, metadata, optim_state, pickling
from ._fsdp import cleared_window, runtime, summon
from ._fsdp import state_dict as fsdp_state_dict
from ._fsdp.config import make_config
from ._fsdp.ddp_guard import RefuseTorchDDP
from ._fsdp.front_attributes import UnitAttributes
from ._fsdp.handle import FlatHandle
from ._fsdp.storage import alloc_storage_, free_storage_
from ._fsdp.io import cast_inputs
from ._fsdp.naming import clean_path
from ._fsdp.state import HandleState, TrainingState
from ._fsdp.unit import UNIT_ATTR, FSDPUnit

# Names that upstream code imports from this module (upstream defined or imported them here); re-exported so that
# such imports keep working. Checked by tests/test_upstream_api.py.
from math import inf as inf  # noqa: E402

from fairscale.internal.containers import apply_to_tensors as apply_to_tensors  # noqa: E402
from fairscale.internal.errors import p_assert as p_assert  # noqa: E402
from fairscale.internal.parallel import chunk_and_pad as chunk_and_pad  # noqa: E402
from fairscale.internal.parallel import get_process_group_cached as get_process_group_cached  # noqa: E402
from fairscale.internal.parallel import validate_process_group as validate_process_group  # noqa: E402
from fairscale.internal.params import calc_grad_norm as calc_grad_norm  # noqa: E402
from fairscale.internal.params import recursive_copy_to_device as recursive_copy_to_device  # noqa: E402
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer as ReduceScatterBucketer  # noqa: E402
from fairscale.internal.reduce_scatter_bucketer import enable_nccl_base_collectives  # noqa: E402,F401
from fairscale.internal.state_dict import replace_by_prefix_ as replace_by_prefix_  # noqa: E402
from fairscale.nn.wrap.auto_wrap import auto_wrap as auto_wrap  # noqa: E402
from fairscale.nn.wrap.auto_wrap import config_auto_wrap_policy as config_auto_wrap_policy  # noqa: E402
from fairscale.nn.wrap.auto_wrap import enable_wrap as enable_wrap  # noqa: E402

from ._fsdp.batchnorm_wrap import auto_wrap_bn as auto_wrap_bn  # noqa: E402
from ._fsdp.state_dict import no_pre_load_state_dict_hook as no_pre_load_state_dict_hook  # noqa: E402

__all__ = [
    "FullyShardedDataParallel",
    "TrainingState",
    "get_fsdp_instances",
    "cast_floats_to_right_precision",
    "free_storage_",
    "alloc_storage_",
]


class FullyShardedDataParallel(UnitAttributes, nn.Module):
    """A wrapper that shards a module's parameters, gradients and optimizer state across data-parallel ranks.

    Every rank keeps ``1/world_size`` of each owned parameter (its *shard*). Before this instance's forward, and
    again before its backward, the full parameters are rebuilt by an all-gather; after them they are freed, and the
    full gradients are reduce-scattered so every rank ends with the gradient of its shard. The optimizer is built
    on ``model.parameters()`` after wrapping and only ever sees shards. Nested instances (one per transformer block,
    say) keep at most two blocks' full parameters alive at a time: the one computing and the one prefetched.

    This distribution runs on CPU with the gloo backend as well as on CUDA with NCCL, and adds
    ``zero2_process_group``, ``optimize_backward_concat`` and hybrid sharding (``replicate_process_group``). Usage::

        import torch.distributed as dist
        from fairscale.nn import FullyShardedDataParallel as FSDP

        dist.init_process_group("gloo")  # or "nccl"
        model = FSDP(MyModel())
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        loss = model(batch).sum()
        loss.backward()
        optim.step()

    Args:
        module: the module to wrap.
        process_group: the sharding group. ``None`` uses a cached group over all ranks.
        process_group_reduce_scatter: group for the gradient reduce-scatter. ``ProcessGroupName.reduce_scatter``
            (default) creates a second cached all-ranks group so reductions can overlap gathers (a stand-in group,
            ``DummyProcessGroup``, is reused); ``ProcessGroupName.default`` reuses ``process_group``; a ``ProcessGroup``
            must hold ``process_group``'s ranks in its order (``ValueError``); one of another size falls back to it.
        reshard_after_forward: free the full parameters after forward and gather again in backward (ZeRO-3).
            ``False`` keeps them until the end of backward (no second gather).
        disable_reshard_on_root: the root instance never reshards after forward (its backward comes first).
        mixed_precision: keep fp32 master shards but gather, compute and reduce in ``compute_dtype``.
        fp32_reduce_scatter: reduce gradients in fp32 (needs ``mixed_precision``).
        flatten_parameters: flatten the owned parameters into one ``FlatParameter`` (``flat_param_0``).
        move_params_to_cpu: keep the fp32 shards in (pinned) CPU memory and copy them to the device per use.
        compute_dtype: dtype of the gathered parameters; default fp16 with ``mixed_precision``, else fp32. bf16 is
            supported for mixed precision (inputs are then cast to bf16 by the root).
        buffer_dtype: dtype buffers are kept in; default ``compute_dtype``.
        move_grads_to_cpu: put the reduced gradient shards on the CPU; default ``move_params_to_cpu``.
        bucket_cap_mb: size of the reduce-scatter bucket in MiB; ``<= 0`` reduces each gradient on its own.
        compute_device: device for compute; default: the parameters' accelerator, else the current accelerator,
            else CPU (upstream defaulted to CUDA and failed on CPU-only machines).
        no_broadcast_optim_state: keep this instance's optimizer state out of
            :meth:`gather_full_optim_state_dict`'s gather (expert layers in MoE).
        state_dict_device: device of the tensors :meth:`state_dict` returns; default ``compute_device``.
        clear_autocast_cache: call ``torch.clear_autocast_cache()`` after every forward of this instance.
        force_input_to_fp32: without mixed precision, cast fp16/bf16 inputs to fp32.
        verbose: longer :meth:`extra_repr`.
        cpu_offload: deprecated alias of ``move_params_to_cpu``.
        state_dict_on_rank_0_only: :meth:`state_dict` returns an empty dict on every rank but global rank 0.
        gradient_predivide_factor: divide gradients by this before the reduction and by
            ``world_size / factor`` after; default: upstream's power-of-two rule.
        allow_reset_parameters: let :meth:`reset_parameters` forward to the wrapped module.
        zero2_process_group: (fork) a subgroup of ``process_group`` (e.g. the ranks of one node). After forward a
            resharding instance keeps a 1/G slice of its full parameters and rebuilds them in backward with an
            all-gather over this group only. See the docs page "zero2_process_group".
        optimize_backward_concat: (fork) in ``no_sync()`` microbatches, accumulate each parameter's gradient
            directly into one flat buffer instead of concatenating them into the flat gradient on every microbatch.
            Only has an effect with ``flatten_parameters=True``; the rule is that every non-last microbatch runs its
            forward *and* backward inside ``root.no_sync()``.
        forward_prefetch: (fork) while this instance's forward computes, the all-gather of the unit that ran next in
            the previous forward is already in flight (at most one unit ahead). ``True``: always; ``False``: never;
            ``None`` (default): auto, on in a training forward (autograd recording) on CPU when ``backward_prefetch``
            is on, where it does not raise a training step's peak memory; elsewhere off (on accelerators the
            streams already overlap the next unit's gather with this one's compute). See "Communication overlap".
        backward_prefetch: (fork) at this instance's pre-backward point, issue the all-gather of the unit whose
            backward ran next in the previous backward. Changes timing only, never numerics; costs at most one
            extra unit's full parameters of memory. Default ``True`` (upstream has no prefetch). See the docs page
            "Communication overlap".
        replicate_process_group: (fork) hybrid sharding. ``process_group`` is then the shard group (e.g. the ranks of
            one node) and this group joins the ranks holding the same shard in the other shard groups (the same local
            rank on every node). Parameters are sharded, gathered and reduce-scattered inside the shard group only;
            each gradient shard is then all-reduced across this group, and gradients are averaged over all
            ``world_size * replicate size`` ranks. The groups must tile the whole world (checked at the first
            forward, the same error on every rank); :func:`~fairscale.nn.data_parallel.hybrid_groups` builds them.
            Default ``None``: shard over ``process_group`` only. See the docs page "Hybrid sharding".
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[Any] = None,
        process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_grads_to_cpu: Optional[bool] = None,
        bucket_cap_mb: int = 25,
        compute_device: Optional[torch.device] = None,
        no_broadcast_optim_state: Optional[bool] = False,
        state_dict_device: Optional[torch.device] = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: Optional[float] = None,
        allow_reset_parameters: bool = False,
        zero2_process_group: Optional[Any] = None,
        optimize_backward_concat: bool = False,
        forward_prefetch: Optional[bool] = None,
        backward_prefetch: bool = True,
        replicate_process_group: Optional[Any] = None,
    ):
        if not isinstance(module, nn.Module):
            # Before: an AttributeError about .modules() from inside the parameter collection.
            raise TypeError(
                f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}: {module!r}; wrap a "
                "function in a module first"
            )
        construction.refuse_unsupported_layers(module)
        super().__init__()
        params, foreign_params, tie_problems = construction.collect_params_to_own(module, FullyShardedDataParallel)
        config = make_config(
            (p for _, p in params),
            process_group,
            process_group_reduce_scatter,
            reshard_after_forward,
            disable_reshard_on_root,
            mixed_precision,
            fp32_reduce_scatter,
            flatten_parameters,
            move_params_to_cpu or cpu_offload,
            compute_dtype,
            buffer_dtype,
            move_grads_to_cpu,
            bucket_cap_mb,
            compute_device,
            no_broadcast_optim_state,
            state_dict_device,
            clear_autocast_cache,
            force_input_to_fp32,
            verbose,
            state_dict_on_rank_0_only,
            gradient_predivide_factor,
            allow_reset_parameters,
            zero2_process_group,
            optimize_backward_concat,
            forward_prefetch,
            backward_prefetch,
            replicate_process_group,
        )
        self._fsdp_wrapped_module = construction.flatten(
            module, [p for _, p in params], config, flatten_parameters, optimize_backward_concat
        )
        del module  # reachable only through the wrapper from here on
        flat = list(self._fsdp_wrapped_module.flat_params)
        kept = [(n, p) for n, p in params if not flatten_parameters]
        name_groups: List[List[str]] = ([[n for n, _ in params]] if flat else []) + [[n] for n, _ in kept]
        owned: List[nn.Parameter] = flat + [p for _, p in kept]
        backing = [("flat_param_0" if flat and i == 0 else names[0]) for i, names in enumerate(name_groups)]
        handles = construction.shard_parameters(self._fsdp_wrapped_module, owned, backing, config)
        unit = FSDPUnit(self, config, handles, name_groups, len(flat))
        unit.foreign_params, unit.tie_problems = foreign_params, tie_problems
        self.__dict__[UNIT_ATTR] = unit
        self.buffer_size = sum(h.numel for h in handles)
        enable_pytorch_sync_bn(self._fsdp_wrapped_module)
        fsdp_state_dict.register_hooks(self)
        runtime.register_post_backward_hooks(unit)
        grad_accum.install(unit)
        for n, p in self.named_parameters():
            if not hasattr(p, "_is_sharded"):
                raise RuntimeError(f"fairscale internal error: parameter {n} is not managed by any FSDP instance")

    # torch DDP around FSDP would overwrite every rank's shards with rank 0's: its constructor reads this and raises.
    _ddp_params_and_buffers_to_ignore = RefuseTorchDDP()

    # ------------------------------------------------------------------ simple properties
    @property
    def module(self) -> FlattenParamsWrapper:
        """The FlattenParamsWrapper around the user module (the user module is ``self.module.module``)."""
        return self._fsdp_wrapped_module

    @property
    def has_full_params(self) -> bool:
        """Whether this instance's full parameters are currently gathered (upstream's flag, now derived)."""
        return any(h.state == HandleState.FULL for h in self._fsdp_unit.handles)

    def _print_r0(self, msg: str) -> None:
        """Debug print on rank 0 only (upstream helper)."""
        if self.rank == 0:
            allocated = self._fsdp_unit.device.memory_allocated() / 2**20
            print(f"{msg} (device memory allocated: {allocated:.1f} MiB)")

    @property
    def cpu_offload(self) -> bool:
        return bool(self.move_params_to_cpu)

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """Every parameter of the subtree whose ``.grad`` is set."""
        return [p for p in self.parameters() if p.grad is not None]

    def non_shared_params(self) -> List[nn.Parameter]:
        return [h.param for h in self._fsdp_unit.handles if not h.borrowed]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if (name.startswith("__") and name.endswith("__")) or name == "_fsdp_wrapped_module":
                raise  # protocol lookups (__deepcopy__, __getstate__...) must not find the wrapper's
            return getattr(self._fsdp_wrapped_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        wrapped = self._modules.get("_fsdp_wrapped_module") if "_modules" in self.__dict__ else None
        if wrapped is not None:
            refuse_shadowing_assignment(self, wrapped, name, value, "FullyShardedDataParallel")
        super().__setattr__(name, value)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)

    def assert_state(self, state: Union[TrainingState, List[TrainingState]]) -> None:
        """Raise ``ValueError`` unless the instance is in ``state`` (or one of a list of states)."""
        self._fsdp_unit.assert_state(state if isinstance(state, list) else [state])

    def extra_repr(self) -> str:
        c = self._config
        rep = (
            f"world_size={c.world_size}, flatten_parameters={c.flatten_parameters}, mixed_precision={c.mixed_precision}"
        )
        if c.verbose:
            zero2 = c.zero2_size if c.zero2_process_group is not None else None
            rep = (
                f"rank={c.rank}, " + rep + f", reshard_after_forward={self.reshard_after_forward}, "
                f"compute_dtype={c.compute_dtype}, buffer_dtype={c.buffer_dtype}, "
                f"fp32_reduce_scatter={c.fp32_reduce_scatter}, compute_device={c.compute_device}, "
                f"move_params_to_cpu={c.move_params_to_cpu}, move_grads_to_cpu={c.move_grads_to_cpu}, "
                f"bucket_cap_mb={c.bucket_cap_mb}, clear_autocast_cache={c.clear_autocast_cache}, "
                f"force_input_to_fp32={c.force_input_to_fp32}, zero2={zero2}, replicate={c.replicate_size}, "
                f"optimize_backward_concat={c.optimize_backward_concat}"
            )
        return rep

    # ------------------------------------------------------------------ forward and backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():  # one call per unit and forward when not compiling (this runs for every unit)
            return compile_support.forward_outside_compiler(self, args, kwargs)
        return runtime.forward(self._fsdp_unit, args, kwargs)

    def _lazy_init(self) -> None:
        runtime.lazy_init(self._fsdp_unit)

    def _reset_lazy_init(self) -> None:
        """Forget this instance's lazy initialisation (whether it is the root, its tree, its materialised shards), as
        before its first forward; the next forward or call redoes it.

        Upstream's private hook, which fairseq calls on every instance inside a module before wrapping that module in
        a new root (``fsdp_wrap``) and vissl after loading a checkpoint into a model that ran forward already.

        Raises:
            ValueError: a forward or backward of this instance's tree is in progress.
            RuntimeError: a forward's backward is still to run (it would find the instance uninitialised).
        """
        runtime.reset_lazy_init_between_steps(self._fsdp_unit)

    def _finalize_backward(self) -> None:
        """The end-of-backward callback the tree queues (looked up at lazy init, so it can be wrapped)."""
        runtime.finalize_backward(self._fsdp_unit)

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (unsharded, no communication) until the context exits.

        Call it on the root instance, outside forward/backward. The first backward after the context reduces the
        sum of all accumulated gradients.
        """
        with runtime.no_sync(self._fsdp_unit):
            yield

    # ------------------------------------------------------------------ full params
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Generator[None, None, None]:
        """Expose full, full-precision parameters on every rank for the duration of the context.

        The user module then has real ``nn.Parameter`` objects with their original names and shapes. Collective:
        call it on all ranks. Not usable inside forward/backward.

        Args:
            recurse: also summon every nested instance.
            volatile: do not copy edits of the full parameters back into the shards on exit. As upstream says, such
                edits are then not guaranteed to be discarded either: where the shard is the whole parameter (world
                size 1, or hybrid sharding over a one-rank shard group) the full parameter is the shard itself, and
                an edit stays.
        """
        with summon.summon_full_params(self._fsdp_unit, recurse=recurse, volatile=volatile):
            yield

    def apply(self, fn: Any) -> "FullyShardedDataParallel":
        """Like ``nn.Module.apply`` but with this instance's full parameters summoned while ``fn`` runs."""
        if summon.tree_summoned(self._fsdp_unit):  # inside the user's summon_full_params(): full already
            return super().apply(fn)
        self._fsdp_unit.assert_idle_tree("apply")
        with runtime.lazy_init_for_call(self._fsdp_unit), self.summon_full_params(recurse=False):
            super().apply(fn)
        return self

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "FullyShardedDataParallel":
        """``.to()/.half()/.float()/.cuda()``: allowed only when idle; shards are moved, lazy init is redone."""
        with runtime.moving(self._fsdp_unit):
            cast(Any, super())._apply(fn, *args, **kwargs)
        return self

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0) -> Tensor:
        """Clip the gradient norm of all parameters of the tree (root only); returns the total norm.

        The norm is computed over the sharded gradients and combined across the ranks of the process group, so the
        result equals ``torch.nn.utils.clip_grad_norm_`` on the unwrapped model (an fp32 norm, float64 for float64
        gradients). Under tensor parallelism (FSDP over
        the data-parallel group) it is the norm of this model-parallel rank's slices only: see "Gradient clipping
        under tensor parallelism" in the model-parallel docs.

        Raises:
            ValueError: ``max_norm`` is negative or NaN, or ``norm_type`` is not a positive number or inf.
            TypeError: ``max_norm`` or ``norm_type`` is a ``bool``.
            RuntimeError: called after a backward inside :meth:`no_sync` whose gradients are not reduced yet on any
                rank (on every rank; call it after the window's last backward), or on a nested instance.
            RanksDisagreeError: (a ``ValueError``) the ranks passed different ``max_norm`` or ``norm_type``; on
                every rank, gradients unchanged.
        """
        if isinstance(max_norm, bool) or isinstance(norm_type, bool):  # True was taken for 1.0
            raise TypeError(f"clip_grad_norm_: max_norm and norm_type must be numbers, got {max_norm!r}, {norm_type!r}")
        runtime.lazy_init(self._fsdp_unit)
        # Before the gradients are listed: recovering from a backward that raised gives back the earlier ones.
        runtime.recover_between_steps(self._fsdp_unit)
        cleared_window.settle_cleared_windows(self._fsdp_unit)  # zero_grad(set_to_none=False) inside no_sync()
        grads = [p.grad for p in self.params_with_grad if p.grad is not None]
        return grad_norm.clip_grad_norm_(self._fsdp_unit, grads, float(max_norm), float(norm_type))

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Set the pre- and post-reduction divide factors (optionally for every nested instance)."""
        self.assert_state(TrainingState.IDLE)
        for name, value in (("pre", pre), ("post", post)):
            if not (isinstance(value, (int, float)) and 0 < float(value) < float("inf")):
                raise ValueError(f"set_gradient_divide_factors: {name} must be a positive finite number, got {value!r}")
        targets = get_fsdp_instances(self) if recursive else [self]
        for m in targets:
            m.assert_state(TrainingState.IDLE)
            u = m._fsdp_unit
            u.config = u.config.replace(gradient_predivide_factor=float(pre), gradient_postdivide_factor=float(post))

    def reset_parameters(self) -> None:
        """Forward to the wrapped module's ``reset_parameters`` when ``allow_reset_parameters=True``."""
        if not self.allow_reset_parameters:
            raise RuntimeError(
                "FullyShardedDataParallel.reset_parameters() is disabled; pass allow_reset_parameters=True to "
                "forward it to the wrapped module (it then runs on the full parameters)."
            )
        with self.summon_full_params(recurse=False):
            reset: Any = getattr(self._fsdp_wrapped_module.module, "reset_parameters")
            reset()

    def append_shared_param(self, p: nn.Parameter) -> None:
        """(Experimental) Also treat ``p``, owned by a sibling instance, as used by this instance."""
        unit = self._fsdp_unit
        if unit.is_root is not None:
            raise FairscaleRuntimeError("append_shared_param must be called before the first forward (lazy init)")
        if unit.config.flatten_parameters:
            raise FairscaleRuntimeError("append_shared_param needs flatten_parameters=False")
        if not unit.handles:
            raise FairscaleRuntimeError("append_shared_param needs the instance to own at least one parameter")
        if not hasattr(p, "_is_sharded"):
            raise FairscaleValueError(
                "append_shared_param expects a parameter already sharded by another FSDP instance"
            )
        # The flag lives on this instance's handle, not on the parameter: the owner must keep treating it as its own.
        unit.handles.append(FlatHandle(p, "shared", unit.config.world_size, unit.config.rank, 0, borrowed=True))
        unit.has_shared_params = True

    # ------------------------------------------------------------------ naming
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        """Raw names when flattened (outside summon); otherwise names without the wrapper path components."""
        in_summon = any(u.training_state == TrainingState.SUMMON_FULL_PARAMS for u in self._fsdp_unit.tree_units())
        raw = self.flatten_parameters and not in_summon
        for name, p in super().named_parameters(*args, **kwargs):
            yield (name if raw else clean_path(name)), p

    # ------------------------------------------------------------------ state dicts
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The full (unsharded) state dict: the unwrapped module's keys, fp32 values. Collective: call on all ranks.

        Safe at any point of a step, including between a forward and its backward.
        """
        return fsdp_state_dict.state_dict(self._fsdp_unit, *args, **kwargs)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """This rank's shards: ``[path.]flat_param_0`` padded 1-D shards, buffers with their clean names.

        The dict's ``_metadata`` table records the checkpoint identity (id, rank, world size, step) that
        :meth:`local_metadata_dict` also reports; consolidation and :meth:`load_local_state_dict` check it.
        """
        return fsdp_state_dict.local_state_dict(self._fsdp_unit, *args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (the unwrapped module's keys). Collective: call it on every rank. All-or-nothing.

        Either every rank loads, or every rank raises the same error and leaves the model unchanged (one small
        ``all_gather_object`` decides).

        Raises:
            RuntimeError: when called between a forward and its backward, or when keys/shapes do not match (the
                model is then left exactly as it was).
        """
        return fsdp_state_dict.load_state_dict(self._fsdp_unit, state_dict, strict)

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's shards from :meth:`local_state_dict` output of an identically wrapped model.

        Collective, like :meth:`load_state_dict`: every rank loads or every rank raises and nothing changes. A dict
        that records its checkpoint identity must be this rank's of a checkpoint saved at this world size, and all
        ranks must load shards of the same checkpoint.
        """
        return fsdp_state_dict.load_local_state_dict(self._fsdp_unit, state_dict, strict)

    # ------------------------------------------------------------------ checkpoint formats
    def local_metadata_dict(self) -> Dict[str, Any]:
        """This rank's sharding metadata, to save next to :meth:`local_state_dict` (upstream's format).

        With every rank's local state dict and metadata, :meth:`consolidate_shard_weights` rebuilds the full
        state dict offline. No communication.
        """
        return metadata.local_metadata_dict(self._fsdp_unit)

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: List[Dict[str, Tensor]],
        shard_metadata: List[Dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> Dict[str, Tensor]:
        """Rebuild the full state dict from every rank's :meth:`local_state_dict` and :meth:`local_metadata_dict`.

        Works on CPU without a process group. See :func:`fairscale.nn.data_parallel._fsdp.metadata.
        consolidate_shard_weights` for the details.

        Args:
            shard_weights: every rank's local state dict: in rank order for upstream's files; files written here
                say which rank saved them and may come in any order.
            shard_metadata: every rank's local metadata dict, in the same order as ``shard_weights``.
            with_module_buffers: also copy the buffers (from rank 0).
            strict: raise on entries the metadata lists but the weights lack (else skip them).

        Returns:
            The full state dict, with the unwrapped module's keys.
        """
        return metadata.consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers, strict)

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored: Any) -> Optional[Dict[str, Any]]:
        """Gather the optimizer state of every rank into one unsharded dict, returned on rank 0 of the root's group.

        Collective: call it on every rank. The result has one ``state`` entry per original (unflattened)
        parameter, with full-shape tensors on the CPU, plus ``param_groups``, ``param_id_map`` and
        ``uncollected_local_ids`` (upstream's format). The optimizer itself is not modified. Needs
        ``flatten_parameters=True``, one parameter group, and an optimizer built on ``model.parameters()``.

        Args:
            optim: the optimizer over this model's parameters.
            **ignored: accepted for upstream compatibility (e.g. ``recipient_rank``, which warns if not 0), unused.

        Returns:
            The full optimizer state dict on rank 0 of the root instance's process group (the global rank 0 when it
            shards over the world; each data-parallel leader under tensor parallelism; with hybrid sharding, of the
            first replica's shard group), ``None`` on the other ranks.
        """
        return optim_state.gather_full_optim_state_dict(self._fsdp_unit, optim, **ignored)

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's optimizer state dict, cut from a :meth:`gather_full_optim_state_dict` result.

        The full dict may come from any world size; every instance is sharded over its own process group. No
        communication; ``full_optim_state_dict`` is left unchanged (upstream modified it in place). Load the
        result with ``optim.load_state_dict``.

        Args:
            full_optim_state_dict: the gathered dict (e.g. loaded from a checkpoint).

        Returns:
            The sharded optimizer state dict for this rank.
        """
        return optim_state.get_shard_from_optim_state_dict(self._fsdp_unit, full_optim_state_dict)

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (``torch.save(model)``): writes a deep copy without the stale parameter views (see
        ``_fsdp/pickling.py``); process groups do not cross (set them again after loading). Only between steps."""
        if pickling.is_copy_for_pickling(self):
            return super().__reduce_ex__(protocol)
        return pickling.reduce_to_copy(self, self._fsdp_unit)

    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__)  # the unit drops what cannot cross processes (process groups, tree)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FullyShardedDataParallel":
        """``copy.deepcopy``: an independent model on the same process groups (e.g. an EMA copy), usable at once.

        Every rank must copy alike (the copy's forward communicates like the original's). Only between steps: a copy
        of a model whose forward's backward is pending, or that is inside a forward or backward, is refused.
        """
        return cast(FullyShardedDataParallel, pickling.deep_copy(self, self._fsdp_unit, memo))

    def __setstate__(self, state: Dict[str, Any]) -> None:
        cast(Any, super()).__setstate__(state)
        pickling.relink_copy(self, self._fsdp_unit)


def get_fsdp_instances(mod: nn.Module, skip_empty: bool = False) -> List[FullyShardedDataParallel]:
    """Every FSDP instance in ``mod.modules()`` (pre-order, ``mod`` included).

    Args:
        mod: the module to search.
        skip_empty: drop instances that own no (non-shared) parameters.
    """
    found = [m for m in mod.modules() if isinstance(m, FullyShardedDataParallel)]
    if skip_empty:
        found = [m for m in found if len(m.non_shared_params()) > 0]
    return found


def cast_floats_to_right_precision(to_fp16: bool, no_grad: bool, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
    """Cast floating tensors among ``args``/``kwargs`` to fp16 (``to_fp16``) or from fp16 to fp32 (upstream helper)."""
    if to_fp16:
        return cast(Tuple[Any, Any], cast_inputs(torch.float16, (torch.float32,), no_grad, args, kwargs))
    return cast(Tuple[Any, Any], cast_inputs(torch.float32, (torch.float16,), no_grad, args, kwargs))


batchnorm_wrap.register_wrapper_class(FullyShardedDataParallel)
